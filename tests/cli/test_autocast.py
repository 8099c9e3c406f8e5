"""Captures made under ``torch.autocast`` export and validate on a CPU with the default options.

The models keep float32 weights; their ``generate()`` (a decoder-only Llama) or forward calls (a
BERT encoder) run under ``torch.autocast("cpu", dtype=torch.bfloat16)``, which stands in for the
``torch.autocast("cuda", ...)`` of a GPU box: the recorded outputs, and the Llama's cache, hold
bfloat16 precision (some in float32 tensors). The bundle says so per call; export traces the
program under the same autocast (its matmuls cast to bfloat16) and reproduces every recorded call
exactly; validate runs its float32 copy (onnxruntime's CPU provider has no bfloat16 kernels) with
bfloat16's tolerances for every float output. A changed model recorded the same way fails, and a
call recorded under CUDA autocast re-runs under CPU autocast, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.cli import main

transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.xdist_group("autocast")  # one worker captures and exports every bundle once

BF16 = torch.bfloat16


def _perturbed(model: Any, linear: torch.nn.Linear) -> Any:
    """``model`` with ``linear``'s weights changed (a regression)."""
    with torch.no_grad():
        linear.weight.add_(torch.randn(linear.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    return model


def _llama(changed: bool) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return _perturbed(model, model.lm_head) if changed else model


def _bert(changed: bool) -> Any:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    return _perturbed(model, model.encoder.layer[1].output.dense) if changed else model


def capture(root: Path, changed: bool) -> None:
    """``llama`` and ``bert`` bundles recorded under CPU autocast in bfloat16 (``*_changed``: the perturbed models)."""
    suffix = "_changed" if changed else ""
    llama = _llama(changed)
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    prompt[0, :2], mask[0, :2] = 0, 0
    observer = InputObserver()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16), observer(llama, store_n_calls=10):
        llama.generate(prompt, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    observer.save(root / f"llama{suffix}.iobundle", include_model=True)
    bert, observer = _bert(changed), InputObserver()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16), observer(bert):
        for n in (5, 7):
            ids = torch.randint(3, 100, (2, n), generator=torch.Generator().manual_seed(n))
            bert(ids, attention_mask=torch.ones_like(ids))
    observer.save(root / f"bert{suffix}.iobundle", include_model=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every bundle captured; each unchanged one exported from itself with the CLI's defaults (its output kept)."""
    root = tmp_path_factory.mktemp("autocast")
    capture(root, changed=False)
    capture(root, changed=True)
    outputs = {}
    for family in ("llama", "bert"):
        argv = ["export", str(root / f"{family}.iobundle"), "--from-bundle", "--batch-all"]
        code, text = _run([*argv, "-o", str(root / f"{family}.onnx")])
        assert code == 0, text
        outputs[family] = text
    return {"root": root, "export": outputs}


def _run(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` and what it printed (stdout and stderr)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def test_the_bundle_records_the_autocast_state_of_each_call(exported: dict[str, Any]) -> None:
    bundle = load_bundle(exported["root"] / "llama.iobundle")
    states = {json.dumps([a.model_dump() for a in c.autocast or []]) for c in bundle.manifest.calls}
    assert states == {'[{"device_type": "cpu", "dtype": "BF16", "enabled": true}]'}
    prefill, decode = bundle.outputs(0), bundle.outputs(1)
    assert prefill["logits"].dtype == BF16  # the weights are float32; autocast ran lm_head in bfloat16
    cache = decode["past_key_values"]
    assert {cache.layers[0].keys.dtype, cache.layers[0].values.dtype} == {torch.float32, BF16}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_an_autocast_capture_exports_and_validates_by_default(exported: dict[str, Any], family: str) -> None:
    root = exported["root"]
    text = exported["export"][family]
    assert "traced and checked under torch.autocast('cpu', bfloat16), as the calls were recorded" in text
    assert "PASS" in text and "recorded calls reproduced" in text
    model = onnx.load(str(root / f"{family}.onnx"))
    casts = {a.i for n in model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    weights = {t.data_type for t in model.graph.initializer}
    # the program computes in bfloat16 as autocast did: casts of activations, weights cast once at export
    assert onnx.TensorProto.BFLOAT16 in casts and onnx.TensorProto.BFLOAT16 in weights
    code, out = _run(["validate", str(root / f"{family}.iobundle"), str(root / f"{family}.onnx")])
    assert code == 0, out
    assert "PASS" in out and "FAIL" not in out and "not checked" not in out
    assert "recorded under torch.autocast(bfloat16): float32 outputs take its row" in out
    assert "float32: atol=0.02 rtol=0.1" in out
    assert "bfloat16 program validated through a float32 copy" in out


@pytest.mark.slow
def test_the_program_reproduces_the_recorded_calls_exactly(exported: dict[str, Any]) -> None:
    """Traced under the recorded autocast, the program computes what the recorded model computed."""
    text = exported["export"]["llama"]
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and " ok " in line]
    assert len(rows) == 4 and all(float(r[2]) == 0.0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_changed_model_under_autocast_fails(exported: dict[str, Any], family: str) -> None:
    root = exported["root"]
    code, out = _run(["validate", str(root / f"{family}_changed.iobundle"), str(root / f"{family}.onnx")])
    assert code == 1 and "FAIL: 0/" in out


def test_a_cuda_autocast_capture_reruns_under_cpu_autocast(exported: dict[str, Any], tmp_path: Path) -> None:
    """A GPU box's ``torch.autocast("cuda", ...)`` is replayed as CPU autocast of the same dtype, and said so."""
    import shutil

    bundle = tmp_path / "cuda.iobundle"
    shutil.copytree(exported["root"] / "bert.iobundle", bundle)
    text = (bundle / "manifest.json").read_text("utf-8")
    recorded = '"autocast":[{"device_type":"cpu","dtype":"BF16","enabled":true}]'
    as_on_gpu = (
        '"autocast":[{"device_type":"cuda","dtype":"BF16","enabled":true},'
        '{"device_type":"cpu","dtype":"BF16","enabled":false}]'
    )
    assert text.count(recorded) == 2
    (bundle / "manifest.json").write_text(text.replace(recorded, as_on_gpu), "utf-8")
    code, out = _run(["run", str(bundle), "--from-bundle"])
    assert code == 0, out
    assert "eager model under torch.autocast('cpu', bfloat16) (recorded under 'cuda', mapped to 'cpu')" in out
    assert "PASS: 2/2" in out


def test_inspect_says_which_calls_ran_under_autocast() -> None:
    golden = Path(__file__).parents[1] / "data" / "bundles" / "autocast"
    code, out = _run(["inspect", str(golden)])
    assert code == 0
    assert "autocast   torch.autocast cpu BF16 on 2 of 3 calls (replay runs the model under it)" in out
