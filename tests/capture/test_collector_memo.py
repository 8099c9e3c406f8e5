"""A tensor or a cache met again while recording costs a look-up, never a wrong key."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from iobundle.calls import TensorCollector, record_value, tensor_keys
from iobundle.calls._tree import _SWEEP_MIN
from iobundle.capture._snapshots import SnapshotTable
from iobundle.schema import TensorNode


def _collector() -> TensorCollector:
    table = SnapshotTable()
    return TensorCollector(table.snapshot, table)  # what the observer does


def _cache(layers: int = 3) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), i)
    return cache


def _record(value: object, collector: TensorCollector) -> object:
    return record_value(value, collector, path="past_key_values", on_opaque=lambda *a: None)


def test_a_cache_passed_on_unchanged_is_the_node_recorded_before() -> None:
    collector, cache = _collector(), _cache()
    first = _record(cache, collector)
    assert _record(cache, collector) is first


def test_a_cache_tensor_changed_in_place_gets_a_new_key() -> None:
    collector, cache = _collector(), _cache()
    first = _record(cache, collector)
    cache.layers[1].keys.add_(1.0)  # a static cache's update: same object, new version
    second = _record(cache, collector)
    assert second is not first
    old, new = tensor_keys(first), tensor_keys(second)
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert changed == [2]  # layer 1's keys, and nothing else
    assert torch.equal(collector.tensors[new[2]], cache.layers[1].keys)
    assert not torch.equal(collector.tensors[old[2]], cache.layers[1].keys)


def test_a_cache_whose_tensors_were_replaced_is_walked_again() -> None:
    collector, cache = _collector(), _cache()
    first = _record(cache, collector)
    cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)  # a decode step appends to layer 0
    second = _record(cache, collector)
    assert second is not first
    assert collector.tensors[tensor_keys(second)[0]].shape == (1, 2, 5, 8)
    assert tensor_keys(second)[2:] == tensor_keys(first)[2:]  # the other layers' tensors keep their keys


def test_keys_dropped_from_the_table_void_the_memo() -> None:
    collector, cache = _collector(), _cache()
    first = _record(cache, collector)
    collector.tensors.discard(tensor_keys(first)[:1])  # a failed call's snapshots leave the table
    second = _record(cache, collector)
    assert second is not first
    assert all(key in collector.tensors for key in tensor_keys(second))


def test_the_memo_keeps_no_tensor_alive() -> None:
    """An object recorded once (a model's output) must not hold its tensors after the caller let them go."""
    import gc
    import weakref

    collector = _collector()
    collector.tensors.reference = True  # the writer process's way: outputs are referenced, not copied
    cache = _cache()
    tensors = [weakref.ref(layer.keys) for layer in cache.layers]
    _record(cache, collector)
    collector.tensors.discard(list(collector.tensors))  # the table lets them go (written, in a stream)
    del cache
    gc.collect()
    assert all(ref() is None for ref in tensors)


def test_what_the_collector_remembers_of_tensors_gone_stays_bounded() -> None:
    """A decode step replaces a cache's tensors: what the collector kept of the old ones goes soon after them."""
    collector = _collector()
    collector.tensors.reference = True
    cache = _cache(layers=4)
    for _ in range(1500):  # 3000 tensors replaced, beyond the collector's sweep threshold
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)  # layer 0's tensors are new each step
        _record(cache, collector)
        collector.tensors.discard(list(collector.tensors))  # written: the table lets them go
    assert len(collector._seen) <= _SWEEP_MIN + 8  # entries of freed tensors leave at each sweep
    collector._sweep()
    remembered = [entry() for entry in collector._seen.values()]
    assert all(isinstance(tensor, torch.Tensor) for tensor in remembered)  # no entry outlived a sweep
    assert len(remembered) == 8  # each layer's current keys and values, nothing of the steps before
    assert collector.met(cache.layers[0].keys)


