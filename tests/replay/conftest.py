from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")


@pytest.fixture(params=["read-whole", "mapped"])
def tensor_file_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both ways of opening a tensor file: small files read whole, large ones mapped."""
    from iobundle.replay import _tensorfile

    if request.param == "mapped":
        monkeypatch.setattr(_tensorfile, "SMALL_FILE_BYTES", -1)
    return str(request.param)
