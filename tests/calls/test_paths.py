"""The one path syntax for a tensor in a call (``iobundle.calls.tensor_paths``) and the patterns that name it."""

from __future__ import annotations

import pytest

from iobundle.calls import path_matches, tensor_paths
from iobundle.replay.check import Tolerances, output_paths
from iobundle.schema import DictNode, ObjectNode, TensorNode, TupleNode


def _t(key: str) -> TensorNode:
    return TensorNode(key=key)


CACHE = ObjectNode(type="transformers.DynamicCache", version=1, context=["full"], items=[_t("k"), _t("v")])
OUTPUT = ObjectNode(
    type="transformers.CausalLMOutputWithPast",
    version=1,
    context=["logits", "past_key_values"],
    items=[_t("l"), CACHE],
)


def test_fields_are_dotted_and_items_indexed():
    assert [p for p, _ in tensor_paths(OUTPUT)] == ["logits", "past_key_values[0]", "past_key_values[1]"]
    assert [p for p, _ in tensor_paths(TupleNode(items=[_t("a"), _t("b")]))] == ["output[0]", "output[1]"]
    assert [p for p, _ in tensor_paths(_t("a"))] == ["output"]
    nested = DictNode(keys=["mask", 3], items=[TupleNode(items=[_t("a")]), _t("b")])
    assert [p for p, _ in tensor_paths(nested, "inputs")] == ["inputs.mask[0]", "inputs[3]"]


def test_reports_name_outputs_with_the_one_syntax():
    assert output_paths(OUTPUT) == [p for p, _ in tensor_paths(OUTPUT)]


@pytest.mark.parametrize(
    "pattern",
    [
        "past_key_values[1]",
        "past_key_values.1",
        "past_key_values.*",
        "past_key_values[*]",
        "outputs.past_key_values.1",
        "past_*",
    ],
)
def test_a_pattern_in_either_spelling_names_the_cache_tensor(pattern):
    assert path_matches(pattern, "past_key_values[1]")
    assert not path_matches(pattern, "logits")


def test_brackets_in_a_pattern_are_the_paths_own_not_a_character_class():
    assert not path_matches("past_key_values[1]", "past_key_values1")
    assert not path_matches("past_key_values[01]", "past_key_values[0]")


def test_the_documented_tolerance_pattern_matches_the_cache_outputs():
    tol = Tolerances(atol=1e-4, per_output_atol={"logits": 1e-3, "past_key_values.*": 1e-5})
    assert [tol.for_output(p)[0] for p in output_paths(OUTPUT)] == [1e-3, 1e-5, 1e-5]
    assert tol.unused([[p] for p in output_paths(OUTPUT)]) == []
