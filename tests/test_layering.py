"""Each layer imports without the layers above it (DESIGN.md, "Architecture"); checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest

ONNX_STACK = ("onnx", "onnxruntime", "onnxscript")


def _loaded_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter and return the top-level modules it left in ``sys.modules``."""
    script = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("iobundle.errors", ("torch", "pydantic", "numpy", *ONNX_STACK)),
        ("iobundle", ("torch", "pydantic", "numpy", "safetensors", *ONNX_STACK)),
        ("iobundle.schema", ("torch", "numpy", "safetensors", *ONNX_STACK)),
        ("iobundle.calls", (*ONNX_STACK, "transformers")),
        ("iobundle.capture", (*ONNX_STACK, "transformers")),
        ("iobundle.cli", ("torch", "numpy", "safetensors", "pydantic", "rich", *ONNX_STACK)),
    ],
)
def test_import_does_not_pull_in(module: str, absent: tuple[str, ...]) -> None:
    loaded = _loaded_after(f"import {module}")
    assert "iobundle" in loaded
    assert [name for name in absent if name in loaded] == []


def test_cli_help_does_not_load_torch() -> None:
    loaded = _loaded_after(
        "import contextlib, io\n"
        "from iobundle.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        "    assert main(['shapes', '--help']) == 0"
    )
    assert [name for name in ("torch", "pydantic", "rich") if name in loaded] == []


def test_replay_imports() -> None:
    """The top layer imports at all (the lower layers are checked above)."""
    assert "torch" in _loaded_after("import iobundle.replay")
