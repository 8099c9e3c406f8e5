"""The one structure key of a call (``iobundle.schema.call_key``) and the places that use it."""

from __future__ import annotations

import json

import pytest

from iobundle.schema import CallEntry, ConstNode, DictNode, ObjectNode, TensorNode, TupleNode, call_key, tree_key


def _call(index: int, *, k: str = "t", const=1, context=None, outputs: bool = True, **extra) -> CallEntry:
    cache = ObjectNode(type="transformers.DynamicCache", version=1, context=context, items=[TensorNode(key=f"{k}2")])
    return CallEntry(
        index=index,
        args=[TensorNode(key=f"{k}0")],
        kwargs={
            "mask": DictNode(keys=["a"], items=[TensorNode(key=f"{k}1")]),
            "cache": cache,
            "n": ConstNode(value=const),
        },
        outputs=TupleNode(items=[TensorNode(key=f"{k}3")]) if outputs else None,
        **extra,
    )


def test_calls_that_differ_only_in_tensor_keys_have_one_key_and_give_their_keys_in_order():
    keys_a: list[str] = []
    keys_b: list[str] = []
    assert call_key(_call(0, k="a"), keys_a, outputs=True) == call_key(_call(1, k="b"), keys_b, outputs=True)
    assert keys_a == ["a0", "a1", "a2", "a3"] and keys_b == ["b0", "b1", "b2", "b3"]


@pytest.mark.parametrize(
    "other",
    [
        {"const": True},  # 1 == True in Python, not in a bundle
        {"const": 1.0},
        {"context": ["full"]},
        {"cst_kwargs": {"use_cache": True}},
        {"filled": ["mask"]},
    ],
)
def test_any_difference_but_tensor_keys_is_another_structure(other):
    assert call_key(_call(0), []) != call_key(_call(0, **other), [])


def test_outputs_are_part_of_the_structure_only_when_asked():
    assert call_key(_call(0), []) == call_key(_call(0, outputs=False), [])
    assert call_key(_call(0), [], outputs=True) != call_key(_call(0, outputs=False), [], outputs=True)


def test_a_context_is_compared_by_value_and_type():
    a = ObjectNode(type="x", version=0, context={"n": [1, 2]}, items=[])
    b = ObjectNode(type="x", version=0, context={"n": [1, 2.0]}, items=[])
    assert tree_key(a, []) == tree_key(a.model_copy(), []) and tree_key(a, []) != tree_key(b, [])


def test_the_compact_manifest_stores_one_structure_per_key(tmp_path):
    from iobundle.schema import Manifest, dump_manifest

    calls = [_call(0, k="a"), _call(1, k="b"), _call(2, k="c", const=True), _call(3, k="d")]
    keys = [f"{c}{i}" for c in "abcd" for i in range(4)]
    manifest = Manifest.model_validate(
        {
            "producer": {"iobundle": "0", "torch": "0", "python": "3"},
            "signature": {"method": "forward", "parameters": []},
            "calls": [c.model_dump() for c in calls],
            "tensors": {k: {"file": "calls/000000.safetensors", "name": k, "dtype": "F32", "shape": [1]} for k in keys},
            "files": {"calls/000000.safetensors": {"size": 8, "sha256": "0" * 64}},
        }
    )
    compact = json.loads(dump_manifest(manifest))
    assert len(compact["structures"]) == len({call_key(c, [], outputs=True) for c in calls}) == 2
    assert [c["structure"] for c in compact["calls"]] == [0, 0, 1, 0]
