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
        ("iobundle.calls", ("torch", "numpy", *ONNX_STACK, "transformers")),  # torch when a tensor is touched
        ("iobundle.travel", ("torch", "numpy", *ONNX_STACK, "transformers")),
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


def test_replay_imports_without_onnx() -> None:
    """``import iobundle.replay`` is cheap: its names are imported when first used; ``Bundle`` needs no torch."""
    loaded = _loaded_after("import iobundle.replay\nassert iobundle.replay.Bundle")
    assert [name for name in ("torch", "numpy", *ONNX_STACK, "transformers") if name in loaded] == []


def test_reading_a_plain_bundle_imports_no_onnx_nor_transformers(tmp_path) -> None:
    """Open a plain-tensor bundle, infer its dynamic shapes and arguments: no onnx, no transformers."""
    path = tmp_path / "plain.iobundle"
    loaded = _loaded_after(
        "import torch\n"
        "from iobundle.capture import CallRecorder\n"
        "model = torch.nn.Linear(4, 2)\n"
        "rec = CallRecorder()\n"
        "with rec(model, store_n_calls=3):\n"
        "    for n in (2, 3, 5):\n"
        "        model(torch.randn(n, 4))\n"
        f"rec.save({str(path)!r})\n"
        "import sys\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime', 'onnxscript', 'transformers')]\n"
        "from iobundle.replay import load_bundle\n"
        f"bundle = load_bundle({str(path)!r})\n"
        "shapes = bundle.infer_dynamic_shapes()\n"
        "assert shapes, shapes\n"
        "assert bundle.infer_arguments() is not None"
    )
    assert [name for name in (*ONNX_STACK, "transformers") if name in loaded] == []
