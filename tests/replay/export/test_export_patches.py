"""The export patches added for the model zoo: what each computes, that each is scoped and put back.

Fast tests on small pieces; the families they serve are exercised end to end by ``tests/zoo``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx.experimental._config as fx_config

from iobundle import InputObserver
from iobundle.replay.export._attention_patches import patch_sdpa_without_is_causal, patch_sliding_window_offsets
from iobundle.replay.export._patches import (
    export_patches,
    patch_latent_keys_concat,
    patch_layout_copies,
    patch_moe_batched_experts,
)

transformers = pytest.importorskip("transformers")

DYNAMIC = torch.export.Dim.DYNAMIC


class _FusedHeads(torch.nn.Module):
    """Falcon-style: heads cut from a fused projection, then ``transpose(1, 2).reshape``; eager-style matmuls."""

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        heads = x.view(b, q, 4, 8)
        cut = heads[:, :, :2, :].transpose(1, 2).reshape(b, 2, q, 8)
        scores = torch.matmul(heads.transpose(1, 2), k.transpose(2, 3))
        merged = (scores @ k).transpose(1, 2).contiguous()
        return cut.sum(dim=(1, 3)) + merged.sum(dim=(2, 3))


@pytest.mark.parametrize("traced_length", [1, 3])
def test_layout_copies_one_program_for_every_query_length(traced_length: int) -> None:
    model = _FusedHeads()
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(2, traced_length, 32, generator=gen), torch.randn(2, 4, 5, 8, generator=gen))
    shapes = ({0: DYNAMIC, 1: DYNAMIC}, {0: DYNAMIC, 2: DYNAMIC})
    with fx_config.patch(backed_size_oblivious=True):
        plain = torch.export.export(model, args, dynamic_shapes=shapes)
        with patch_layout_copies(model):
            patched = torch.export.export(model, args, dynamic_shapes=shapes)
    other = 3 if traced_length == 1 else 1
    x, k = torch.randn(2, other, 32, generator=gen), torch.randn(2, 4, 7, 8, generator=gen)
    with pytest.raises(AssertionError, match="Guard failed"):  # what the patch is for
        plain.module()(x, k)
    torch.testing.assert_close(patched.module()(x, k), model(x, k))


def test_layout_copies_is_scoped() -> None:
    x = torch.randn(2, 4, 6)[:, :, :3]  # not contiguous, yet reshape(8, 3) can be a view of it

    def shares_memory(y: torch.Tensor) -> bool:
        return y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()

    with patch_layout_copies(torch.nn.Linear(2, 2)):
        inside = x.reshape(8, 3)
    outside = x.reshape(8, 3)
    assert not shares_memory(inside) and shares_memory(outside)
    torch.testing.assert_close(inside, outside)
    assert not torch.overrides._get_current_function_mode_stack()


class _StreamProjection(torch.nn.Module):
    """ProphetNet-style: the main stream cut from the n-gram streams by ``chunk``, fed to a ``Linear``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main, predict = x.chunk(2, dim=1)
        return self.proj(main) + predict.sum(dim=-1, keepdim=True)


class _ContiguousBranch(torch.nn.Module):
    """ProphetNet's logits: the first stream sliced out, made contiguous only if it is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.view(x.shape[0], 2, -1, x.shape[-1])[:, 0]  # contiguous when the batch is 1
        if not logits.is_contiguous():
            logits = logits.contiguous()
        return logits * 2


@pytest.mark.parametrize("model", [_StreamProjection(), _ContiguousBranch()], ids=["linear", "is_contiguous"])
def test_layout_copies_on_slices_serve_a_batch_of_1(model: torch.nn.Module) -> None:
    x = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0))
    shapes = ({0: DYNAMIC},)
    with fx_config.patch(backed_size_oblivious=True):
        plain = torch.export.export(model, (x,), dynamic_shapes=shapes)
        with patch_layout_copies(model):
            patched = torch.export.export(model, (x,), dynamic_shapes=shapes)
    one = x[:1]
    with pytest.raises(AssertionError, match="Guard failed"):  # what the patch is for
        plain.module()(one)
    torch.testing.assert_close(patched.module()(one), model(one))
    torch.testing.assert_close(patched.module()(x), model(x))


def _sliding_layer(window: int, tokens: int, steps: list[int]) -> Any:
    """A real sliding-window layer fed ``tokens`` then each of ``steps`` tokens through ``update``."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(window)
    for n in [tokens, *steps]:
        layer.update(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))
    return layer


@pytest.mark.parametrize(("tokens", "steps"), [(3, []), (7, [1]), (7, [1, 1, 1, 1]), (12, [1, 1]), (4, [2, 3])])
@pytest.mark.parametrize("query_length", [1, 2])
def test_sliding_mask_sizes_match_transformers(tokens: int, steps: list[int], query_length: int) -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = _sliding_layer(8, tokens, steps)
    expected = layer.get_mask_sizes(query_length)
    with patch_sliding_window_offsets(torch.nn.Linear(2, 2)):
        got = DynamicSlidingWindowLayer.get_mask_sizes(layer, query_length)
    assert got == expected


