"""Tests of the ``transformers.QuantizedCache`` node type: quanto layers recorded as plain tensors and rebuilt."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from iobundle.calls._layouts import quantized_settings
from iobundle.calls._quantized_cache import QuantizedStates, quantize_states
from iobundle.calls._registry import find_node_type, lookup_node_type
from iobundle.calls._transformers import register_all
from iobundle.errors import UnsupportedInputError

pytestmark = pytest.mark.slow

SETTINGS = {"nbits": 4, "axis_key": 0, "axis_value": 0, "q_group_size": 8, "residual_length": 3}


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register_all()


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _generate(model: LlamaForCausalLM, **cache_config: Any) -> Any:
    pytest.importorskip("optimum.quanto", reason="records a quanto-quantized cache: pip install 'iobundle[quanto]'")
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            do_sample=False,
            cache_implementation="quantized",
            cache_config={"backend": "quanto", **cache_config},
            return_dict_in_generate=True,
        )


def _round_trip(cache: Any) -> Any:
    node_type = find_node_type(cache)
    assert node_type is not None and node_type.name == "transformers.QuantizedCache"
    children, context = node_type.flatten(cache)
    return node_type.unflatten(children, json.loads(json.dumps(context)))


@pytest.mark.parametrize("nbits", [2, 4])
def test_quantize_states_matches_quanto_bit_for_bit(nbits: int) -> None:
    quanto = pytest.importorskip("optimum.quanto", reason="compares with quanto: pip install 'iobundle[quanto]'")
    states = torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(0))
    qtype = quanto.qint4 if nbits == 4 else quanto.qint2
    scale, shift = quanto.MaxOptimizer()(states, qtype, 0, 8)
    reference = quanto.quantize_weight(states, qtype, 0, scale, shift, 8)
    ours = quantize_states(states, nbits, 8)
    assert ours.codes.dtype == torch.uint8 and ours.codes.shape == (2, 2, 7, 16 * nbits // 8)
    assert torch.equal(ours.dequantize(), reference.dequantize())


def test_recorded_cache_rebuilds_to_the_same_logits_through_requantization(llama: LlamaForCausalLM) -> None:
    out = _generate(llama, **{k: v for k, v in SETTINGS.items() if k != "axis_key" and k != "axis_value"})
    recorded, rebuilt = out.past_key_values, _round_trip(out.past_key_values)
    assert all(isinstance(layer._quantized_keys, QuantizedStates) for layer in rebuilt.layers)
    assert [layer.cumulative_length for layer in rebuilt.layers] == [
        layer.cumulative_length for layer in recorded.layers
    ]
    token = out.sequences[:, -1:]
    position = torch.full((2, 1), out.sequences.shape[1] - 1)
    requantized = 0
    with torch.no_grad():
        for _ in range(4):  # residual_length 3: at least one step moves the residual into the quantized states
            expected = llama(input_ids=token, cache=recorded, position_ids=position).logits
            obtained = llama(input_ids=token, cache=rebuilt, position_ids=position).logits
            torch.testing.assert_close(obtained, expected, atol=0, rtol=0)
            requantized += rebuilt.layers[0].keys.dim() == 1
            token, position = expected.argmax(-1), position + 1
    assert requantized >= 1


def test_quantized_states_are_plain_tensors_in_the_context_order(llama: LlamaForCausalLM) -> None:
    out = _generate(llama, nbits=4, q_group_size=8, residual_length=8)
    children, context = find_node_type(out.past_key_values).flatten(out.past_key_values)
    assert context == [{"quanto": {**SETTINGS, "residual_length": 8}}] * 2
    assert len(children) == 16 and all(type(t) is torch.Tensor for t in children)
    key, value, codes, scale, shift = children[:5]
    assert key.shape == value.shape == (2, 2, 2, 8)  # the 2 decode steps' tokens, full precision
    assert codes.dtype == torch.uint8 and codes.shape == (2, 2, 5, 4)  # the prefill, 2 codes a byte
    assert scale.shape == shift.shape == (2, 2, 5, 1)


def test_axis_minus_one_is_refused_with_its_reason(llama: LlamaForCausalLM) -> None:
    # along axis -1 quanto groups the batch, heads and positions: 4 divides 2 x 2 x length
    out = _generate(llama, nbits=4, q_group_size=4, residual_length=8, axis_key=-1, axis_value=-1)
    with pytest.raises(UnsupportedInputError, match=r"Layer 0 of the QuantizedCache .* axis -1"):
        find_node_type(out.past_key_values).flatten(out.past_key_values)


def test_rebuilt_cache_runs_without_a_quantization_library() -> None:
    code = """
import sys, torch
from iobundle.calls._registry import lookup_node_type
from iobundle.calls._quantized_cache import quantize_states
from iobundle.calls._transformers import register_all
register_all()
q = quantize_states(torch.randn(1, 2, 4, 8), 4, 8)
settings = {"nbits": 4, "axis_key": 0, "axis_value": 0, "q_group_size": 8, "residual_length": 3}
# residual key and value (None: empty), then the codes, scales and shifts of keys and of values
children = [None, None, q.codes, q.scale, q.shift, q.codes, q.scale, q.shift]
cache = lookup_node_type("transformers.QuantizedCache").unflatten(children, [{"quanto": settings}])
keys, _ = cache.layers[0].update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
assert keys.shape == (1, 2, 5, 8), keys.shape
assert "optimum" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"nbits": 3}, "nbits 3; expected 2 or 4"),
        ({"axis_key": -1}, "axis_key -1; expected 0"),
        ({"q_group_size": 0}, "quantization group size 0"),
        ({"residual_length": "8"}, "residual length '8'"),
    ],
)
def test_context_read_from_a_bundle_is_checked(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantized_settings({"quanto": {**SETTINGS, **change}}, 0)


def test_context_with_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="Layer 1 of the QuantizedCache has kind"):
        quantized_settings({"quanto": {**SETTINGS, "module": "os"}}, 1)


def test_residual_emptied_by_a_step_flattens_to_zero_length_tensors() -> None:
    states = quantize_states(torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0)), 4, 8)
    settings = {**SETTINGS, "residual_length": 1}
    node_type = lookup_node_type("transformers.QuantizedCache")
    children = [None, None, *[states.codes, states.scale, states.shift] * 2]
    cache = node_type.unflatten(children, [{"quanto": settings}])
    cache.layers[0].update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # residual 1 reached: moved
    assert cache.layers[0].keys.dim() == 1  # transformers' placeholder
    key, value, codes, *_ = node_type.flatten(cache)[0]
    # the same structure as a step with a residual: one program serves both
    assert key.shape == value.shape == (1, 2, 0, 8)
    assert codes.shape == (1, 2, 5, 4)
