from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for the plain helper module observing.py beside the tests

pytest.importorskip("onnxruntime")


@pytest.fixture(params=["read-whole", "mapped"])
def tensor_file_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both ways of opening a tensor file: small files read whole, large ones mapped."""
    from iobundle.calls import _tensorfile_read as _tensorfile

    if request.param == "mapped":
        monkeypatch.setattr(_tensorfile, "READ_WHOLE_BYTES", -1)
    return str(request.param)


@pytest.fixture(params=["memory", "reloaded"])
def where(request: pytest.FixtureRequest) -> str:
    """Run a test on the observer in memory and on its bundle reloaded (see ``observing.source``)."""
    return str(request.param)