def test_a_new_tensor_with_the_id_of_one_gone_gets_its_own_key() -> None:
    """Entries outlive their tensors until a sweep: a new tensor at a freed tensor's address is not taken for it."""
    collector = _collector()  # snapshots are copies: the table keeps the old keys, not the old tensors
    old = [torch.randn(2, 3) for _ in range(4)]
    old_keys = [node.key for node in collector.nodes(old)]
    old_ids = set(map(id, old))
    del old
    made = []  # kept alive: each round allocates anew, until one takes a freed address
    for _ in range(1000):
        new = [torch.randn(2, 3) for _ in range(4)]
        made.append(new)
        if old_ids & set(map(id, new)):
            break
    assert old_ids & set(map(id, new)), "no freed id was reused: the case this test is about did not happen"
    assert all(key in collector.tensors for key in old_keys)  # the stale entries still name live keys
    new_keys = [node.key for node in collector.nodes(new)]
    assert not set(new_keys) & set(old_keys)
    assert all(torch.equal(collector.tensors[key], tensor) for key, tensor in zip(new_keys, new))


def _referencing_collector() -> tuple[TensorCollector, SnapshotTable]:
    table = SnapshotTable()
    table.reference = True  # a call's outputs, recorded for a writer process
    return TensorCollector(table.snapshot, table), table


def test_a_cache_of_new_tensors_is_taken_at_once_with_the_keys_one_by_one_would_give() -> None:
    cache = _cache(4)
    batched, table = _referencing_collector()
    single, _ = _referencing_collector()
    node = _record(cache, batched)
    keys = tensor_keys(node)
    assert keys == [
        tensor_keys(_record(t, single))[0] for t in [t for layer in cache.layers for t in (layer.keys, layer.values)]
    ]
    assert len(set(keys)) == 8
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(a is b for a, b in zip(table.all_for_writing(keys), tensors))  # references: the writer copies them
    assert [batched.node(t).key for t in tensors] == keys  # each is met again by a look-up


def test_a_tensor_twice_in_one_cache_has_one_key() -> None:
    collector, _ = _referencing_collector()
    cache = _cache(2)
    cache.layers[0].values = cache.layers[0].keys  # keys and values the same tensor
    keys = tensor_keys(_record(cache, collector))
    assert keys[0] == keys[1] and len(set(keys)) == 3


def test_a_cache_mixing_tensors_met_before_and_new_ones_keeps_the_old_keys() -> None:
    collector, _ = _referencing_collector()
    cache = _cache(3)
    old = collector.node(cache.layers[1].values).key  # met before, alone
    keys = tensor_keys(_record(cache, collector))
    assert keys[3] == old and len(set(keys)) == 6


def test_a_cache_changed_after_it_was_taken_reads_as_changed() -> None:
    collector, table = _referencing_collector()
    cache = _cache(2)
    keys = tensor_keys(_record(cache, collector))
    cache.layers[0].keys.add_(1.0)  # the model changes it in place before the writer copied it
    (got,) = table.all_for_writing([keys[0]])
    assert isinstance(got, Exception) and "changed in place" in str(got)
    (fine,) = table.all_for_writing([keys[1]])
    assert fine is cache.layers[0].values


def test_a_tensor_whose_data_was_rebound_without_its_version_counter_gets_a_new_key() -> None:
    collector, _ = _referencing_collector()
    tensor = torch.zeros(2, 3)
    first = collector.node(tensor)
    assert collector.node(tensor) is first  # met again unchanged: a look-up
    version = tensor._version
    tensor.data = torch.ones(3, 2)  # another shape, and no version bump
    assert tensor._version == version
    second = collector.node(tensor)
    assert second.key != first.key
    assert collector.tensors[second.key].shape == (3, 2)


def test_the_nodes_of_new_tensors_are_the_nodes_pydantic_would_build() -> None:
    collector, _ = _referencing_collector()
    cache = _cache(2)
    node = _record(cache, collector)
    for item in node.items:  # type: ignore[attr-defined]
        built = TensorNode(key=item.key)
        assert item == built and item.model_fields_set == built.model_fields_set
        assert item.model_dump_json() == built.model_dump_json()
        assert TensorNode.model_validate_json(item.model_dump_json()) == item
