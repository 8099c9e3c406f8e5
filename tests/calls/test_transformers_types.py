"""Tests of the transformers node types: caches and ModelOutputs flatten, rebuild, and export."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from transformers import (
    Cache,
    DynamicCache,
    EncoderDecoderCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    Fp8QuantizedLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionLayer,
    StaticLayer,
)
from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput
from transformers.utils import ModelOutput

from iobundle.calls import node_layout, restore_token_counts
from iobundle.calls._layouts import BUILTIN_LAYOUTS
from iobundle.calls._registry import find_node_type, lookup_node_type
from iobundle.calls._torch_pytree import torch_pytree_nodes
from iobundle.calls._transformers import register_all
from iobundle.errors import UnsupportedInputError

pytestmark = pytest.mark.slow

WINDOW = 6
PROMPT_LEN = 5


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register_all()


# --------------------------------------------------------------------------- helpers


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """Flatten ``obj`` one level with its registered node type."""
    node_type = find_node_type(obj)
    assert node_type is not None, f"{type(obj).__name__} is not registered"
    return node_type.flatten(obj)


def deep_round_trip(obj: Any) -> Any:
    """Flatten registered objects recursively and rebuild them, the context going through JSON."""
    node_type = find_node_type(obj)
    if node_type is None:
        return obj
    children, context = node_type.flatten(obj)
    context = json.loads(json.dumps(context))
    assert lookup_node_type(node_type.name) is node_type
    return node_type.unflatten([deep_round_trip(child) for child in children], context)


def deep_structure(obj: Any) -> Any:
    """Return ``obj``'s registered tree with tensors replaced by None: names, contexts, child slots."""
    node_type = find_node_type(obj)
    if node_type is None:
        return None if obj is None or isinstance(obj, torch.Tensor) else obj
    children, context = node_type.flatten(obj)
    return (node_type.name, node_type.version, json.dumps(context), [deep_structure(c) for c in children])


def record_generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> list[dict[str, Any]]:
    """Run ``generate`` and return a deep copy of the keyword arguments of every forward call."""
    calls: list[dict[str, Any]] = []
    forward = model.forward

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        assert not args
        calls.append(copy.deepcopy(kwargs))
        return forward(**kwargs)

    model.forward = recording_forward
    try:
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    finally:
        del model.forward
    return calls


def logits_with(model: torch.nn.Module, call: dict[str, Any], cache: Any, **overrides: Any) -> torch.Tensor:
    """Run ``model`` on a recorded call with ``cache`` in place of the recorded one."""
    kwargs = {**call, "cache": cache, **overrides}
    with torch.no_grad():
        return model(**kwargs).logits


# --------------------------------------------------------------------------- models


def _causal_lm_kwargs() -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_causal_lm_kwargs())).eval()


@pytest.fixture(scope="module")
def mistral() -> MistralForCausalLM:
    torch.manual_seed(1)
    return MistralForCausalLM(MistralConfig(**_causal_lm_kwargs(), sliding_window=WINDOW)).eval()


@pytest.fixture(scope="module")
def whisper() -> WhisperForConditionalGeneration:
    torch.manual_seed(2)
    config = WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=100,
        num_mel_bins=80,
        max_source_positions=30,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
    )
    return WhisperForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 100, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama_calls(llama: LlamaForCausalLM, prompt: torch.Tensor) -> list[dict[str, Any]]:
    return record_generate(llama, prompt, max_new_tokens=4)


@pytest.fixture(scope="module")
def mistral_calls(mistral: MistralForCausalLM, prompt: torch.Tensor) -> list[dict[str, Any]]:
    calls = record_generate(mistral, prompt, max_new_tokens=WINDOW + 2)
    assert len(calls) == WINDOW + 2
    return calls


