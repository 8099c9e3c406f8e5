"""The JSON a recorded call crosses to the writer process in is the call, whatever it remembers between calls."""

from __future__ import annotations

import pytest

from iobundle.capture._call_json import CallJson
from iobundle.schema import CallEntry, ConstNode, DictNode, ListNode, ObjectNode, TensorNode


def _entry(index: int, **fields: object) -> CallEntry:
    return CallEntry(index=index, args=fields.pop("args", []), kwargs=fields.pop("kwargs", {}), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "calls",
    [
        # constants equal across types (True == 1) and the sign of a zero are not taken from an earlier call
        [_entry(0, cst_kwargs={"use_cache": True, "n": 1}, latency=0.5), _entry(1, cst_kwargs={"use_cache": 1, "n": True}, latency=1e-05)],
        [_entry(0, cst_kwargs={"t": 0.0}, latency=0.5), _entry(1, cst_kwargs={"t": -0.0}, latency=0.5)],
        [_entry(0, filled=["a"], latency=0.5), _entry(1, filled=[0], latency=0.5), _entry(2, latency=None)],
        [_entry(0, status="failed", error='boom "quoted"', latency=2.5), _entry(1, latency=2.5)],
        [_entry(0, status="incomplete", error="a", latency=1.0), _entry(1, status="incomplete", error="b", latency=1.0)],
        [_entry(0, kwargs={'we"ird name': TensorNode(key="t1"), "é": ConstNode(value=float("inf"))}, latency=0.1)],
        [_entry(0, args=[ListNode(items=[ConstNode(value=float("nan")), TensorNode(key="k 2")])], latency=0.1)],
        [_entry(0, outputs=DictNode(keys=["x", 1], items=[TensorNode(key="t3"), ConstNode(value=-float("inf"))]))],
    ],
)
def test_each_call_reads_back_as_itself(calls: list[CallEntry]) -> None:
    to_json = CallJson()
    for call in calls:
        text, _ = to_json(call)
        back = CallEntry.model_validate_json(text)
        assert back.model_dump_json() == call.model_dump_json()  # nan != nan: compared as their JSON


def test_the_keys_listed_are_those_of_the_tensors_written_out() -> None:
    tensors = [TensorNode(key=f"t{i}") for i in range(4)]
    cache = ObjectNode(type="transformers.DynamicCache", version=1, context=["full", "full"], items=tensors)
    to_json = CallJson()
    _, first = to_json(_entry(0, kwargs={"cache": cache, "x": TensorNode(key="t9")}))
    _, second = to_json(_entry(1, kwargs={"cache": cache, "x": TensorNode(key="t10")}))
    assert first == ["t0", "t1", "t2", "t3", "t9"]
    assert second == ["t10"]  # the cache node (the same object) was remembered with its keys
