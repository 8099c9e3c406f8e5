"""Real LLMs: transformers models captured from ``generate()``, exported and validated from the bundle alone.

Each family is a tiny model built from a config here (random weights, fixed seed; nothing
is downloaded), observed during a real ``generate()`` and saved as a self-contained bundle
(``include_model=True``: config and weights in the bundle). One fresh process
(``python -I``, cwd in a temporary directory) then opens each bundle, rebuilds the model
from it, exports it with ``torch.export`` (checked on every recorded call through
``ep.module()``) and to ONNX, and runs onnxruntime on every recorded call. Every call must
reproduce within atol 1e-4 (float32) in both runtimes. The replays share one process to
pay the imports of torch, transformers and onnxscript once.

The patches each family needs are asserted by name (``ExportReport.patches``); the fast
tests at the end check that every patch is restored on exit, even on error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver
from iobundle.replay.export._attention_patches import patch_sdpa_without_is_causal
from iobundle.replay.export._patches import (
    PATCHES,
    export_patches,
    patch_contiguous_last_token,
    patch_whisper_cross_attention_recompute,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

ATOL = 1e-4

# Runs in the fresh process: argv = jobs.json report.json. Only the bundles are read.
REPLAY_SCRIPT = textwrap.dedent(
    """
    import json, sys, time, traceback

    import torch
    import torch.utils._pytree as torch_pytree

    from iobundle import load_bundle
    from iobundle.calls._torch_pytree import torch_pytree_nodes
    from iobundle.replay._model_load import load_bundle_model

    jobs = json.load(open(sys.argv[1]))
    results = {}
    for name, job in jobs.items():
        result = results[name] = {}
        try:
            bundle = load_bundle(job["bundle"])
            model = load_bundle_model(bundle)
            result["class"] = type(model).__name__
            result["calls"] = bundle.num_obs()
            # One torch.export per bundle: the program checked here is the one written to ONNX below.
            programs = bundle.export_programs(
                model, programs="one", set_batch_dimension_for=job.get("batch"), check=False, atol=%(atol)r
            )
            ep, report = programs.programs[0].program, programs.report
            result.update(
                traced_call=report.traced_call,
                patches=list(report.patches),
                options=list(report.options),
                export_seconds=report.export_seconds,
                program=[dict(index=c.index, success=c.success, abs=c.abs, error=c.error) for c in report.calls],
                range_constraints=[str(r) for r in ep.range_constraints.values()],
            )
            if job.get("batch_one"):
                # The batch is dynamic: feed the program a batch of 1 cut from a recorded call of batch > 1.
                args, kwargs = bundle.infer_arguments(report.traced_call, as_args_kwargs=True)
                with torch_pytree_nodes():
                    cut = lambda: torch_pytree.tree_map_only(torch.Tensor, lambda t: t[:1].clone(), (args, kwargs))
                    a, k = cut()
                    got = ep.module()(*a, **k)
                    a, k = cut()
                    expected = model(*a, **k)
                result["batch_one_abs"] = float((got.logits - expected.logits).abs().max())
            onnx_path = job["bundle"] + ".onnx"
            programs.to_onnx(onnx_path)
            result["onnx_seconds"] = report.onnx_seconds
            rows = bundle.check_discrepancies(onnx_path, atol=%(atol)r, include_io=False)
            result["onnx"] = [dict(index=r["index"], success=r["SUCCESS"], abs=r["abs"], error=r.get("error")) for r in rows]
        except Exception:
            result["error"] = traceback.format_exc()
    json.dump(results, open(sys.argv[2], "w"), indent=1)
    """
) % {"atol": ATOL}


# --------------------------------------------------------------------------- captures


def _seeded(build: Any) -> Any:
    torch.manual_seed(0)
    return build().eval()


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        pad_token_id=0,
    )
    return _seeded(lambda: transformers.LlamaForCausalLM(config))


def capture_llama(root: Path) -> dict[str, Any]:
    """A left-padded batch of 2 (so generate() passes the attention mask); exported with a dynamic batch."""
    model = _tiny_llama()
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    prompt[0, :2], mask[0, :2] = 0, 0
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=10):
        model.generate(prompt, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    observer.save(root / "llama.iobundle", include_model=True)
    return {"bundle": str(root / "llama.iobundle"), "batch": True, "batch_one": True}


def capture_mistral(root: Path) -> dict[str, Any]:
    """Sliding window 6, generating 9 tokens past a 5-token prompt: the window fills up."""
    config = transformers.MistralConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        sliding_window=6,
    )
    model = _seeded(lambda: transformers.MistralForCausalLM(config))
    prompt = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=20):
        model.generate(prompt, max_new_tokens=9, min_new_tokens=9, do_sample=False)
    observer.save(root / "mistral.iobundle", include_model=True)
    return {"bundle": str(root / "mistral.iobundle")}


def capture_whisper(root: Path) -> dict[str, dict[str, Any]]:
    """Encoder and decoder observed by two observers during one generate()."""
    config = transformers.WhisperConfig(
        vocab_size=100,
        num_mel_bins=8,
        encoder_layers=1,
        decoder_layers=1,
        d_model=32,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=15,
        max_target_positions=32,
        decoder_start_token_id=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    model = _seeded(lambda: transformers.WhisperForConditionalGeneration(config))
    features = torch.randn(1, 8, 30, generator=torch.Generator().manual_seed(3))
    encoder, decoder = InputObserver(), InputObserver()
    with torch.no_grad(), encoder(model.model.encoder, store_n_calls=4), decoder(model.model.decoder, store_n_calls=10):
        model.generate(features, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    encoder.save(root / "whisper_encoder.iobundle", include_model=True)
    decoder.save(root / "whisper_decoder.iobundle", include_model=True)
    return {
        "whisper_encoder": {"bundle": str(root / "whisper_encoder.iobundle")},
        "whisper_decoder": {"bundle": str(root / "whisper_decoder.iobundle")},
    }


def capture_attention(root: Path) -> dict[str, Any]:
    """One attention layer of a Llama, observed while the whole model generates."""
    model = _tiny_llama()
    prompt = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    observer = InputObserver()
    with torch.no_grad(), observer(model.model.layers[0].self_attn, store_n_calls=10, method_name="forward"):
        model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    observer.save(root / "attention.iobundle", include_model=model)
    return {"bundle": str(root / "attention.iobundle")}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Capture every family here, replay every bundle in one fresh process; the per-family results."""
    root = tmp_path_factory.mktemp("llm_families")
    jobs = {
        "llama": capture_llama(root),
        "mistral": capture_mistral(root),
        **capture_whisper(root),
        "attention": capture_attention(root),
    }
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "replay.py").write_text(REPLAY_SCRIPT)
    work = root / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-I", str(root / "replay.py"), str(root / "jobs.json"), str(root / "report.json")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "report.json").read_text())


