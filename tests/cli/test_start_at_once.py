"""Commands that read only manifests and files start at once: each one's import set, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver

HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy")

# Runs `iobundle ARGV` in this interpreter, then says which heavy modules it imported.
RUN = (
    "import json, sys\n"
    "from iobundle.cli import main\n"
    "code = main(sys.argv[1:])\n"
    f"imported = [m for m in {HEAVY!r} if m in sys.modules]\n"
    'print(json.dumps({"code": code, "imported": imported}))\n'
)


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("start") / "run.iobundle"
    model, observer = Small(), InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=3):
        for n in (1, 2, 3):
            model(torch.randn(n, 4), mask=torch.ones(n))
    observer.save(path)
    return path


def _run(argv: list[str], cwd: Path) -> tuple[dict[str, object], str]:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    return json.loads(lines[-1]), proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "{bundle}"],
        ["pack", "{bundle}", "-o", "{tmp}/run.iobundle.tar"],
        ["unpack", "{packed}", "-o", "{tmp}/unpacked.iobundle"],
        ["inspect", "{bundle}"],
        ["shapes", "--json", "{bundle}"],
        ["shapes", "{bundle}", "--batch-all", "--dim-names"],
    ],
    ids=["verify", "pack", "unpack", "inspect", "shapes-json", "shapes-named"],
)
def test_file_commands_import_no_torch_transformers_or_onnx(bundle: Path, tmp_path: Path, argv: list[str]) -> None:
    packed = tmp_path / "given.iobundle.tar"
    from iobundle.travel import pack_bundle

    pack_bundle(bundle, packed)
    args = [a.format(bundle=bundle, tmp=tmp_path, packed=packed) for a in argv]
    result, output = _run(args, tmp_path)
    assert result["code"] == 0, output
    assert result["imported"] == [], output


@pytest.mark.parametrize("command", ["inspect", "verify", "shapes", "pack"])
def test_a_missing_path_is_said_before_anything_heavy_is_imported(tmp_path: Path, command: str) -> None:
    argv = [command, str(tmp_path / "nowhere.iobundle")] + (
        ["-o", str(tmp_path / "p.tar")] if command == "pack" else []
    )
    result, output = _run(argv, tmp_path)
    assert result["code"] == 2, output
    assert "nowhere.iobundle' does not exist" in output
    assert result["imported"] == [], output


def test_verify_still_finds_a_damaged_file_without_torch(bundle: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "damaged.iobundle"
    shutil.copytree(bundle, copy)
    victim = sorted((copy / "calls").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, another hash
    victim.write_bytes(bytes(data))
    result, output = _run(["verify", str(copy)], tmp_path)
    assert result["code"] == 5, output
    assert victim.name in output and result["imported"] == [], output


def test_inspect_and_shapes_without_torch_still_say_the_dynamic_dims(bundle: Path, tmp_path: Path) -> None:
    result, output = _run(["shapes", "--json", str(bundle)], tmp_path)
    assert result["imported"] == [], output
    shapes, _ = json.JSONDecoder().raw_decode(output)  # the command's JSON, then the runner's line
    assert shapes == {"x": {"0": "DYNAMIC"}, "mask": {"0": "DYNAMIC"}}
    result, output = _run(["inspect", str(bundle)], tmp_path)
    assert result["imported"] == [], output
    assert "{'x': {0: Dim.DYNAMIC}, 'mask': {0: Dim.DYNAMIC}}" in output