def test_sliding_window_offsets_sets_token_counts_and_restores() -> None:
    import transformers.masking_utils as masking_utils
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers = [_sliding_layer(8, 7, [1, 1, 1]), DynamicLayer()]
    cache.layers[0].cumulative_length = 7  # what a rebuilt layer knows: its cached length
    seen: list[Any] = []

    class Probe(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> None:
            seen.append(cache.layers[0].cumulative_length)

    probe = Probe()
    original = (DynamicSlidingWindowLayer.get_mask_sizes, masking_utils._ignore_causal_mask_sdpa)
    with patch_sliding_window_offsets(probe):
        probe(input_ids=torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 11), cache=cache)
        assert masking_utils._ignore_causal_mask_sdpa is not original[1]
    assert seen == [10]  # 11 mask positions, 1 of them new
    assert (DynamicSlidingWindowLayer.get_mask_sizes, masking_utils._ignore_causal_mask_sdpa) == original
    assert not probe._forward_pre_hooks


def _tiny_mixtral() -> Any:
    config = transformers.MixtralConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
        vocab_size=50, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def test_moe_batched_experts_same_logits_and_restores() -> None:
    model = _tiny_mixtral()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    before = model.config._experts_implementation_internal
    assert before != "batched_mm"
    with torch.no_grad():
        expected = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"), patch_moe_batched_experts(model):
            assert model.config._experts_implementation_internal == "batched_mm"
            torch.testing.assert_close(model(ids).logits, expected)
            raise RuntimeError("boom")
    assert model.config._experts_implementation_internal == before


def test_new_patches_apply_only_where_needed() -> None:
    names: list[str] = []
    with export_patches(_tiny_mixtral(), dynamic=False, dynamic_batch=False, applied=names):
        pass
    assert names == ["moe_batched_experts"]  # ONNX needs it whatever the shapes
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=16, vocab_size=50, sliding_window=4,
        )
    )  # fmt: skip
    names.clear()
    with export_patches(mistral, dynamic_batch=False, applied=names):
        pass
    assert names == ["sdpa_without_is_causal", "layout_copies", "sliding_window_offsets"]
    names.clear()
    with export_patches(mistral, dynamic=False, dynamic_batch=False, applied=names):
        pass
    assert names == []


def test_torch_sdpa_wrapper_matches_torch_and_zeroes_unseeing_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 4, 3, 8, generator=gen) for _ in range(3))
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool).tril()
    mask[0, :, 0, :] = False  # a padding query of a left-padded row: it sees no key
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = sdpa(query, key, value, attn_mask=mask)
    causal = sdpa(query, key, value, is_causal=True)
    with patch_sdpa_without_is_causal(torch.nn.Linear(2, 2)):
        wrapped = torch.nn.functional.scaled_dot_product_attention
        assert wrapped is not sdpa
        got = wrapped(query, key, value, attn_mask=mask)
        got_causal = wrapped(query, key, value, is_causal=True)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert not got[0, :, 0].any()
    torch.testing.assert_close(got[:, :, 1:], expected[:, :, 1:])
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got_causal, causal)


def _tiny_deepseek_v3() -> Any:
    config = transformers.DeepseekV3Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=16,
        vocab_size=50, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=8, first_k_dense_replace=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def test_latent_keys_concat_same_logits_and_restores() -> None:
    model = _tiny_deepseek_v3()
    attention = model.model.layers[0].self_attn
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"), patch_latent_keys_concat(model):
            assert "expand_kv" in vars(attention)
            torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)
            raise RuntimeError("boom")
    assert "expand_kv" not in vars(attention)


def test_latent_attention_exported_at_batch_2_serves_batch_1() -> None:
    # Without the patch, tracing batch 2 adds the minimum batch >= 2 (the copy into a slice of the
    # keys) and the check beyond the recorded calls fails: Guard failed: position_ids.size()[0] >= 2.
    model = _tiny_deepseek_v3()
    observer = InputObserver()
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), observer(model):
        model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    observer.export(model, set_batch_dimension_for=True)
    report = observer.export_report()
    assert report is not None and report.ok
    assert "latent_keys_concat" in report.patches
    check = report.batch_check
    assert (check.batch, check.success) == (1, True), check.summary()


def _tiny_llama4() -> Any:
    config = transformers.Llama4TextConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=16, intermediate_size_mlp=16, vocab_size=50, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).eval()


def test_chunked_attention_gets_the_sliding_offsets() -> None:
    names: list[str] = []
    with export_patches(_tiny_llama4(), dynamic_batch=False, applied=names):
        pass
    assert "sliding_window_offsets" in names
    assert "complex_as_real" not in names  # listed only once it has translated something


def test_llama4_complex_rotary_on_real_pairs_same_logits_and_listed() -> None:
    model = _tiny_llama4()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    names: list[str] = []
    with torch.no_grad():
        expected = model(ids).logits
        with export_patches(model, dynamic_batch=False, applied=names):
            freqs = model.model.rotary_emb(torch.zeros(1), torch.arange(6)[None])
            assert freqs.is_complex() and freqs.shape == (1, 6, 4)  # what the model's code sees
            got = model(ids).logits
    assert not freqs.is_complex() and freqs.shape == (1, 6, 4, 2)  # what it is: (real, imaginary) pairs
    assert "complex_as_real" in names
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