def check_family(result: dict[str, Any], *, min_calls: int, patches: set[str]) -> None:
    assert "error" not in result, result["error"]
    assert result["calls"] >= min_calls
    assert set(result["patches"]) == patches
    assert len(result["program"]) == result["calls"]
    for call in result["program"]:
        assert call["success"] is True and call["abs"] <= ATOL, f"ep.module(), call {call['index']}: {call}"
    assert len(result["onnx"]) == result["calls"]
    for row in result["onnx"]:
        assert row["success"] is True and row["abs"] <= ATOL, f"onnxruntime, call {row['index']}: {row}"


# --------------------------------------------------------------------------- families


@pytest.mark.slow
def test_llama_decoder_only(replayed: dict[str, Any]) -> None:
    result = replayed["llama"]
    check_family(result, min_calls=5, patches={"sdpa_without_is_causal", "layout_copies", "contiguous_last_token"})
    assert result["class"] == "LlamaForCausalLM"
    assert result["traced_call"] > 0  # a decode call: every input present
    assert any("backed_size_oblivious" in o for o in result["options"])
    assert result["batch_one_abs"] <= ATOL  # the batch is truly dynamic
    assert all("int_oo" in r for r in result["range_constraints"])


@pytest.mark.slow
def test_mistral_sliding_window(replayed: dict[str, Any]) -> None:
    # The cache is cut to window - 1 = 5 after the prefill: the cache length is dynamic only
    # because the prefill's empty cache counts as length 0 (DynamicCache's empty_dim).
    result = replayed["mistral"]
    check_family(result, min_calls=9, patches={"sdpa_without_is_causal", "layout_copies", "sliding_window_offsets"})
    assert result["class"] == "MistralForCausalLM"