@pytest.fixture(scope="module")
def whisper_calls(whisper: WhisperForConditionalGeneration) -> list[dict[str, Any]]:
    """Three decoder calls as generate() makes them: the cache starts empty, then grows."""
    features = torch.randn(1, whisper.config.num_mel_bins, 60, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        encoder_outputs = whisper.model.encoder(features)
    cache = EncoderDecoderCache(DynamicCache(config=whisper.config), DynamicCache(config=whisper.config))
    decoder_input_ids = torch.tensor([[3]])
    calls = []
    for _ in range(3):
        call = {"encoder_outputs": encoder_outputs, "decoder_input_ids": decoder_input_ids, "use_cache": True}
        calls.append(copy.deepcopy({**call, "cache": cache}))
        with torch.no_grad():
            out = whisper(**call, cache=cache)
        cache = out.cache
        decoder_input_ids = out.logits[:, -1:].argmax(-1)
    return calls


# --------------------------------------------------------------------------- DynamicCache


class TestDynamicCache:
    def test_layout_is_key_value_per_layer(self, llama_calls: list[dict[str, Any]]) -> None:
        cache = llama_calls[1]["cache"]
        children, context = flatten(cache)
        assert find_node_type(cache).name == "transformers.DynamicCache"
        assert find_node_type(cache).version == 1
        assert context == ["full", "full"]
        assert len(children) == 4
        for i, layer in enumerate(cache.layers):
            assert children[2 * i] is layer.keys
            assert children[2 * i + 1] is layer.values
            assert children[2 * i].shape == (1, 2, PROMPT_LEN, 8)

    def test_decode_caches_rebuild_to_the_same_logits(
        self, llama: LlamaForCausalLM, llama_calls: list[dict[str, Any]]
    ) -> None:
        for call in llama_calls[1:]:
            cache = call["cache"]
            rebuilt = deep_round_trip(cache)
            assert type(rebuilt) is DynamicCache
            assert [type(layer) for layer in rebuilt.layers] == [DynamicLayer, DynamicLayer]
            assert rebuilt.get_seq_length() == cache.get_seq_length()
            expected = logits_with(llama, call, copy.deepcopy(cache))
            torch.testing.assert_close(logits_with(llama, call, rebuilt), expected, atol=1e-6, rtol=0)

    def test_context_is_json_and_same_for_every_decode_call(self, llama_calls: list[dict[str, Any]]) -> None:
        contexts = [json.dumps(flatten(call["cache"])[1]) for call in llama_calls]
        assert len(set(contexts)) == 1  # the prefill call too

    def test_prefill_cache_flattens_to_as_many_children_as_a_decode_cache(
        self, llama_calls: list[dict[str, Any]]
    ) -> None:
        prefill, decode = (flatten(call["cache"])[0] for call in llama_calls[:2])
        assert not any(layer.is_initialized for layer in llama_calls[0]["cache"].layers)
        assert prefill == [None, None, None, None]
        assert len(prefill) == len(decode)

    def test_none_children_rebuild_an_uninitialised_cache(
        self, llama: LlamaForCausalLM, llama_calls: list[dict[str, Any]]
    ) -> None:
        call = llama_calls[0]
        rebuilt = deep_round_trip(call["cache"])
        assert [layer.is_initialized for layer in rebuilt.layers] == [False, False]
        expected = logits_with(llama, call, copy.deepcopy(call["cache"]))
        torch.testing.assert_close(logits_with(llama, call, rebuilt), expected, atol=1e-6, rtol=0)

    def test_zero_length_children_stand_for_an_empty_cache(
        self, llama: LlamaForCausalLM, llama_calls: list[dict[str, Any]]
    ) -> None:
        call = llama_calls[0]
        node_type = find_node_type(call["cache"])
        _, context = node_type.flatten(call["cache"])
        empty = [torch.zeros(1, 2, 0, 8) for _ in range(4)]
        rebuilt = node_type.unflatten(empty, context)
        assert rebuilt.get_seq_length() == 0
        assert [layer.is_initialized for layer in rebuilt.layers] == [True, True]
        expected = logits_with(llama, call, copy.deepcopy(call["cache"]))
        torch.testing.assert_close(logits_with(llama, call, rebuilt), expected, atol=1e-6, rtol=0)

    def test_early_initialised_placeholders_flatten_to_none(self, llama: LlamaForCausalLM) -> None:
        cache = DynamicCache(config=llama.config)
        cache.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
        assert [layer.keys.shape for layer in cache.layers] == [(0,), (0,)]
        assert flatten(cache)[0] == [None, None, None, None]

    def test_lazy_cache_without_layers_round_trips(self) -> None:
        children, context = flatten(DynamicCache())
        assert (children, context) == ([], [])
        rebuilt = deep_round_trip(DynamicCache())
        assert rebuilt.layers == []
        assert rebuilt.layer_class_to_replicate is DynamicLayer

    def test_unflatten_refuses_a_key_without_value(self) -> None:
        node_type = lookup_node_type("transformers.DynamicCache")
        with pytest.raises(ValueError, match=r"Layer 0 .* no value tensor"):
            node_type.unflatten([torch.zeros(1, 2, 0, 8), None], ["full"])

    def test_layer_with_state_besides_tensors_is_refused(self) -> None:
        cache = DynamicCache()
        cache.layers = [DynamicLayer(), Fp8QuantizedLayer()]
        with pytest.raises(UnsupportedInputError, match=r"Layer 1 .* Fp8QuantizedLayer"):
            flatten(cache)


class TestSlidingWindowCache:
    def test_context_names_the_window_and_stays_the_same(self, mistral_calls: list[dict[str, Any]]) -> None:
        contexts = {json.dumps(flatten(call["cache"])[1]) for call in mistral_calls}
        assert contexts == {json.dumps([{"sliding": WINDOW}, {"sliding": WINDOW}])}

    def test_decode_caches_are_cut_to_the_window(self, mistral_calls: list[dict[str, Any]]) -> None:
        shapes = {tuple(t.shape) for call in mistral_calls[1:] for t in flatten(call["cache"])[0]}
        assert shapes == {(1, 2, WINDOW - 1, 8)}

    def test_full_window_rebuilds_to_the_same_logits_given_positions(
        self, mistral: MistralForCausalLM, mistral_calls: list[dict[str, Any]]
    ) -> None:
        full = [call for call in mistral_calls[1:] if call["cache"].get_seq_length() >= WINDOW]
        assert len(full) >= 2
        for call in full:
            cache = call["cache"]
            seen = cache.get_seq_length()
            positions = torch.tensor([[seen]])
            rebuilt = deep_round_trip(cache)
            assert [type(layer) for layer in rebuilt.layers] == [DynamicSlidingWindowLayer] * 2
            # The token count is rebuilt as the cached length (documented).
            assert rebuilt.get_seq_length() == WINDOW - 1 < seen
            expected = logits_with(mistral, call, copy.deepcopy(cache), position_ids=positions)
            actual = logits_with(mistral, call, rebuilt, position_ids=positions)
            torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)

    def test_window_not_yet_full_rebuilds_exactly(self, mistral: MistralForCausalLM, prompt: torch.Tensor) -> None:
        cache = DynamicCache(config=mistral.config)
        with torch.no_grad():
            mistral(input_ids=prompt[:, :3], cache=cache, use_cache=True)
        call = {"input_ids": prompt[:, 3:4], "use_cache": True}
        rebuilt = deep_round_trip(cache)
        assert rebuilt.get_seq_length() == cache.get_seq_length() == 3
        expected = logits_with(mistral, call, copy.deepcopy(cache))
        torch.testing.assert_close(logits_with(mistral, call, rebuilt), expected, atol=1e-6, rtol=0)

    def test_token_count_is_restored_from_the_attention_mask(
        self, mistral: MistralForCausalLM, mistral_calls: list[dict[str, Any]]
    ) -> None:
        full = [call for call in mistral_calls[1:] if call["cache"].get_seq_length() >= WINDOW]
        assert len(full) >= 2
        for call in full:
            seen = call["cache"].get_seq_length()
            rebuilt = deep_round_trip(call["cache"])
            mask = torch.ones(1, seen + 1, dtype=torch.long)
            assert restore_token_counts({"input_ids": call["input_ids"], "attention_mask": mask, "cache": rebuilt}) == 2
            assert rebuilt.get_seq_length() == seen
            # No positions passed: the model derives them from the cache, which now counts every token.
            kwargs = {k: v for k, v in call.items() if k != "position_ids"}
            expected = logits_with(mistral, kwargs, copy.deepcopy(call["cache"]))
            torch.testing.assert_close(logits_with(mistral, kwargs, rebuilt), expected, atol=1e-6, rtol=0)

    def test_token_count_is_left_alone_where_the_mask_disagrees(self, mistral_calls: list[dict[str, Any]]) -> None:
        call = next(c for c in mistral_calls[1:] if c["cache"].get_seq_length() >= WINDOW)
        rebuilt = deep_round_trip(call["cache"])
        tokens = call["input_ids"]
        short = torch.ones(1, WINDOW - 2, dtype=torch.long)  # fewer tokens seen than the layer caches
        assert restore_token_counts({"input_ids": tokens, "attention_mask": short, "cache": rebuilt}) == 0
        assert restore_token_counts({"input_ids": tokens, "cache": rebuilt}) == 0  # no mask: nothing to go by
        four_d = torch.ones(1, 1, 1, 20)
        assert restore_token_counts({"input_ids": tokens, "attention_mask": four_d, "cache": rebuilt}) == 0
        assert rebuilt.get_seq_length() == WINDOW - 1
        rebuilt.layers[0].record_past = True  # may hold more than window - 1 keys: its count is not implied
        mask = torch.ones(1, 20, dtype=torch.long)
        assert restore_token_counts({"input_ids": tokens, "attention_mask": mask, "cache": rebuilt}) == 1

    def test_rebuilt_layer_has_the_attributes_of_a_real_one(self, mistral_calls: list[dict[str, Any]]) -> None:
        original = mistral_calls[2]["cache"].layers[0]
        rebuilt = deep_round_trip(mistral_calls[2]["cache"]).layers[0]
        assert set(vars(rebuilt)) == set(vars(original))
        assert rebuilt.sliding_window == original.sliding_window
        assert rebuilt._sliding_window_tensor.item() == WINDOW
        assert rebuilt.record_past is False
        fresh = deep_round_trip(mistral_calls[0]["cache"]).layers[0]
        assert set(vars(fresh)) == set(vars(DynamicSlidingWindowLayer(sliding_window=WINDOW)))

    def test_record_past_goes_into_the_context(self) -> None:
        layer = DynamicSlidingWindowLayer(sliding_window=WINDOW)
        layer.activate_past_recording()
        cache = DynamicCache()
        cache.layers = [layer]
        assert flatten(cache)[1] == [{"sliding": WINDOW, "record_past": True}]
        assert deep_round_trip(cache).layers[0].record_past is True


