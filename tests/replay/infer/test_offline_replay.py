"""Capture here, replay elsewhere: a bundle loaded in a fresh process, without the model code,
infers what ``torch.onnx.InputObserver`` infers in the capturing process.

The models are defined in this module. Every case is captured and saved here; one
subprocess (``python -I``, cwd in a temporary directory, so this module cannot be imported
there) loads each bundle and writes ``infer_dynamic_shapes`` (as JSON) and
``infer_arguments`` (with ``torch.save``); the results are compared with the reference
observer run here on the same calls.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch.onnx import InputObserver as ReferenceObserver

from iobundle import InputObserver

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]

_GEN = torch.Generator().manual_seed(1)


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_GEN, dtype=dtype)
    return torch.randint(0, 100, shape, generator=_GEN, dtype=dtype)


class KeyValue:
    """A user class registered as a pytree node here only: the replaying process cannot rebuild it."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key = key
        self.value = value


torch_pytree.register_pytree_node(
    KeyValue,
    lambda kv: ([kv.key, kv.value], ["key", "value"]),
    lambda children, context: KeyValue(**dict(zip(context, children))),
    serialized_type_name=f"{__name__}.KeyValue",
)


class TwoInputs(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Flags(torch.nn.Module):
    def forward(self, x, flag: bool = False, n: int = 1):
        return x * n if flag else x + n


class OptionalMask(torch.nn.Module):
    def forward(self, x, mask=None, bias=None):
        x = x if mask is None else x * mask
        return x if bias is None else x + bias


class Nested(torch.nn.Module):
    def forward(self, x, extra):
        return x + extra["pair"][0] + extra["pair"][1].sum() + extra["scale"].sum()


class Prefill(torch.nn.Module):
    def forward(self, input_ids, pixel_values=None, past=None):
        return input_ids.float().sum()


class VarKeyword(torch.nn.Module):
    def forward(self, x, **kwargs):
        return x + sum(kwargs.values())


class VarPositional(torch.nn.Module):
    def forward(self, a, *args, **kwargs):
        return a + sum(args) + sum(kwargs.values())


class WithCache(torch.nn.Module):
    def forward(self, x, cache):
        return x.sum() + cache.key.sum() + cache.value.sum()


@dataclass
class Case:
    """A call pattern; ``expected_calls`` are what the reference runs when it fails on ``calls``."""

    id: str
    model: Callable[[], torch.nn.Module]
    calls: Calls
    observer_kwargs: dict[str, Any] = field(default_factory=dict)
    batch: Any = None
    expected_calls: Calls | None = None
    user_class: bool = False


def _cases() -> list[Case]:
    x1, y1, x2, y2, x3, m3 = t(2, 3), t(2, 3), t(3, 3), t(3, 3), t(4, 3), t(4, 3)
    ids = [t(1, n, dtype=torch.int64) for n in (5, 1, 1)]
    return [
        Case("positional", TwoInputs, [((x1, y1), {}), ((x2, y2), {})]),
        Case("keyword", TwoInputs, [((), {"x": x1, "y": y1}), ((), {"y": y2, "x": x2})]),
        Case("bool_constant", Flags, [((x1,), {"flag": True}), ((x2,), {"flag": True})]),
        Case("int_constant", Flags, [((x1,), {"n": 3}), ((x2,), {"n": 3})]),
        Case("positional_and_keyword", OptionalMask, [((x1,), {"mask": y1}), ((x2,), {"mask": y2})]),
        Case("optional_positional_absent_first", OptionalMask, [((x1,), {}), ((x2, y2), {}), ((x3, m3), {})]),
        Case(
            "optional_keyword_absent_first", OptionalMask, [((x1,), {}), ((x2,), {"mask": y2}), ((x3,), {"mask": m3})]
        ),
        Case(
            "nested_lists_and_dicts",
            Nested,
            [
                ((x1, {"pair": [y1, t(2, 1)], "scale": t(1)}), {}),
                ((x2, {"pair": [y2, t(3, 1)], "scale": t(1)}), {}),
            ],
        ),
        Case(
            "keyword_orders",
            OptionalMask,
            [((x1,), {"bias": t(2, 3), "mask": y1}), ((x2,), {"mask": y2, "bias": t(3, 3)})],
        ),
        Case("keyword_then_positional", OptionalMask, [((x1,), {"mask": y1}), ((x2, y2), {})]),
        Case(
            "positional_then_keyword",
            OptionalMask,
            [((x1, y1), {}), ((x2,), {"mask": y2})],
            expected_calls=[((x1, y1), {}), ((x2, y2), {})],
        ),
        Case("batch_by_name", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch=["x"]),
        Case("batch_by_position", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch=[1]),
        Case("batch_true", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch=True),
        Case(
            "value_if_missing",
            Prefill,
            [
                ((ids[0],), {"pixel_values": t(1, 3, 4, 4)}),
                ((ids[1],), {"past": t(1, 5)}),
                ((ids[2],), {"past": t(1, 6)}),
            ],
            observer_kwargs={"value_if_missing": {"pixel_values": torch.empty((0, 3, 4, 4))}},
        ),
        Case("var_keyword", VarKeyword, [((x1,), {"a": y1, "b": t(2, 3)}), ((x2,), {"b": t(3, 3), "a": y2})]),
        Case("var_positional_and_keyword", VarPositional, [((x1, y1), {"c": t(2, 3)}), ((x2, y2), {"c": t(3, 3)})]),
        Case(
            "user_pytree_class",
            WithCache,
            [((x1, KeyValue(t(1, 2, 4), t(1, 2, 4))), {}), ((x2, KeyValue(t(1, 3, 4), t(1, 3, 4))), {})],
            user_class=True,
        ),
    ]


CASES = _cases()


def encode_dynamic_shapes(ds: Any) -> Any:
    """``dynamic_shapes`` as JSON that keeps container types, key order and key types."""
    if ds is None:
        return None
    if isinstance(ds, dict):
        return {"dict": [[k, encode_dynamic_shapes(v)] for k, v in ds.items()]}
    if isinstance(ds, (tuple, list)):
        return {type(ds).__name__: [encode_dynamic_shapes(v) for v in ds]}
    return {"dim": repr(ds)}


def _batch(spec: Any) -> Any:
    return set(spec) if isinstance(spec, list) else spec


_REPLAY = """from __future__ import annotations
import json, sys
import torch
from iobundle import IobundleError, load_bundle

{encode}

try:
    import {test_module}  # noqa: F401
    importable = True
except ImportError:
    importable = False

jobs = json.loads(open(sys.argv[1]).read())
report = {{"test_module_importable": importable, "cases": {{}}}}
for job in jobs:
    bundle = load_bundle(job["bundle"])
    batch = set(job["batch"]) if isinstance(job["batch"], list) else job["batch"]
    case = {{"num_obs": bundle.num_obs(), "dynamic_shapes": encode_dynamic_shapes(bundle.infer_dynamic_shapes(batch))}}
    tensors = {{"flat": bundle.infer_arguments(flat=True)}}
    tensors["flat_by_index"] = [bundle.infer_arguments(i, flat=True) for i in range(bundle.num_obs())]
    try:
        tensors["as_args_kwargs"] = bundle.infer_arguments(as_args_kwargs=True)
        case["rebuild_error"] = None
    except IobundleError as exc:
        case["rebuild_error"] = type(exc).__name__
    # the bundle's tensors are views of one memory-mapped file: copy them out
    tensors = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, tensors)
    torch.save(tensors, job["tensors"])
    report["cases"][job["id"]] = case
json.dump(report, open(sys.argv[2], "w"))
"""


def _observe(observer: Any, case: Case, calls: Calls) -> Any:
    model = case.model()
    with observer(model):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict[str, Any]:
    """Capture every case here, replay every bundle in one fresh isolated process."""
    root = tmp_path_factory.mktemp("offline")
    jobs = []
    for case in CASES:
        observer = _observe(InputObserver(**case.observer_kwargs), case, case.calls)
        observer.save(root / f"{case.id}.iobundle")
        jobs.append(
            {
                "id": case.id,
                "bundle": str(root / f"{case.id}.iobundle"),
                "batch": case.batch,
                "tensors": str(root / f"{case.id}.pt"),
            }
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    script = root / "replay.py"
    script.write_text(
        _REPLAY.format(encode=textwrap.dedent(inspect.getsource(encode_dynamic_shapes)), test_module=__name__)
    )
    work = root / "cwd"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(root / "jobs.json"), str(root / "report.json")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((root / "report.json").read_text())
    for case in CASES:
        report["cases"][case.id]["tensors"] = torch.load(root / f"{case.id}.pt", weights_only=True)
    return report


def test_replaying_process_cannot_import_the_models(replayed: dict[str, Any]) -> None:
    assert __name__ not in ("__main__", "")
    assert replayed["test_module_importable"] is False


def assert_same(ours: Any, ref: Any, path: str) -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{path}: {type(ours).__name__} instead of a tensor"
        assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype), (
            f"{path}: {ours.shape}/{ours.dtype} != {ref.shape}/{ref.dtype}"
        )
        assert torch.equal(ours, ref), f"{path}: values differ"
        return
    assert type(ours) is type(ref), f"{path}: {type(ours).__name__} != {type(ref).__name__}"
    if isinstance(ref, dict):
        assert list(ours) == list(ref), f"{path}: keys {list(ours)} != {list(ref)}"
        for k in ref:
            assert_same(ours[k], ref[k], f"{path}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), f"{path}: length {len(ours)} != {len(ref)}"
        for i, (o, r) in enumerate(zip(ours, ref)):
            assert_same(o, r, f"{path}[{i}]")
    else:
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_offline_inference_equals_reference(case: Case, replayed: dict[str, Any]) -> None:
    ref = _observe(ReferenceObserver(**case.observer_kwargs), case, case.expected_calls or case.calls)
    got = replayed["cases"][case.id]
    assert got["num_obs"] == ref.num_obs()
    assert got["dynamic_shapes"] == encode_dynamic_shapes(ref.infer_dynamic_shapes(_batch(case.batch)))
    tensors = got["tensors"]
    assert_same(tensors["flat"], ref.infer_arguments(flat=True), "infer_arguments(flat=True)")
    for i, flat in enumerate(tensors["flat_by_index"]):
        assert_same(flat, ref.infer_arguments(i, flat=True), f"infer_arguments({i}, flat=True)")
    if case.user_class:
        # KeyValue is unknown there: shapes and flat tensors work, rebuilding the object is refused.
        assert got["rebuild_error"] == "UnsafeBundleError"
    else:
        assert got["rebuild_error"] is None
        assert_same(tensors["as_args_kwargs"], ref.infer_arguments(as_args_kwargs=True), "as_args_kwargs")


def test_user_class_dynamic_shapes_offline(replayed: dict[str, Any]) -> None:
    dyn = repr(torch.export.Dim.DYNAMIC)
    assert replayed["cases"]["user_pytree_class"]["dynamic_shapes"] == {
        "tuple": [
            {"dict": [[0, {"dim": dyn}]]},
            {"list": [{"dict": [[1, {"dim": dyn}]]}, {"dict": [[1, {"dim": dyn}]]}]},
        ]
    }
