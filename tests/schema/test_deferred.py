"""What opening a format-version-3 manifest builds: compact rows at open, the full models on first access.

A deferred manifest or call must be indistinguishable from the plain models once anything looks at
it: equal to the manifest validated whole, dumped alike, copied and pickled as the plain class.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, TypeAdapter

from iobundle import load_bundle
from iobundle.schema import (
    CallEntry,
    Manifest,
    TensorInfo,
    TensorNode,
    deferred_calls,
    deferred_keys,
    deferred_shape,
    dump_manifest,
    load_manifest,
    tensor_rows,
)

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"
COMPACT = ["compact_nested", "compact_growing"]


def whole(name: str) -> Manifest:
    """The same content validated by pydantic as one plain Manifest (no deferred part)."""
    return Manifest.model_validate_json(load_manifest(GOLDEN / name).model_dump_json())


held = BaseModel.__dict__["__dict__"].__get__
"""A model's field values as held, read past the ``__dict__`` attribute (which builds a deferred model first)."""


def built(call: CallEntry) -> bool:
    return "args" in held(call)


@pytest.mark.parametrize("name", COMPACT)
class TestDeferredIsThePlainModel:
    def test_open_builds_no_call_tree_nor_tensor_entry(self, name):
        manifest = load_manifest(GOLDEN / name)
        calls = deferred_calls(manifest)
        assert "calls" not in held(manifest) and "tensors" not in held(manifest)
        assert calls and not any(built(c) for c in calls)

    def test_equal_to_the_manifest_validated_whole(self, name):
        plain = whole(name)
        assert load_manifest(GOLDEN / name) == plain and plain == load_manifest(GOLDEN / name)
        assert [c == p for c, p in zip(load_manifest(GOLDEN / name).calls, plain.calls)] == [True] * len(plain.calls)

    def test_dumps_as_the_plain_model(self, name):
        plain = whole(name)
        assert load_manifest(GOLDEN / name).model_dump() == plain.model_dump()
        assert json.loads(load_manifest(GOLDEN / name).model_dump_json()) == json.loads(plain.model_dump_json())
        text = (GOLDEN / name / "manifest.json").read_text("utf-8")  # written as the newest version, 5
        assert dump_manifest(load_manifest(GOLDEN / name)) == re.sub(
            r'"format_version":[34],', '"format_version":6,', text
        )

    def test_every_pydantic_dump_of_unbuilt_calls_is_whole(self, name):
        """pydantic's serializer, not only the deferred models' own methods, sees every tree: no dump leaves one out."""
        plain = whole(name)
        eager, eager_json = plain.model_dump(), json.loads(plain.model_dump_json())
        fields = lambda m: {k: getattr(m, k) for k in Manifest.model_fields if k != "calls"}  # noqa: E731
        opened = load_manifest(GOLDEN / name)
        holder = Manifest(**fields(opened), calls=deferred_calls(opened))  # a plain Manifest holding unbuilt calls
        assert type(holder) is Manifest and not any(built(c) for c in deferred_calls(opened))
        assert holder.model_dump() == eager and json.loads(holder.model_dump_json()) == eager_json
        copied = load_manifest(GOLDEN / name)
        updated = copied.model_copy(update={"calls": deferred_calls(load_manifest(GOLDEN / name))})
        assert json.loads(updated.model_dump_json()) == eager_json
        adapter = TypeAdapter(Manifest)
        assert adapter.dump_python(load_manifest(GOLDEN / name)) == eager
        assert json.loads(adapter.dump_json(load_manifest(GOLDEN / name))) == eager_json
        calls = deferred_calls(load_manifest(GOLDEN / name))
        assert TypeAdapter(list[CallEntry]).dump_python(calls, mode="json") == eager_json["calls"]
        assert [dict(c) for c in deferred_calls(load_manifest(GOLDEN / name))] == [dict(c) for c in plain.calls]

    def test_copies_and_pickles_are_plain_models(self, name):
        manifest = load_manifest(GOLDEN / name)
        shallow = copy.copy(manifest)  # shares its calls, as pydantic's shallow copies do
        assert type(shallow) is Manifest and shallow == whole(name) and shallow.calls[0] is manifest.calls[0]
        for other in (copy.deepcopy(manifest), pickle.loads(pickle.dumps(manifest))):
            assert type(other) is Manifest and other == whole(name)
            assert all(type(c) is CallEntry for c in other.calls)

    def test_a_copy_keeps_what_it_changes(self, name):
        call = deferred_calls(load_manifest(GOLDEN / name))[1]
        changed = call.model_copy(update={"outputs": None, "args": []})
        assert type(changed) is CallEntry and changed.outputs is None and changed.args == []
        assert changed.kwargs == call.kwargs and deferred_shape(changed) is None

    def test_tensor_rows_say_what_the_entries_say(self, name):
        manifest = load_manifest(GOLDEN / name)
        rows = tensor_rows(manifest)
        assert all(isinstance(row, TensorInfo) for row in rows.values())
        assert rows == tensor_rows(whole(name))  # rows kept at open == rows made from the entries


def test_keys_and_shape_without_building_the_trees():
    manifest = load_manifest(GOLDEN / "compact_nested")
    calls = deferred_calls(manifest)
    keys = [deferred_keys(c) for c in calls]
    shapes = [deferred_shape(c) for c in calls]
    plain = whole("compact_nested").calls
    raw = json.loads((GOLDEN / "compact_nested" / "manifest.json").read_text("utf-8"))
    assert keys == [c["keys"] for c in raw["calls"]]  # inputs, then outputs, slot by slot
    assert [built(c) for c in calls] == [True, True, False]  # structures 0, 1, 1: each worked out once
    for call, (_, inputs), full in zip(calls, shapes, plain):
        assert inputs == [n.key for n in _tensor_nodes(full, outputs=False)]
        assert call.kwargs == full.kwargs and call.outputs == full.outputs
    assert deferred_keys(plain[0]) is None and deferred_shape(plain[0]) is None


def _tensor_nodes(call: CallEntry, *, outputs: bool) -> list[TensorNode]:
    from iobundle.calls import iter_tensor_nodes

    trees = [*call.args, *call.kwargs.values(), *([call.outputs] if outputs and call.outputs is not None else [])]
    return [n for tree in trees for n in iter_tensor_nodes(tree)]


def test_open_and_infer_build_one_call_per_structure():
    """load_bundle + num_obs + infer_dynamic_shapes build the trees of one call per distinct structure only."""
    bundle = load_bundle(GOLDEN / "compact_growing")
    assert bundle.num_obs() == len(bundle.calls)
    bundle.infer_dynamic_shapes()
    structures = len(json.loads((GOLDEN / "compact_growing" / "manifest.json").read_text("utf-8"))["structures"])
    assert 1 <= sum(built(c) for c in deferred_calls(bundle.manifest)) <= structures
    assert "tensors" not in held(bundle.manifest)