# --------------------------------------------------------------------------- StaticCache


class TestStaticCache:
    def test_decode_cache_rebuilds_to_the_same_logits(self, llama: LlamaForCausalLM, prompt: torch.Tensor) -> None:
        cache = StaticCache(config=llama.config, max_cache_len=16)
        empty_children, context = flatten(cache)
        assert context == [{"static": 16}, {"static": 16}]
        assert empty_children[0::3] == [None, None]
        with torch.no_grad():
            llama(input_ids=prompt, cache=cache, use_cache=True)
        children, _ = flatten(cache)
        assert len(children) == len(empty_children) == 6
        assert children[0].shape == (1, 2, 16, 8)
        assert int(children[2]) == PROMPT_LEN
        call = {"input_ids": prompt[:, :1], "use_cache": True}
        rebuilt = deep_round_trip(copy.deepcopy(cache))
        assert type(rebuilt) is StaticCache
        assert [type(layer) for layer in rebuilt.layers] == [StaticLayer, StaticLayer]
        expected = logits_with(llama, call, copy.deepcopy(cache))
        torch.testing.assert_close(logits_with(llama, call, rebuilt), expected, atol=1e-6, rtol=0)

    def test_sliding_static_layers_are_refused(self, mistral: MistralForCausalLM) -> None:
        cache = StaticCache(config=mistral.config, max_cache_len=16)
        with pytest.raises(UnsupportedInputError, match="StaticSlidingWindowLayer"):
            flatten(cache)


# --------------------------------------------------------------------------- layers beyond keys and values


def _generate_calls(model: torch.nn.Module, new_tokens: int = 3, *, mask: bool = True) -> list[dict[str, Any]]:
    """The keyword arguments of every forward call of a greedy ``generate()`` on a batch of 2."""
    calls: list[dict[str, Any]] = []
    forward = model.forward

    def recording_forward(**kwargs: Any) -> Any:
        calls.append(copy.deepcopy(kwargs))
        return forward(**kwargs)

    ids = torch.randint(3, 100, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
    extra = {"attention_mask": torch.ones_like(ids)} if mask else {}
    model.forward = recording_forward
    try:
        with torch.no_grad():
            model.generate(ids, **extra, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    finally:
        del model.forward
    return calls


def _tiny(config_name: str, model_name: str, **config: Any) -> torch.nn.Module:
    import transformers

    settings = {**_causal_lm_kwargs(), **config}
    settings = {k: v for k, v in settings.items() if v is not None}
    torch.manual_seed(6)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**settings)).eval()


