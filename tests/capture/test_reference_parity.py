"""Parity with ``torch.onnx.InputObserver``: same calls, same inferred arguments and dynamic shapes.

Each case runs the same model calls under the reference observer and under ours, then
compares ``infer_dynamic_shapes`` and ``infer_arguments`` (default, ``flat=True``, by
index, ``as_args_kwargs=True``), in memory and after ``save()`` -> ``load_bundle()``.

Where the reference is known to fail on a call pattern, the case gives ``expected_calls``:
the same calls rewritten in a form the reference handles (for example every argument passed
the same way). Ours must work on the original calls and give the reference's result on the
rewritten ones. ``ref_defect`` says what the reference does wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch.onnx import InputObserver as ReferenceObserver

from iobundle import AlignmentError, InputObserver, load_bundle

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]

_GEN = torch.Generator().manual_seed(0)
DYN = torch.export.Dim.DYNAMIC


def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A small tensor with distinct values (so value comparisons mean something)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_GEN, dtype=dtype)
    return torch.randint(0, 100, shape, generator=_GEN, dtype=dtype)


# --------------------------------------------------------------------------- a user pytree class


class KeyValue:
    """A cache-like class registered as a pytree node with a JSON-able context."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key = key
        self.value = value


torch_pytree.register_pytree_node(
    KeyValue,
    lambda kv: ([kv.key, kv.value], ["key", "value"]),
    lambda children, context: KeyValue(**dict(zip(context, children))),
    serialized_type_name=f"{__name__}.KeyValue",
)


# --------------------------------------------------------------------------- models