@pytest.mark.slow
def test_whisper_encoder_decoder(replayed: dict[str, Any]) -> None:
    encoder, decoder = replayed["whisper_encoder"], replayed["whisper_decoder"]
    check_family(encoder, min_calls=1, patches=set())  # one call: nothing dynamic, nothing to patch
    assert encoder["class"] == "WhisperEncoder"
    # The first decoder call fills the cross-attention cache, later ones read it: one program
    # serves both because cross-attention recomputes its keys and values while tracing.
    check_family(
        decoder,
        min_calls=5,
        patches={"sdpa_without_is_causal", "layout_copies", "whisper_cross_attention_recompute"},
    )
    assert decoder["class"] == "WhisperDecoder"


@pytest.mark.slow
def test_attention_submodule(replayed: dict[str, Any]) -> None:
    result = replayed["attention"]
    check_family(result, min_calls=5, patches={"sdpa_without_is_causal", "layout_copies"})
    assert result["class"] == "LlamaAttention"


# --------------------------------------------------------------------------- patches: scoped and reversible


def _tiny_whisper_decoder() -> Any:
    config = transformers.WhisperConfig(
        vocab_size=50, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=16,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
        max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config).eval()


def test_patches_restore_everything_even_on_error() -> None:
    from transformers.modeling_utils import AttentionInterface

    llama, whisper = _tiny_llama(), _tiny_whisper_decoder()
    sdpa = AttentionInterface._global_mapping["sdpa"]
    head = llama.get_output_embeddings()
    cross = whisper.model.decoder.layers[0].encoder_attn
    applied: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), export_patches(llama, dynamic_batch=True, applied=applied):
        assert AttentionInterface._global_mapping["sdpa"] is not sdpa
        assert head._forward_pre_hooks
        raise RuntimeError("boom")
    assert applied == ["sdpa_without_is_causal", "layout_copies", "contiguous_last_token"]
    assert AttentionInterface._global_mapping["sdpa"] is sdpa
    assert not head._forward_pre_hooks
    with pytest.raises(RuntimeError, match="boom"), patch_whisper_cross_attention_recompute(whisper):
        assert cross._forward_pre_hooks
        raise RuntimeError("boom")
    assert not cross._forward_pre_hooks


def test_patches_apply_only_where_needed() -> None:
    names: list[str] = []
    with export_patches(torch.nn.Linear(2, 2), dynamic_batch=True, applied=names):
        pass
    assert names == []
    with export_patches(_tiny_llama(), dynamic=False, dynamic_batch=False, applied=names):
        pass
    assert names == []
    with export_patches(_tiny_llama(), dynamic_batch=False, applied=names):
        pass
    assert names == ["sdpa_without_is_causal", "layout_copies"]
    assert [p.name for p in PATCHES] == [
        "sdpa_without_is_causal",
        "layout_copies",
        "sliding_window_offsets",
        "moe_batched_experts",
        "whisper_cross_attention_recompute",
        "latent_keys_concat",
        "sizes_through_int",
        "contiguous_last_token",
        "complex_as_real",  # last: the innermost mode, it sees the model's ops before layout_copies
    ]


@pytest.mark.parametrize(
    ("q", "k", "masked"), [(1, 1, False), (1, 7, False), (4, 4, False), (3, 9, False), (4, 4, True)]
)
def test_export_sdpa_matches_transformers_sdpa(q: int, k: int, masked: bool) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    attention = _tiny_llama().model.layers[0].self_attn  # 4 query heads, 2 key/value heads
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, q, 8, generator=gen)
    key, value = torch.randn(2, 2, k, 8, generator=gen), torch.randn(2, 2, k, 8, generator=gen)
    mask = None
    if masked:  # left padding of 2 in the first row: its first two queries see no key at all
        mask = torch.ones(2, 1, q, k, dtype=torch.bool).tril(k - q)
        mask[0, :, :, :2] = False
    expected, _ = sdpa_attention_forward(attention, query, key, value, mask, scaling=0.3)
    if masked:
        assert not expected[0, :2].any()  # torch gives zeros there; the patch makes onnxruntime agree
    with patch_sdpa_without_is_causal(attention):
        got, _ = AttentionInterface._global_mapping["sdpa"](attention, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, expected)
    with patch_contiguous_last_token(torch.nn.Linear(2, 2)):  # no output embeddings: nothing to hook
        pass