_NO_ATTENTION = {"num_attention_heads": None, "num_key_value_heads": None, "intermediate_size": None}


@pytest.fixture(scope="module")
def mamba_calls() -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    model = _tiny("MambaConfig", "MambaForCausalLM", **_NO_ATTENTION, state_size=8, expand=2, conv_kernel=4)
    return model, _generate_calls(model)


@pytest.fixture(scope="module")
def lfm2_calls() -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    model = _tiny("Lfm2Config", "Lfm2ForCausalLM", layer_types=["conv", "full_attention"], conv_L_cache=3)
    return model, _generate_calls(model)


@pytest.fixture(scope="module")
def falcon_h1_calls() -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    model = _tiny(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        head_dim=8,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        mamba_d_ssm=64,
    )
    return model, _generate_calls(model, mask=False)  # FalconH1's generate() refuses an attention_mask


def _linear_layer(conv: torch.Tensor | None, recurrent: torch.Tensor | None, layer: Any = None) -> Any:
    """A linear-attention layer after a real prefill: states written through its own update methods."""
    layer = layer if layer is not None else LinearAttentionLayer()
    if conv is not None:
        layer.update_conv_state(conv)
    if recurrent is not None:
        layer.update_recurrent_state(recurrent)
    return layer


def _same_tensors(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


class TestLinearAttentionLayers:
    """State-space and linear-attention layers: convolution and recurrent states as children, settings as context."""

    def test_state_space_layout_is_conv_and_recurrent_per_layer(self, mamba_calls: Any) -> None:
        _, calls = mamba_calls
        prefill, context = flatten(calls[0]["cache"])
        children, decode_context = flatten(calls[1]["cache"])
        assert context == decode_context == [{"linear": 1}, {"linear": 1}]
        assert prefill == [None] * 4
        assert [tuple(c.shape) for c in children] == [(2, 64, 4), (2, 64, 8)] * 2
        assert children[0] is calls[1]["cache"].layers[0].conv_states[0]

    def test_hybrid_layout_holds_both_kinds(self, lfm2_calls: Any, falcon_h1_calls: Any) -> None:
        children, context = flatten(lfm2_calls[1][1]["cache"])
        assert context == [{"linear": 1}, "full"]
        # LFM2's short convolution keeps no recurrent state: that child stays None
        assert [None if c is None else c.dim() for c in children] == [3, None, 4, 4]
        cache = falcon_h1_calls[1][1]["cache"]
        assert [type(layer) for layer in cache.layers] == [LinearAttentionAndFullAttentionLayer] * 2
        children, context = flatten(cache)
        assert context == [{"linear": 1, "attention": "full"}] * 2
        assert [c.dim() for c in children] == [4, 4, 3, 4] * 2

    def test_cache_parts_name_each_child_of_a_hybrid_layout(self, lfm2_calls: Any, falcon_h1_calls: Any) -> None:
        """What shape inference's dim names read: the attention part's keys and values, then the states."""
        from iobundle.calls import dynamic_cache_parts

        for calls, dims in ((lfm2_calls[1], [3, None, 4, 4]), (falcon_h1_calls[1], [4, 4, 3, 4] * 2)):
            children, context = flatten(calls[1]["cache"])
            parts = [part for _, part in dynamic_cache_parts(context)]
            assert len(parts) == len(children) == len(dims)
            assert all(c.dim() == 4 for c, p in zip(children, parts) if p in ("key", "value"))
        assert [p for _, p in dynamic_cache_parts(flatten(lfm2_calls[1][1]["cache"])[1])] == [
            "state", "state", "key", "value",
        ]  # fmt: skip
        assert [p for _, p in dynamic_cache_parts(flatten(falcon_h1_calls[1][1]["cache"])[1])] == [
            "key", "value", "state", "state",
        ] * 2  # fmt: skip
        assert dynamic_cache_parts("not a list") == [] and dynamic_cache_parts([{"bogus": 1}]) == []

    @pytest.mark.parametrize("fixture", ["mamba_calls", "lfm2_calls", "falcon_h1_calls"])
    def test_decode_caches_rebuild_to_the_same_logits(self, fixture: str, request: pytest.FixtureRequest) -> None:
        model, calls = request.getfixturevalue(fixture)
        for call in calls[1:]:
            rebuilt = deep_round_trip(copy.deepcopy(call["cache"]))
            assert [type(layer) for layer in rebuilt.layers] == [type(layer) for layer in call["cache"].layers]
            assert deep_structure(rebuilt) == deep_structure(call["cache"])
            expected = logits_with(model, call, copy.deepcopy(call["cache"]))
            torch.testing.assert_close(logits_with(model, call, rebuilt), expected, atol=0, rtol=0)

    def test_prefill_cache_rebuilds_to_one_without_previous_state(self, mamba_calls: Any) -> None:
        model, calls = mamba_calls
        rebuilt = deep_round_trip(copy.deepcopy(calls[0]["cache"]))
        assert not rebuilt.has_previous_state(0) and not rebuilt.has_previous_state(1)
        expected = logits_with(model, calls[0], copy.deepcopy(calls[0]["cache"]))
        torch.testing.assert_close(logits_with(model, calls[0], rebuilt), expected, atol=0, rtol=0)

    def test_rebuilt_layer_has_the_attributes_of_a_real_one(self, mamba_calls: Any) -> None:
        real = mamba_calls[1][1]["cache"].layers[0]
        rebuilt = deep_round_trip(copy.deepcopy(mamba_calls[1][1]["cache"])).layers[0]
        for name in ("number_of_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                     "has_previous_state", "conv_kernel_size", "device", "dtype", "record_past"):  # fmt: skip
            assert getattr(rebuilt, name) == getattr(real, name), name

    def test_several_states_in_one_layer(self) -> None:
        layer = LinearAttentionLayer(number_of_states=2)
        layer.update_conv_state(torch.randn(2, 8, 4), state_idx=0)
        layer.update_conv_state(torch.randn(2, 6, 3), state_idx=1)
        layer.update_recurrent_state(torch.randn(2, 4, 5), state_idx=1)
        cache = DynamicCache()
        cache.layers = [layer]
        children, context = flatten(cache)
        assert context == [{"linear": 2}]
        assert [None if c is None else tuple(c.shape) for c in children] == [(2, 8, 4), None, (2, 6, 3), (2, 4, 5)]
        rebuilt = deep_round_trip(cache).layers[0]
        assert rebuilt.conv_kernel_size == {0: 4, 1: 3}
        assert rebuilt.is_recurrent_states_initialized == {0: False, 1: True}
        assert _same_tensors(flatten(deep_round_trip(cache))[0], children)

    def test_hybrid_sliding_layer_round_trips(self) -> None:
        layer = LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=WINDOW)
        layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        _linear_layer(torch.randn(1, 8, 4), torch.randn(1, 8, 5), layer)
        cache = DynamicCache()
        cache.layers = [layer]
        children, context = flatten(cache)
        assert context == [{"linear": 1, "attention": {"sliding": WINDOW}}]
        rebuilt = deep_round_trip(cache).layers[0]
        assert type(rebuilt) is LinearAttentionAndSlidingWindowAttentionLayer
        assert rebuilt.sliding_window == WINDOW and rebuilt.cumulative_length == 3
        assert rebuilt.get_mask_sizes(1) == layer.get_mask_sizes(1)
        assert _same_tensors(flatten(deep_round_trip(cache))[0], children)

    def test_hybrid_static_layer_round_trips_in_a_static_cache(self) -> None:
        layer = LinearAttentionAndStaticFullAttentionLayer(max_cache_len=16)
        layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        _linear_layer(torch.randn(1, 8, 4), None, layer)
        cache = StaticCache.__new__(StaticCache)
        Cache.__init__(cache, layers=[layer, _linear_layer(torch.randn(1, 8, 4), torch.randn(1, 8, 5))])
        children, context = flatten(cache)
        assert context == [{"linear": 1, "attention": {"static": 16}}, {"linear": 1}]
        assert int(children[2]) == 3  # the static part's token count, a tensor child
        rebuilt = deep_round_trip(cache)
        assert [type(x) for x in rebuilt.layers] == [LinearAttentionAndStaticFullAttentionLayer, LinearAttentionLayer]
        assert rebuilt.layers[0].max_cache_len == 16 and rebuilt.get_seq_length(0) == 3
        assert _same_tensors(flatten(rebuilt)[0], children)

    def test_indexed_layer_round_trips(self) -> None:
        layer = DynamicIndexedLayer()
        layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        layer.update_indexer(torch.randn(1, 3, 4))
        cache = DynamicCache()
        cache.layers = [layer, DynamicIndexedLayer()]
        children, context = flatten(cache)
        assert context == ["indexed", "indexed"]
        assert [None if c is None else c.dim() for c in children] == [4, 4, 3, None, None, None, None, None]
        rebuilt = deep_round_trip(cache)
        assert rebuilt.layers[0].is_indexer_initialized and not rebuilt.layers[1].is_indexer_initialized
        assert _same_tensors(flatten(rebuilt)[0], children)

    def test_empty_dims_follow_each_child(self) -> None:
        node_type = lookup_node_type("transformers.DynamicCache")
        assert node_type is not None and node_type.child_empty_dims is not None
        context = ["full", {"linear": 1}, {"linear": 1, "attention": "full"}, "indexed"]
        assert node_type.child_empty_dims(context) == [-2, -2, None, None, -2, -2, None, None, -2, -2, -2, -1]

    def test_a_layer_recording_past_states_is_refused(self) -> None:
        layer = _linear_layer(torch.randn(1, 8, 4), None)
        layer.activate_past_recording()
        cache = DynamicCache()
        cache.layers = [layer]
        with pytest.raises(UnsupportedInputError, match=r"Layer 0 .* LinearAttentionLayer.*records past"):
            flatten(cache)

    @pytest.mark.parametrize(
        ("context", "children", "match"),
        [
            ([{"linear": 0}], [], "number of states 0"),
            ([{"linear": "os.system"}], [None, None], "number of states 'os.system'"),
            ([{"linear": 10**6}], [], r"up to \d+"),
            ([{"linear": 1, "attention": {"static": 8}}], [None] * 5, "unknown attention kind"),
            ([{"linear": 1, "attention": "builtins.eval"}], [None] * 4, "unknown attention kind"),
            ([{"sliding": -3}], [None, None], "sliding window -3"),
            ([{"linear": 1}], [None] * 3, "flattens to 2 children, got 3"),
            ({"linear": 1}, [None, None], "expected a list of layer kinds"),
        ],
    )
    def test_a_bundle_context_is_checked_before_use(self, context: Any, children: list[Any], match: str) -> None:
        node_type = lookup_node_type("transformers.DynamicCache")
        assert node_type is not None
        with pytest.raises(ValueError, match=match):
            node_type.unflatten(children, context)

    def test_bundle_round_trip_rebuilds_the_same_logits(self, mamba_calls: Any, tmp_path: Any) -> None:
        from iobundle import InputObserver, load_bundle

        model, _ = mamba_calls
        observer = InputObserver()
        ids = torch.randint(3, 100, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
        with torch.no_grad(), observer(model, store_n_calls=8):
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False
            )
        observer.save(tmp_path / "mamba.iobundle")
        bundle = load_bundle(tmp_path / "mamba.iobundle")
        assert [c.status for c in bundle.calls] == ["ok"] * 3
        assert bundle.calls[1].kwargs["cache"].context == [{"linear": 1}, {"linear": 1}]
        for index in (1, 2):
            arguments = bundle.infer_arguments(index)
            arguments = {**{k: v for k, v in arguments.items() if k != "kwargs"}, **arguments.get("kwargs", {})}
            assert [type(x) for x in arguments["cache"].layers] == [LinearAttentionLayer] * 2
            with torch.no_grad():
                logits = model(**arguments).logits
            torch.testing.assert_close(logits, observer.info.flat_outputs[index][0], atol=0, rtol=0)

    def test_export_takes_a_state_space_cache(self, mamba_calls: Any) -> None:
        model, calls = mamba_calls
        call = {k: v for k, v in calls[1].items() if k in ("input_ids", "cache", "use_cache")}
        with torch_pytree_nodes():
            ep = torch.export.export(model, (), copy.deepcopy(call), strict=False)
            names = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
            assert names[1:5] == ["cache_conv_0", "cache_recurrent_0", "cache_conv_1", "cache_recurrent_1"]
            other = {k: v for k, v in calls[2].items() if k in call}
            expected = model(**copy.deepcopy(other)).logits
            torch.testing.assert_close(ep.module()(**copy.deepcopy(other)).logits, expected, atol=1e-5, rtol=0)


class TestUnsupportedCacheAtCapture:
    @pytest.mark.parametrize(
        ("fixture", "generate", "named"),
        [
            ("mistral", {"cache_implementation": "static"}, "StaticSlidingWindowLayer"),
            ("llama", {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}, "QuantizedCache"),
        ],
        ids=["sliding-static", "quantized-fp8"],
    )
    def test_one_warning_names_the_class_and_the_call(
        self, fixture: str, generate: dict[str, Any], named: str, prompt: torch.Tensor, request: pytest.FixtureRequest
    ) -> None:
        import warnings

        from iobundle import InputObserver

        model = request.getfixturevalue(fixture)
        observer = InputObserver()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), observer(model, store_n_calls=8):
                model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, **generate)
        about = [str(w.message) for w in caught if named in str(w.message)]
        assert len(about) == 1, about
        assert "call 0" in about[0] and "Record" in about[0] and "only warning" in about[0]
        assert [c.status for c in observer.info.calls] == ["incomplete"] * 3
        assert all(named in c.error for c in observer.info.calls)