class TwoInputs(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Flags(torch.nn.Module):
    def forward(self, x, flag: bool = False, n: int = 1):
        return x * n if flag else x + n


class OptionalMask(torch.nn.Module):
    def forward(self, x, mask=None):
        return x if mask is None or mask.numel() == 0 else x * mask


class ThreeOptional(torch.nn.Module):
    def forward(self, x, mask=None, bias=None):
        x = x if mask is None else x * mask
        return x if bias is None else x + bias


class Nested(torch.nn.Module):
    def forward(self, x, extra):
        return x + extra["pair"][0] + extra["pair"][1].sum() + extra["scale"].sum()


class NestedBias(torch.nn.Module):
    def forward(self, x, mask=None, bias=None):
        return x.sum() + bias["p"].sum() + bias["q"][0].sum()


class Nested2(torch.nn.Module):
    def forward(self, x, extra):
        return x + extra["p"] + extra["q"].sum()


class Prefill(torch.nn.Module):
    """pixel_values at prefill only, past afterwards (a vision-language generate loop)."""

    def forward(self, input_ids, pixel_values=None, past=None):
        out = input_ids.float().sum()
        if pixel_values is not None:
            out = out + pixel_values.sum()
        return out if past is None else out + past.sum()


class VarKeyword(torch.nn.Module):
    def forward(self, x, **kwargs):
        return x + sum(kwargs.values())


class VarPositional(torch.nn.Module):
    def forward(self, a, *args, **kwargs):
        return a + sum(args) + sum(kwargs.values())


class WithCache(torch.nn.Module):
    def forward(self, x, cache):
        return x.sum() + cache.key.sum() + cache.value.sum()


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One call pattern.

    Attributes:
        id: Test id.
        model: The model class.
        calls: The calls made under both observers.
        observer_kwargs: Arguments of both observers' constructors.
        batch: ``set_batch_dimension_for`` given to ``infer_dynamic_shapes``.
        expected_calls: Calls the reference handles and that mean the same as ``calls``;
            the reference runs on these when it is known to fail on ``calls``.
        expected_observer_kwargs: The reference's constructor arguments with ``expected_calls``.
        ref_defect: What the reference does wrong on ``calls`` (None when it gets them right).
        new_inputs: Inputs given to ``infer_arguments(new_inputs)`` (a tuple or a dict).
    """

    id: str
    model: Callable[[], torch.nn.Module]
    calls: Calls
    observer_kwargs: dict[str, Any] = field(default_factory=dict)
    batch: Any = None
    expected_calls: Calls | None = None
    expected_observer_kwargs: dict[str, Any] | None = None
    ref_defect: str | None = None
    new_inputs: tuple[Any, ...] | dict[str, Any] | None = None


def _cases() -> list[Case]:
    x1, y1, x2, y2, x3, y3 = t(2, 3), t(2, 3), t(3, 3), t(3, 3), t(4, 3), t(4, 3)
    m2, m3 = t(3, 3), t(4, 3)
    b1, b2 = t(2, 3), t(3, 3)
    pix = t(1, 3, 4, 4)
    ids1, ids2, ids3 = t(1, 5, dtype=torch.int64), t(1, 1, dtype=torch.int64), t(1, 1, dtype=torch.int64)
    past2, past3 = t(1, 5), t(1, 6)
    missing_pix = torch.empty((0, 3, 4, 4))
    missing_mask = torch.empty((0, 3))
    return [
        Case("positional", TwoInputs, [((x1, y1), {}), ((x2, y2), {})], new_inputs=(x3, y3)),
        Case("keyword", TwoInputs, [((), {"x": x1, "y": y1}), ((), {"x": x2, "y": y2})], new_inputs={"x": x3, "y": y3}),
        Case("bool_constant", Flags, [((x1,), {"flag": True}), ((x2,), {"flag": True})]),
        Case("int_constant", Flags, [((x1,), {"n": 3}), ((x2,), {"n": 3})]),
        Case("positional_and_keyword", OptionalMask, [((x1,), {"mask": y1}), ((x2,), {"mask": y2})]),
        Case("optional_positional_absent_first", OptionalMask, [((x1,), {}), ((x2, m2), {}), ((x3, m3), {})]),
        Case(
            "optional_keyword_absent_first", OptionalMask, [((x1,), {}), ((x2,), {"mask": m2}), ((x3,), {"mask": m3})]
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
            ThreeOptional,
            [((x1,), {"bias": b1, "mask": y1}), ((x2,), {"mask": y2, "bias": b2})],
        ),
        Case(
            "keyword_then_positional",
            OptionalMask,
            [((x1,), {"mask": y1}), ((x2, y2), {})],
        ),
        Case(
            "positional_then_keyword",
            OptionalMask,
            [((x1, y1), {}), ((x2,), {"mask": y2})],
            expected_calls=[((x1, y1), {}), ((x2, y2), {})],
            ref_defect="RuntimeError: at least one call must contain all the named arguments",
        ),
        Case(
            "positional_none_where_another_call_has_a_tensor",
            ThreeOptional,
            [((x1, None), {"bias": b1}), ((x2, m2), {"bias": b2})],
        ),
        Case(
            "positional_none_beyond_the_best_call",
            ThreeOptional,
            [((x1,), {"mask": y1, "bias": b1}), ((x2, None, b2), {})],
        ),
        Case("batch_by_name", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch={"x"}),
        Case("batch_by_position", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch={1}),
        Case("batch_true", TwoInputs, [((t(2, 4), t(2, 4)), {}), ((t(2, 5), t(2, 5)), {})], batch=True),
        Case(
            "value_if_missing_by_name",
            Prefill,
            [((ids1,), {"pixel_values": pix}), ((ids2,), {"past": past2}), ((ids3,), {"past": past3})],
            observer_kwargs={"value_if_missing": {"pixel_values": missing_pix}},
        ),
        Case(
            "value_if_missing_by_position",
            OptionalMask,
            [((x1, y1), {}), ((x2,), {}), ((x3,), {})],
            observer_kwargs={"value_if_missing": {1: missing_mask}},
            expected_calls=[((x1, y1), {}), ((x2, missing_mask), {}), ((x3, missing_mask), {})],
            expected_observer_kwargs={},
            ref_defect="NotImplementedError when the position is not passed (and it overwrites it when it is)",
        ),
        Case(
            "var_keyword",
            VarKeyword,
            [((x1,), {"a": y1, "b": b1}), ((x2,), {"b": b2, "a": y2})],
        ),
        Case(
            "var_positional_and_keyword",
            VarPositional,
            [((x1, y1), {"c": b1}), ((x2, y2), {"c": b2})],
        ),
        Case(
            "user_pytree_class",
            WithCache,
            [((x1, KeyValue(t(1, 2, 4), t(1, 2, 4))), {}), ((x2, KeyValue(t(1, 3, 4), t(1, 3, 4))), {})],
        ),
        Case(
            "user_pytree_class_keyword",
            WithCache,
            [
                ((x1,), {"cache": KeyValue(t(1, 2, 4), t(1, 2, 4))}),
                ((x2,), {"cache": KeyValue(t(1, 3, 4), t(1, 3, 4))}),
            ],
        ),
    ]


CASES = _cases()


# --------------------------------------------------------------------------- running and comparing


@dataclass(frozen=True)
class Raised:
    """Stands for a query that raised, so that results can be compared as data."""

    error: BaseException


def observe(observer: Any, model: torch.nn.Module, calls: Calls) -> Any:
    with observer(model):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


def queries(observer: Any, case: Case) -> dict[str, Any]:
    """Every inference result compared, by name; a query that raises gives :class:`Raised`."""
    todo: dict[str, Callable[[], Any]] = {
        "infer_dynamic_shapes": lambda: observer.infer_dynamic_shapes(case.batch),
        "infer_arguments()": lambda: observer.infer_arguments(),
        "infer_arguments(flat=True)": lambda: observer.infer_arguments(flat=True),
        "infer_arguments(as_args_kwargs=True)": lambda: observer.infer_arguments(as_args_kwargs=True),
    }
    for i in range(observer.num_obs()):
        todo[f"infer_arguments({i})"] = lambda i=i: observer.infer_arguments(i)
        todo[f"infer_arguments({i}, flat=True)"] = lambda i=i: observer.infer_arguments(i, flat=True)
        todo[f"infer_arguments({i}, as_args_kwargs=True)"] = lambda i=i: observer.infer_arguments(
            i, as_args_kwargs=True
        )
    results: dict[str, Any] = {}
    for name, query in todo.items():
        try:
            results[name] = query()
        except Exception as exc:
            results[name] = Raised(exc)
    return results


def assert_same(ours: Any, ref: Any, path: str = "result") -> None:
    """Assert ``ours`` equals ``ref``: same containers, keys in the same order, equal tensors."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{path}: {type(ours).__name__} instead of a tensor"
        assert ours.shape == ref.shape, f"{path}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
        assert ours.dtype == ref.dtype, f"{path}: dtype {ours.dtype} != {ref.dtype}"
        assert torch.equal(ours, ref), f"{path}: values differ"
        return
    assert type(ours) is type(ref), f"{path}: {type(ours).__name__} != {type(ref).__name__} ({ours!r} vs {ref!r})"
    if isinstance(ref, dict):
        assert list(ours) == list(ref), f"{path}: keys {list(ours)} != {list(ref)}"
        for k in ref:
            assert_same(ours[k], ref[k], f"{path}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), f"{path}: length {len(ours)} != {len(ref)}"
        for i, (o, r) in enumerate(zip(ours, ref)):
            assert_same(o, r, f"{path}[{i}]")
    elif type(ref) in torch_pytree.SUPPORTED_NODES:
        node = torch_pytree.SUPPORTED_NODES[type(ref)]
        (ours_children, ours_context), (ref_children, ref_context) = node.flatten_fn(ours), node.flatten_fn(ref)
        assert ours_context == ref_context, f"{path}: context {ours_context!r} != {ref_context!r}"
        assert_same(list(ours_children), list(ref_children), f"{path}.children")
    else:
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"


def assert_same_results(ours: dict[str, Any], ref: dict[str, Any]) -> None:
    assert list(ours) == list(ref)
    for name in ref:
        if isinstance(ref[name], Raised):
            assert isinstance(ours[name], Raised), f"{name}: the reference raises {ref[name].error!r}, ours returns"
            assert isinstance(ours[name].error, AlignmentError), f"{name}: {ours[name].error!r}"
            continue
        assert not isinstance(ours[name], Raised), f"{name} raised {ours[name].error!r}"
        assert_same(ours[name], ref[name], name)


def reference_results(case: Case) -> dict[str, Any]:
    """What the reference infers for ``case`` (on ``expected_calls`` where it fails on ``calls``)."""
    if case.expected_calls is None:
        return queries(observe(ReferenceObserver(**case.observer_kwargs), case.model(), case.calls), case)
    kwargs = case.observer_kwargs if case.expected_observer_kwargs is None else case.expected_observer_kwargs
    return queries(observe(ReferenceObserver(**kwargs), case.model(), case.expected_calls), case)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_results_as_reference(case: Case) -> None:
    ours = observe(InputObserver(**case.observer_kwargs), case.model(), case.calls)
    assert_same_results(queries(ours, case), reference_results(case))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_same_results_after_save_and_load(case: Case, tmp_path) -> None:
    ours = observe(InputObserver(**case.observer_kwargs), case.model(), case.calls)
    ours.save(tmp_path / "run.iobundle")
    bundle = load_bundle(tmp_path / "run.iobundle")
    assert bundle.num_obs() == ours.num_obs()
    assert_same_results(queries(bundle, case), reference_results(case))


@pytest.mark.parametrize("case", [c for c in CASES if c.ref_defect], ids=[c.id for c in CASES if c.ref_defect])
def test_reference_defect_still_present(case: Case) -> None:
    """The reference still fails on these calls; if it stops failing, compare with it directly."""
    try:
        observer = observe(ReferenceObserver(**case.observer_kwargs), case.model(), case.calls)
    except Exception:
        return  # it crashes the observed program itself
    assert any(isinstance(r, Raised) for r in queries(observer, case).values()), case.ref_defect


def test_reference_overwrites_a_passed_positional_with_value_if_missing() -> None:
    """Reference defect: value_if_missing={1: v} replaces argument 1 even when the call passes it."""
    x, mask, placeholder = t(2, 3), t(2, 3), torch.zeros((2, 3))
    ref = observe(ReferenceObserver(value_if_missing={1: placeholder}), OptionalMask(), [((x, mask), {})])
    assert torch.equal(ref.infer_arguments()[1], placeholder)
    ours = observe(InputObserver(value_if_missing={1: placeholder}), OptionalMask(), [((x, mask), {})])
    assert torch.equal(ours.infer_arguments()[1], mask)


def test_positional_then_keyword_gives_the_positional_layout() -> None:
    """Ours takes the first call with the most tensors as the layout: here the positional one."""
    x1, m1, x2, m2 = t(2, 3), t(2, 3), t(3, 4), t(3, 4)
    ours = observe(InputObserver(), OptionalMask(), [((x1, m1), {}), ((x2,), {"mask": m2})])
    dyn = torch.export.Dim.DYNAMIC
    assert ours.infer_dynamic_shapes() == ({0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    args = ours.infer_arguments(1)
    assert isinstance(args, tuple) and torch.equal(args[0], x2) and torch.equal(args[1], m2)


def test_reference_shifts_dynamic_shapes_after_a_positional_none() -> None:
    """Reference defect: a positional None in the best call drops that argument's shapes and shifts the next ones."""
    calls = [
        ((t(2, 3), None), {"bias": {"p": t(2, 1), "q": [t(1, 2)]}}),
        ((t(3, 3), t(3, 3)), {"bias": {"p": t(3, 1), "q": [t(1, 3)]}}),
    ]
    expected = {"x": {0: DYN}, "mask": {}, "bias": {"p": {0: DYN}, "q": [{1: DYN}]}}
    ref = observe(ReferenceObserver(), NestedBias(), calls)
    assert ref.infer_dynamic_shapes() == {"x": {0: DYN}, "mask": None, "bias": {"p": {}, "q": [{0: DYN}]}}
    ours = observe(InputObserver(), NestedBias(), calls)
    assert ours.infer_dynamic_shapes() == expected
    args = ours.infer_arguments()
    assert list(args) == ["x", "mask", "bias"] and torch.equal(args["mask"], torch.zeros(3, 3))


def test_reference_drops_a_positional_argument_the_best_call_lacks() -> None:
    """Reference defect: ``mask`` (positional in call 1 only) silently disappears; ours refuses and names it."""
    calls = [((t(2, 3),), {"bias": t(2, 3)}), ((t(3, 3), t(3, 3)), {})]
    ref = observe(ReferenceObserver(), ThreeOptional(), calls)
    assert ref.infer_dynamic_shapes() == {"x": {0: DYN}, "bias": {}}
    ours = observe(InputObserver(), ThreeOptional(), calls)
    with pytest.raises(AlignmentError, match="mask"):
        ours.infer_dynamic_shapes()


def test_reference_pairs_dict_entries_by_position() -> None:
    """Reference defect: dicts built in another order are aligned by position, not by key."""
    calls = [
        ((t(2, 3), {"p": t(2, 1), "q": t(5)}), {}),
        ((t(3, 3), {"q": t(6), "p": t(3, 1)}), {}),
    ]
    with pytest.raises(RuntimeError, match="same rank"):
        observe(ReferenceObserver(), Nested2(), calls).infer_dynamic_shapes()
    ours = observe(InputObserver(), Nested2(), calls)
    assert ours.infer_dynamic_shapes() == ({0: DYN}, {"p": {0: DYN}, "q": {0: DYN}})
    assert [tuple(a.shape) for a in ours.infer_arguments(1, flat=True)] == [(3, 3), (3, 1), (6,)]


NEW_INPUT_CASES = [c for c in CASES if c.new_inputs is not None]


@pytest.mark.parametrize("case", NEW_INPUT_CASES, ids=[c.id for c in NEW_INPUT_CASES])
def test_infer_arguments_from_new_inputs(case: Case) -> None:
    ref = observe(ReferenceObserver(**case.observer_kwargs), case.model(), case.calls)
    ours = observe(InputObserver(**case.observer_kwargs), case.model(), case.calls)
    for flat in (False, True):
        assert_same(ours.infer_arguments(case.new_inputs, flat=flat), ref.infer_arguments(case.new_inputs, flat=flat))
