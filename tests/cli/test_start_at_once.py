"""Commands that read only manifests and files start at once: each one's import set, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama, tiny_whisper

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


# --------------------------------------------------------------------------- bundles of transformers' caches


@pytest.fixture(scope="module")
def llm_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Bundles captured from real generate() calls: a 2-layer Llama (DynamicCache) and a Whisper decoder (EncoderDecoderCache)."""
    root = tmp_path_factory.mktemp("llm")
    llama = tiny_llama()
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    observer = InputObserver()
    with torch.no_grad(), observer(llama, store_n_calls=4):
        llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    observer.save(root / "llama.iobundle")
    observer.save(root / "stored.iobundle", include_model=True)  # the bundle stores its model
    whisper = tiny_whisper()
    features = torch.randn(1, 8, 30, generator=torch.Generator().manual_seed(3))
    decoder = InputObserver()
    with torch.no_grad(), decoder(whisper.model.decoder, store_n_calls=4):
        whisper.generate(features, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    decoder.save(root / "decoder.iobundle")
    return {"llama": root / "llama.iobundle", "decoder": root / "decoder.iobundle", "stored": root / "stored.iobundle"}


@pytest.mark.parametrize("family", ["llama", "decoder", "stored"])
@pytest.mark.parametrize(
    "argv", [["inspect"], ["shapes", "--json"], ["shapes"]], ids=["inspect", "shapes-json", "shapes-text"]
)
def test_file_commands_on_a_generate_bundle_import_no_torch_transformers_or_onnx(
    llm_bundles: dict[str, Path], tmp_path: Path, family: str, argv: list[str]
) -> None:
    result, output = _run([*argv, str(llm_bundles[family])], tmp_path)
    assert result["code"] == 0, output
    assert result["imported"] == [], output


def test_shapes_of_a_generate_bundle_without_torch_still_count_the_empty_prefill_cache(
    llm_bundles: dict[str, Path], tmp_path: Path
) -> None:
    # Whisper's cross-attention cache is None at the prefill and the encoder's length in every
    # decode call: only the cache layout (a None layer stands for a zero-length sequence) makes it dynamic.
    result, output = _run(["shapes", "--json", str(llm_bundles["decoder"])], tmp_path)
    assert result["imported"] == [], output
    shapes, _ = json.JSONDecoder().raw_decode(output)
    assert shapes["cache"] == [[{"2": "DYNAMIC"}, {"2": "DYNAMIC"}], [{"2": "DYNAMIC"}, {"2": "DYNAMIC"}]]
    result, output = _run(["shapes", "--json", str(llm_bundles["llama"])], tmp_path)
    assert result["imported"] == [], output
    shapes, _ = json.JSONDecoder().raw_decode(output)
    assert shapes["cache"] == [{"2": "DYNAMIC"}] * 4
