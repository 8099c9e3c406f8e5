"""Half precision end to end: bfloat16 and float16 captures export and validate on a CPU with default options.

Tiny models built from configs (nothing downloaded) are cast to each dtype and observed during a
real ``generate()``: a decoder-only Llama, and Whisper's encoder and decoder (an encoder-decoder).
Each bundle is exported from itself (``--from-bundle``) and validated through the CLI. onnxruntime's
CPU provider has no bfloat16 kernel for Mul or Conv, so a bfloat16 program is validated through its
float32 copy, and the verdict says so; float16 runs as it is. The tolerances are the dtype's
defaults. A changed model (its output projection perturbed) recorded on the same inputs fails
against the same program, in both dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama, tiny_whisper

from iobundle import InputObserver
from iobundle.cli import main

transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.xdist_group("half-precision")  # one worker captures and exports every bundle once

DTYPES = ("bfloat16", "float16")
COPY = "bfloat16 program validated through a float32 copy"


def _llama(dtype: torch.dtype, changed: bool) -> Any:
    model = tiny_llama(layers=1)  # one layer holds every op the dtype changes; a second only lengthens the export
    if changed:  # a regression: the output projection's weights perturbed
        with torch.no_grad():
            model.lm_head.weight.add_(
                torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.1
            )
    return model.to(dtype)


def _whisper(dtype: torch.dtype, changed: bool) -> Any:
    model = tiny_whisper()
    if changed:
        with torch.no_grad():
            for layer in (model.model.encoder.layers[0].fc2, model.model.decoder.layers[0].fc2):
                layer.weight.add_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    return model.to(dtype)


def capture(root: Path, dtype_name: str, changed: bool) -> None:
    """``llama``, ``encoder`` and ``decoder`` bundles of one dtype (``*_changed`` from the perturbed models)."""
    dtype = getattr(torch, dtype_name)
    suffix = f"{dtype_name}{'_changed' if changed else ''}"
    llama = _llama(dtype, changed)
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    prompt[0, :2], mask[0, :2] = 0, 0
    observer = InputObserver()
    with torch.no_grad(), observer(llama, store_n_calls=10):
        llama.generate(prompt, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    observer.save(root / f"llama_{suffix}.iobundle", include_model=True)
    whisper = _whisper(dtype, changed)
    features = torch.randn(1, 8, 30, generator=torch.Generator().manual_seed(3)).to(dtype)
    encoder, decoder = InputObserver(), InputObserver()
    with (
        torch.no_grad(),
        encoder(whisper.model.encoder, store_n_calls=4),
        decoder(whisper.model.decoder, store_n_calls=10),
    ):
        whisper.generate(features, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    encoder.save(root / f"encoder_{suffix}.iobundle", include_model=True)
    decoder.save(root / f"decoder_{suffix}.iobundle", include_model=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every bundle captured, and each unchanged one exported from itself with the CLI's defaults."""
    root = tmp_path_factory.mktemp("half")
    for dtype in DTYPES:
        capture(root, dtype, changed=False)
        capture(root, dtype, changed=True)
        for family in ("llama", "encoder", "decoder"):
            name = f"{family}_{dtype}"
            argv = ["export", str(root / f"{name}.iobundle"), "--from-bundle", "--batch-all", "-q"]
            assert main([*argv, "-o", str(root / f"{name}.onnx")]) == 0, name
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "encoder", "decoder"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_precision_capture_validates_by_default(exported: Path, dtype: str, family: str, capsys: Any) -> None:
    onnx_path = exported / f"{family}_{dtype}.onnx"
    half = {"bfloat16": onnx.TensorProto.BFLOAT16, "float16": onnx.TensorProto.FLOAT16}[dtype]
    assert any(
        t.data_type == half for t in onnx.load(str(onnx_path)).graph.initializer
    )  # the recorded dtype's program ...
    before = onnx_path.read_bytes()
    capsys.readouterr()
    assert main(["validate", str(exported / f"{family}_{dtype}.iobundle"), str(onnx_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out
    assert f"({dtype}: atol=" in out  # the dtype's row of the table decided
    assert (COPY in out) is (dtype == "bfloat16")  # onnxruntime's CPU provider runs float16, not bfloat16
    assert onnx_path.read_bytes() == before  # ... and stays on disk as it was


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "encoder", "decoder"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_changed_model_fails_in_half_precision(exported: Path, dtype: str, family: str, capsys: Any) -> None:
    capsys.readouterr()
    changed = exported / f"{family}_{dtype}_changed.iobundle"
    assert main(["validate", str(changed), str(exported / f"{family}_{dtype}.onnx")]) == 1
    assert "FAIL: 0/" in capsys.readouterr().out


@pytest.mark.slow
def test_every_report_names_the_float32_copy(exported: Path, capsys: Any) -> None:
    reports = [exported / f"llama.{ext}" for ext in ("md", "html", "json", "csv")]
    argv = ["validate", str(exported / "llama_bfloat16.iobundle"), str(exported / "llama_bfloat16.onnx")]
    assert main([*argv, *(a for r in reports for a in ("--report", str(r)))]) == 0
    assert COPY in capsys.readouterr().out
    md, html, js, csv = (r.read_text() for r in reports)
    assert "bfloat16 program validated through a float32 copy" in md.replace("\\", "")
    assert COPY in html and [r["ran"] for r in json.loads(js)] == [COPY] * 4  # JSON: the rows, each says how it ran
    assert csv.splitlines()[0].split(",").count("ran") == 1 and csv.count(COPY) == 4