# --------------------------------------------------------------------------- EncoderDecoderCache


class TestEncoderDecoderCache:
    def test_children_are_the_two_caches(self, whisper_calls: list[dict[str, Any]]) -> None:
        cache = whisper_calls[1]["cache"]
        children, context = flatten(cache)
        assert find_node_type(cache).name == "transformers.EncoderDecoderCache"
        assert children == [cache.self_attention_cache, cache.cross_attention_cache]
        assert context is None
        cross = flatten(cache.cross_attention_cache)[0]
        assert cross[0].shape == (1, 4, 30, 8)

    def test_first_call_has_the_structure_of_the_later_ones(self, whisper_calls: list[dict[str, Any]]) -> None:
        first, *later = (deep_structure(call["cache"]) for call in whisper_calls)
        assert all(structure == first for structure in later)
        children = flatten(whisper_calls[0]["cache"])[0]
        assert all(flatten(sub)[0] == [None, None] for sub in children)

    def test_caches_rebuild_to_the_same_logits(
        self, whisper: WhisperForConditionalGeneration, whisper_calls: list[dict[str, Any]]
    ) -> None:
        for call in whisper_calls:
            cache = call["cache"]
            rebuilt = deep_round_trip(cache)
            assert type(rebuilt) is EncoderDecoderCache
            assert rebuilt.is_updated == cache.is_updated
            expected = logits_with(whisper, call, copy.deepcopy(cache))
            torch.testing.assert_close(logits_with(whisper, call, rebuilt), expected, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- ModelOutput


class TestModelOutput:
    def test_causal_lm_output_round_trips(self, llama: LlamaForCausalLM, prompt: torch.Tensor) -> None:
        with torch.no_grad():
            output = llama(input_ids=prompt, use_cache=True)
        assert type(output) is CausalLMOutputWithPast
        node_type = find_node_type(output)
        assert (node_type.name, node_type.version) == ("transformers.CausalLMOutputWithPast", 1)
        children, context = node_type.flatten(output)
        assert context == ["logits", "cache"]
        assert children[0] is output.logits
        assert children[1] is output.cache
        rebuilt = deep_round_trip(output)
        assert type(rebuilt) is CausalLMOutputWithPast
        assert list(rebuilt.keys()) == ["logits", "cache"]
        assert rebuilt.logits is output.logits
        assert rebuilt.loss is None
        torch.testing.assert_close(rebuilt.cache.layers[1].keys, output.cache.layers[1].keys, atol=0, rtol=0)

    def test_seq2seq_output_nests_the_encoder_decoder_cache(
        self, whisper: WhisperForConditionalGeneration, whisper_calls: list[dict[str, Any]]
    ) -> None:
        with torch.no_grad():
            output = whisper(**{**whisper_calls[1], "cache": copy.deepcopy(whisper_calls[1]["cache"])})
        assert find_node_type(output).name == "transformers.Seq2SeqLMOutput"
        rebuilt = deep_round_trip(output)
        assert type(rebuilt) is Seq2SeqLMOutput
        assert type(rebuilt.cache) is EncoderDecoderCache
        assert list(rebuilt.keys()) == list(output.keys())

    def test_generic_outputs_are_registered(self) -> None:
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        from transformers.modeling_outputs import BaseModelOutputWithPast, Seq2SeqModelOutput

        for cls in (BaseModelOutputWithPast, Seq2SeqModelOutput, GenerateDecoderOnlyOutput):
            assert lookup_node_type(f"transformers.{cls.__name__}").cls is cls

    def test_model_specific_outputs_are_named_by_model(self) -> None:
        # Both models define a class of this name; each keeps its own node type.
        classes = [
            importlib.import_module(
                f"transformers.models.{model}.modeling_{model}"
            ).BaseModelOutputWithDeepstackFeatures
            for model in ("qwen3_vl", "qwen3_vl_moe")
        ]
        register_all()
        for model, cls in zip(("qwen3_vl", "qwen3_vl_moe"), classes, strict=True):
            node_type = lookup_node_type(f"transformers.models.{model}.BaseModelOutputWithDeepstackFeatures")
            assert node_type is not None
            assert node_type.cls is cls
            assert find_node_type(cls(last_hidden_state=torch.zeros(1))) is node_type

    def test_register_all_again_picks_up_classes_defined_since(self) -> None:
        @dataclasses.dataclass
        class LateOutput(ModelOutput):
            logits: torch.Tensor | None = None

        @dataclasses.dataclass
        class UserOutput(ModelOutput):
            logits: torch.Tensor | None = None

        LateOutput.__module__ = "transformers.models.late_model.modeling_late_model"
        UserOutput.__module__ = "my_project.outputs"
        register_all()
        node_type = find_node_type(LateOutput(logits=torch.zeros(1)))
        assert node_type is not None
        assert node_type.name == "transformers.models.late_model.LateOutput"
        assert find_node_type(UserOutput(logits=torch.zeros(1))) is None


# --------------------------------------------------------------------------- torch pytree


class _AppendToCache(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        keys = torch.cat([cache.layers[0].keys, x], dim=-2)
        return keys.sum(-1) + cache.layers[1].values.sum()


def _small_cache(batch: int, length: int, config: Any = None) -> DynamicCache:
    cache = DynamicCache(config=config)
    for layer in range(2):
        cache.update(torch.randn(batch, 2, length, 8), torch.randn(batch, 2, length, 8), layer)
    return cache


def _pytree_state(cls: type) -> tuple[Any, ...]:
    serialized = torch_pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    names = {name: typ for name, typ in torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.items() if typ is cls}
    return torch_pytree.SUPPORTED_NODES.get(cls), serialized, names


class TestTorchPytreeNodes:
    CLASSES = (DynamicCache, StaticCache, EncoderDecoderCache)

    def test_transformers_does_not_register_caches_itself(self) -> None:
        assert not any(cls in torch_pytree.SUPPORTED_NODES for cls in self.CLASSES)
        assert CausalLMOutputWithPast in torch_pytree.SUPPORTED_NODES

    def test_export_takes_a_dynamic_cache(self, mistral: MistralForCausalLM) -> None:
        model = _AppendToCache()
        x = torch.randn(2, 2, 1, 8)
        cache = _small_cache(2, 5, config=mistral.config)
        length = torch.export.Dim("length", max=64)
        before = [_pytree_state(cls) for cls in self.CLASSES]
        with torch_pytree_nodes():
            ep = torch.export.export(model, (x, cache), dynamic_shapes=({}, [{2: length}] * 4))
            assert [spec.arg.name for spec in ep.graph_signature.input_specs] == [
                "x",
                "cache_key_0",
                "cache_value_0",
                "cache_key_1",
                "cache_value_1",
            ]
            other = _small_cache(2, 9, config=mistral.config)
            torch.testing.assert_close(ep.module()(x, other), model(x, other), atol=1e-6, rtol=0)
        assert [_pytree_state(cls) for cls in self.CLASSES] == before
        assert DynamicCache not in torch_pytree.SUPPORTED_NODES

    def test_tree_specs_of_two_decode_calls_are_equal(
        self, llama_calls: list[dict[str, Any]], whisper_calls: list[dict[str, Any]]
    ) -> None:
        with torch_pytree_nodes():
            for calls in (llama_calls, whisper_calls):
                (leaves_a, spec_a), (leaves_b, spec_b) = (
                    torch_pytree.tree_flatten(call["cache"]) for call in calls[1:3]
                )
                assert spec_a == spec_b
                assert len(leaves_a) == len(leaves_b)
                assert all(isinstance(leaf, torch.Tensor) for leaf in leaves_a)
                rebuilt = torch_pytree.tree_unflatten(leaves_a, spec_a)
                assert type(rebuilt) is type(calls[1]["cache"])
                assert torch_pytree.treespec_loads(torch_pytree.treespec_dumps(spec_a)) == spec_a

    def test_key_paths_name_the_layers(self, whisper_calls: list[dict[str, Any]]) -> None:
        with torch_pytree_nodes():
            paths, _ = torch_pytree.tree_flatten_with_path(whisper_calls[1]["cache"])
        names = [torch_pytree.keystr(path) for path, _ in paths]
        assert names == [
            ".self_attention_cache['key_0']",
            ".self_attention_cache['value_0']",
            ".cross_attention_cache['key_0']",
            ".cross_attention_cache['value_0']",
        ]

    def test_nested_blocks_keep_the_registration_until_the_last_one_leaves(self) -> None:
        with torch_pytree_nodes():
            ours = torch_pytree.SUPPORTED_NODES[DynamicCache]
            with torch_pytree_nodes():
                assert torch_pytree.SUPPORTED_NODES[DynamicCache] is ours
            assert torch_pytree.SUPPORTED_NODES[DynamicCache] is ours
        assert DynamicCache not in torch_pytree.SUPPORTED_NODES

    def test_restores_a_registration_made_before(self) -> None:
        def flatten_theirs(cache: DynamicCache) -> tuple[list[Any], Any]:
            return [], "theirs"

        def unflatten_theirs(children: Any, context: Any) -> DynamicCache:
            return DynamicCache()

        torch_pytree.register_pytree_node(
            DynamicCache, flatten_theirs, unflatten_theirs, serialized_type_name="someone.DynamicCache"
        )
        try:
            before = _pytree_state(DynamicCache)
            cache = _small_cache(1, 3)
            assert torch_pytree.tree_flatten(cache)[0] == []
            with torch_pytree_nodes():
                assert len(torch_pytree.tree_flatten(cache)[0]) == 4
                assert torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get("someone.DynamicCache") is None
            assert _pytree_state(DynamicCache) == before
            assert torch_pytree.SUPPORTED_NODES[DynamicCache] is before[0]
            assert torch_pytree.tree_flatten(cache)[0] == []
        finally:
            torch_pytree._deregister_pytree_node(DynamicCache)

    def test_registration_is_removed_when_the_block_raises(self) -> None:
        with pytest.raises(RuntimeError, match="boom"), torch_pytree_nodes():
            raise RuntimeError("boom")
        assert DynamicCache not in torch_pytree.SUPPORTED_NODES


# --------------------------------------------------------------------------- empty caches in inference


class TestEmptyCacheInference:
    """The prefill's empty cache is a zero-length cache: a dynamic dimension, zero-length stand-ins."""

    def test_dynamic_cache_declares_its_sequence_dimension(self) -> None:
        node_type = lookup_node_type("transformers.DynamicCache")
        assert node_type is not None and node_type.empty_dim == -2
        static = lookup_node_type("transformers.StaticCache")
        assert static is not None and static.empty_dim is None

    @pytest.mark.parametrize(
        "name",
        [
            "transformers.DynamicCache",
            "transformers.StaticCache",
            "transformers.EncoderDecoderCache",
            "transformers.QuantizedCache",
        ],
    )
    def test_the_caches_node_types_take_their_layout_from_the_torch_free_table(self, name: str) -> None:
        node_type = lookup_node_type(name)
        layout = BUILTIN_LAYOUTS[(name, node_type.version)] if node_type is not None else None
        assert layout is not None and node_layout(name, node_type.version) == layout
        assert (node_type.empty_dim, node_type.child_empty_dims) == (layout.empty_dim, layout.child_empty_dims)

    def test_a_layout_of_another_version_is_unknown(self) -> None:
        assert node_layout("transformers.DynamicCache", 2) is None
        assert node_layout("transformers.NoSuchCache", 1) is None

    def test_a_cache_layout_is_read_without_importing_transformers_or_torch(self) -> None:
        code = (
            "import sys\n"
            "from iobundle.calls import node_layout\n"
            "layout = node_layout('transformers.DynamicCache', 1)\n"
            "print(layout.empty_dim, layout.child_empty_dims(['full', {'linear': 1}]))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
        assert proc.stdout.splitlines() == ["-2 [-2, -2, None, None]", "[]"], proc.stderr

    def test_full_window_cache_length_is_dynamic_because_of_the_prefill(
        self, mistral: MistralForCausalLM, prompt: torch.Tensor
    ) -> None:
        from iobundle import InputObserver

        observer = InputObserver()
        with torch.no_grad(), observer(mistral, store_n_calls=WINDOW + 2):
            mistral.generate(prompt, max_new_tokens=WINDOW + 2, min_new_tokens=WINDOW + 2, do_sample=False)
        # Every decode call holds window - 1 cached positions; only the prefill's empty cache differs.
        decode_lengths = {t.shape[2] for inputs in observer.info.inputs[1:] for t in flatten(inputs.kwargs["cache"])[0]}
        assert decode_lengths == {WINDOW - 1}
        shapes = observer.infer_dynamic_shapes()
        assert shapes["cache"] == [{2: torch.export.Dim.DYNAMIC}] * 4
        prefill = observer.infer_arguments(0)
        prefill = {**{k: v for k, v in prefill.items() if k != "kwargs"}, **prefill.get("kwargs", {})}
        assert [tuple(t.shape) for t in flatten(prefill["cache"])[0]] == [(1, 2, 0, 8)] * 4
        expected = observer.info.flat_outputs[0][0]
        with torch.no_grad():
            torch.testing.assert_close(mistral(**prefill).logits, expected, atol=1e-6, rtol=0)


def test_public_context_manager_registers_and_restores():
    import torch.utils._pytree as torch_pytree

    from iobundle.capture import transformers_pytree_nodes

    transformers = pytest.importorskip("transformers")
    before = torch_pytree.SUPPORTED_NODES.get(transformers.DynamicCache)
    with transformers_pytree_nodes():
        assert transformers.DynamicCache in torch_pytree.SUPPORTED_NODES
        assert transformers.EncoderDecoderCache in torch_pytree.SUPPORTED_NODES
    assert torch_pytree.SUPPORTED_NODES.get(transformers.DynamicCache) is before
