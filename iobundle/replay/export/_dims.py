"""Dimensions beyond what the calls show: the exported program on a batch size no call had.

A dimension is dynamic when its size varied across the recorded calls; one that never varied is
exported static (``iobundle.replay.infer.static_dim_hints`` names those that look like a batch or
a sequence). :func:`check_other_batch` runs an exported program whose batch is dynamic on a
recorded call cut (or repeated) to another batch size and compares it with the eager model and
the recorded outputs.

When the program refuses those inputs on a guard (``Guard failed: EXPR``), :func:`explain_guard`
says what it assumes, and the export tries the remedies of :data:`GUARD_REMEDIES` in turn: each
re-exports the program with one tracing setting changed and keeps the new program only when it
reproduces every recorded call and passes the same check (``BatchCheck.remedy``); when none
does, the first program is kept and the check stays failed, with what was tried
(``BatchCheck.tried``).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
import torch

from iobundle.calls import RecordedCalls, ReplayAutocast, tensor_keys
from iobundle.errors import AlignmentError
from iobundle.replay.check import compare_outputs, flatten_outputs, output_paths
from iobundle.replay.infer import (
    Alignment,
    BatchSpec,
    align_calls,
    batch_axes,
    derive_dims,
    find_batch_axes,
    flat_dynamic_dims,
    infer_arguments,
    owner_name,
    placeholder_inputs,
    received_arguments,
)
from iobundle.schema import SizeCondition

__all__ = [
    "GUARD_REMEDIES",
    "BatchCheck",
    "GuardRemedy",
    "check_other_batch",
    "cut_call",
    "cut_plan",
    "derived_dims",
    "explain_guard",
    "program_batch_axes",
    "split_rule",
]

logger = logging.getLogger(__name__)


@dataclass
class BatchCheck:
    """The exported program on a batch size no call had: a recorded call cut (or repeated) along dimension 0.

    Attributes:
        call: The recorded call the inputs come from.
        recorded_batch: Its batch size.
        batch: The batch size fed to the program.
        success: Whether the program agrees with the eager model on those inputs within tolerance;
            None when the eager model itself rejects the resized inputs (the check says nothing then).
        abs_eager: Max abs difference between the program and the eager model on these inputs.
        abs_recorded: Max abs difference between the program and the recorded outputs cut the same way
            (informative: a cut recorded output is not always what the model returns for the cut inputs).
        rows_differ: When the eager model on the cut inputs is itself beyond tolerance of the recorded
            outputs cut the same way: its max abs difference from them (the summary says so). The
            cut keeps every state a cache holds, so this is the model's own dependence on the other
            rows of its batch, a recorded output that is not per row, or the stand-ins of ``stand_ins``;
            None when they agree.
        rows_differ_at: The first output (its path in the output tree) beyond tolerance there.
        stand_ins: Inputs of the traced call that were absent at capture and are fed a stand-in
            (zeros, an empty tensor) to both runs: the model never saw those values, so the recorded
            rows are not what it returns for them.
        error: Why the check could not run, if it failed to.
        assumption: When a program refused the inputs on a guard: what it assumes, in words
            (see :func:`explain_guard`); kept when a remedy then served them.
        refused: When a remedy served the inputs: how the first program refused them.
        remedy: The name of the remedy (:data:`GUARD_REMEDIES`) whose re-export serves the
            inputs; None when the first program did, or when nothing did.
        tried: Each remedy tried and its outcome, in order (``"layout_copies_every_rank: served"``),
            then the second program when no remedy served them.
        split: When no remedy served the inputs but a second program traced from them does: the
            size rule of each program, ``{"first": [...], "second": [...]}`` (conditions as the
            program index stores them, :class:`iobundle.schema.SizeCondition`).
    """

    call: int
    recorded_batch: int
    batch: int
    success: bool | None = False
    abs_eager: float | None = None
    abs_recorded: float | None = None
    rows_differ: float | None = None
    rows_differ_at: str | None = None
    stand_ins: list[str] = field(default_factory=list)
    error: str | None = None
    assumption: str | None = None
    refused: str | None = None
    remedy: str | None = None
    tried: list[str] = field(default_factory=list)
    split: dict[str, list[dict[str, Any]]] | None = None

    def summary(self) -> str:
        head = f"batch {self.batch} (call {self.call} cut from batch {self.recorded_batch}): "
        if self.error:
            verdict = "failed: " if self.success is False else ""
            found = f"; {self.assumption}" if self.assumption else ""
            text = f"{head}{verdict}{self.error}{found}"
            if self.tried:
                text += (
                    f"; re-exported with each remedy iobundle has ({'; '.join(self.tried)}): none serves it, "
                    "the first program is kept (it serves every recorded call, not this batch)"
                )
            return text
        parts = [f"max abs vs eager {self.abs_eager:.3g}" if self.abs_eager is not None else None]
        parts.append(f"vs recorded rows {self.abs_recorded:.3g}" if self.abs_recorded is not None else None)
        verdict = "ok" if self.success else "DIFFERS"
        detail = ", ".join(p for p in parts if p)
        text = f"{head}{verdict} ({detail})"
        if self.rows_differ is not None:
            why = (
                f"both runs are fed stand-ins for inputs absent at capture ({', '.join(self.stand_ins)}), "
                "values the model never saw"
                if self.stand_ins
                else "its output for a row depends on the other rows of the recorded batch, or that output is not per "
                "row (a counter, rows a cache shares)"
            )
            at = f" (first at {self.rows_differ_at})" if self.rows_differ_at else ""
            text += (
                f"; the eager model on these inputs differs from the recorded rows by {self.rows_differ:.3g}{at}: {why}"
            )
        if self.split is not None:
            first, second = (
                " and ".join(SizeCondition.model_validate(c).describe() for c in self.split[k])
                for k in ("first", "second")
            )
            text += (
                f"; served by a second program traced from these inputs ({second}; the first serves {first}): "
                f"the first program refused it ({self.refused}; {self.assumption})"
            )
        elif self.remedy:
            text += (
                f"; served by re-exporting with the remedy {self.remedy}: the first program refused it "
                f"({self.refused}; {self.assumption})"
            )
        return text


@dataclass(frozen=True)
class GuardRemedy:
    """A re-export the check beyond the recorded calls tries when a program refuses its inputs on a guard.

    Attributes:
        name: As reports list it (``BatchCheck.remedy``, ``ExportReport.options``).
        does: What the re-export changes, in words.
        context: Returns the context manager entered while tracing the re-export.
    """

    name: str
    does: str
    context: Callable[[], contextlib.AbstractContextManager[None]]


def _layout_copies_every_rank() -> contextlib.AbstractContextManager[None]:
    from iobundle.replay.export._patches import layout_copies_every_rank

    return layout_copies_every_rank()


GUARD_REMEDIES: tuple[GuardRemedy, ...] = (
    GuardRemedy(
        "layout_copies_every_rank",
        "reshapes of possibly non-contiguous tensors of rank 2 and more traced as copies, so that a "
        "view-or-copy decision on a size that was not 1 in the traced call (the tokens of a transposed "
        "(tokens, experts) tensor) is not a guard",
        _layout_copies_every_rank,
    ),
)
"""The remedies, tried in order (see :func:`iobundle.replay.export._patches.layout_copies_every_rank`).

Measured on the guard classes the zoo and the tests show (docs/llm.md, "Beyond the recorded
calls"): tracing from another recorded call moves the guard to other calls rather than
removing it, and ``backed_size_oblivious`` is already on wherever a size of 1 was traced, so
neither is a remedy; a branch of the model's own code on a size (``if batch * length == 1``)
is served by no re-export of one program.
"""


_GUARD = re.compile(r"Guard failed: (.+)")
_SIZE = re.compile(r"(\w+(?:\[[^\]]*\])*)\.size\(\)\[(\d+)\]")


def explain_guard(message: str, recorded: int) -> str | None:
    """What a program assumes when it rejects inputs with ``Guard failed: EXPR``, in words; None for another error.

    ``position_ids.size()[0] >= 2`` is a minimum bound: torch.export, tracing batch
    ``recorded`` size-obliviously, decided a branch or a memory-layout check as if the size
    could not be 0 or 1, and guards that. ``== N`` is a size specialised to what the trace saw;
    a relation between two sizes is a derived dimension the model's code ties together;
    ``!= 1`` on a size or a product of sizes (``batch * length``: a number of tokens) is a
    decision taken for a size that was not 1 when traced.
    """
    found = _GUARD.search(message)
    if found is None:
        return None
    expr = found.group(1).strip().rstrip(".")
    text = _SIZE.sub(lambda m: f"axis {m.group(2)} of {m.group(1)}", expr)
    sizes = _SIZE.findall(expr)
    if re.search(r"!=\s*1$", expr):
        what = "size" if len(sizes) == 1 else "product of sizes (a number of elements, such as batch x length tokens)"
        kind = (
            f"a {what} that was not 1 in the traced call, assumed never to be 1: a branch, or a view-or-copy "
            "decision of a reshape, taken for the size the trace saw"
        )
    elif len(sizes) == 1 and re.search(r"(>=|>)\s*\d+$", expr):
        kind = (
            f"a minimum bound torch.export added while tracing batch {recorded} (a size-oblivious choice in the "
            "model's code: a branch, a reshape or a copy into a slice); a patch of iobundle.replay.export that "
            "rewrites that code removes it (latent_keys_concat for multi-head latent attention)"
        )
    elif len(sizes) == 1 and re.search(r"==\s*\d+$", expr):
        kind = "a size specialised to the one traced (the model's code uses it as a constant)"
    else:
        kind = "a relation between sizes the model's code derives (a derived dimension)"
    return f"the program assumes {text}: {kind}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _resize(t: torch.Tensor, batch: int, axis: int = 0) -> torch.Tensor:
    """``t`` with ``batch`` rows along ``axis``: its first rows, or its rows repeated."""
    if batch <= t.shape[axis]:
        return t.narrow(axis, 0, batch).clone()
    reps = [1] * t.dim()
    reps[axis] = -(-batch // t.shape[axis])
    return t.repeat(*reps).narrow(axis, 0, batch).clone()


def program_batch_axes(rc: RecordedCalls, alignment: Alignment, batch: BatchSpec) -> list[int | None]:
    """Per slot, its batch axis: the one ``batch`` makes dynamic, else the one found from the sizes, or None."""
    forced = batch_axes(rc, alignment, batch)
    return [
        (chosen if chosen is not None else found).axis for chosen, found in zip(forced, find_batch_axes(rc, alignment))
    ]


def check_other_batch(
    rc: RecordedCalls, plan: _Plan, ep: torch.export.ExportedProgram, *, atol: float, rtol: float
) -> BatchCheck:
    """Run ``ep`` and the eager model on the traced call cut to batch B - 1 (or repeated to 2 when B is 1).

    Only tensors whose batch axis (see :func:`program_batch_axes`) is dynamic and equal to the
    call's batch are resized, along that axis; each run gets its own copies, since a model may
    update its inputs in place. The
    program's outputs are compared with the eager model's on the same inputs (the verdict), and
    with the recorded outputs resized the same way (reported, not judged).
    The eager model runs first: when it rejects the resized inputs (a VLM prefill whose image
    features are flattened across the batch), the check is inconclusive (``success=None``).
    Never raises: a failure is reported on the result.
    """
    result, arguments = _cut_call(rc, plan)
    call = plan.alignment.calls[plan.traced]
    result.stand_ins = [str(i) for i in placeholder_inputs(plan.alignment, call, plan.alignment.slots[plan.traced])]
    recorded = result.recorded_batch
    try:
        args, kwargs = arguments()
        with torch.no_grad():
            try:
                eager = flatten_outputs(plan.module(*args, **kwargs))
            except Exception as exc:  # the cut is not a valid input (image features flattened across the batch)
                result.success = None
                result.error = f"inconclusive: the eager model rejects the resized inputs too ({_first_line(exc)})"
                logger.info("beyond the recorded calls: %s", result.summary())
                return result
            args, kwargs = arguments()
            obtained = flatten_outputs(ep.module()(*args, **kwargs))
        cmp = compare_outputs(eager, obtained, atol=atol, rtol=rtol)
        result.abs_eager, result.success = cmp.abs, bool(cmp.success)
        if cmp.error:
            result.error = cmp.error
        if call.outputs:
            expected = [rc.store.get(k) for k in tensor_keys(call.outputs)]
            expected = [_resize(t, result.batch) if t.dim() and t.shape[0] == recorded else t for t in expected]
            # Informative only: cutting every recorded output with a batch-sized dimension 0 is not
            # always what the model would return (a static cache's rows), the eager model is.
            result.abs_recorded = compare_outputs(expected, obtained, atol=atol, rtol=rtol).abs
            rows = compare_outputs(expected, eager, atol=atol, rtol=rtol)
            if not rows.success:
                result.rows_differ = rows.abs
                names = output_paths(call.outputs)
                result.rows_differ_at = next(
                    (
                        name
                        for name, e, o in zip(names, expected, eager)
                        if not compare_outputs([e], [o], atol=atol, rtol=rtol).success
                    ),
                    None,
                )
    except Exception as exc:  # a report, never a crash: the recorded calls already passed
        result.success, result.error = False, _first_line(exc)
        result.assumption = explain_guard(str(exc), recorded)
    logger.info("beyond the recorded calls: %s", result.summary())
    return result


def cut_call(
    rc: RecordedCalls, index: int, batch: int, *, set_batch_dimension_for: BatchSpec = True
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments recorded call ``index`` received, cut (or repeated) to ``batch`` rows, as the check beyond the calls cuts them.

    Each input whose batch axis (see :func:`program_batch_axes`, with ``set_batch_dimension_for``
    as the export takes it) is dynamic and equal to the call's batch keeps its first ``batch``
    rows along that axis (or its rows repeated), caches included: their layers are rebuilt
    from the cut tensors, and a sliding layer's count of tokens seen from the cut attention
    mask (:func:`iobundle.calls.restore_token_counts`). Other inputs are left whole. The
    arguments have the call's own structure: what it did not receive (an absent input, a None
    at any depth, a ``value_if_missing`` placeholder) stays so, where a program's inputs would
    hold a stand-in: these are arguments for the eager model. Returns fresh ``(args, kwargs)``
    for the model's observed method (``**kwargs`` not spread).

    Raises:
        AlignmentError: ``index`` is not a recorded call's.
    """
    alignment = align_calls(rc)
    if not -len(alignment.calls) <= index < len(alignment.calls):
        raise AlignmentError(f"No recorded call {index}: there are {len(alignment.calls)} successful calls.")
    dims = flat_dynamic_dims(rc, alignment, set_batch_dimension_for)
    axes = program_batch_axes(rc, alignment, set_batch_dimension_for)
    _, _, tensors = _cut_tensors(rc, alignment, index, dims, axes, batch=batch)
    cut = {key: t for key, t in zip(alignment.slots[index], tensors) if key is not None}
    args, kwargs = received_arguments(rc, alignment.calls[index], replace=cut)  # the call's own tree: no stand-ins
    return tuple(args), kwargs


def _cut_call(
    rc: RecordedCalls, plan: _Plan
) -> tuple[BatchCheck, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The check's empty result and a function returning fresh arguments of the traced call cut to its batch.

    A batch B is cut to B - 1 rows, or repeated to 2 when B is 1.
    """
    alignment = plan.alignment
    recorded, batch, tensors = _cut_tensors(rc, alignment, plan.traced, plan.dims, plan.batch_axes)
    keys = [f"\x02{i}" for i in range(len(tensors))]
    resized = dict(zip(keys, tensors))

    def arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
        # Fresh copies for each run: a model may update its inputs in place (a state-space
        # cache's convolution and recurrent states), which must not reach the other run.
        fresh = {k: t.clone() for k, t in resized.items()}
        args, kwargs = infer_arguments(rc, alignment=alignment, slots=list(keys), extra=fresh, as_args_kwargs=True)
        if plan.flatten_var_kw and rc.var_keyword and rc.var_keyword in kwargs:
            kwargs = {**{k: v for k, v in kwargs.items() if k != rc.var_keyword}, **kwargs[rc.var_keyword]}
        return args, kwargs

    return BatchCheck(call=alignment.calls[plan.traced].index, recorded_batch=recorded, batch=batch), arguments


def _cut_tensors(
    rc: RecordedCalls,
    alignment: Alignment,
    index: int,
    dims: list[list[int]],
    batch_axes: list[int | None],
    *,
    batch: int | None = None,
) -> tuple[int, int, list[torch.Tensor]]:
    """Call ``index``'s batch B, the batch it is cut to, and its aligned tensors so cut (stand-ins included)."""
    tensors = infer_arguments(rc, index, flat=True, alignment=alignment)
    axes = [a if a is not None and a in d and a < t.dim() else None for t, d, a in zip(tensors, dims, batch_axes)]
    sizes = collections.Counter(t.shape[a] for t, a in zip(tensors, axes) if a is not None)
    recorded = sizes.most_common(1)[0][0] if sizes else 0
    if batch is None:
        batch = recorded - 1 if recorded > 1 else 2
    resized = [_resize(t, batch, a) if a is not None and t.shape[a] == recorded else t for t, a in zip(tensors, axes)]
    return recorded, batch, resized


def cut_plan(rc: RecordedCalls, plan: _Plan) -> _Plan:
    """``plan`` traced from the inputs :func:`check_other_batch` feeds: the traced call cut to the other batch.

    Its arguments are the model's (``**kwargs`` already spread when ``plan`` spreads them).
    """
    _, arguments = _cut_call(rc, plan)
    args, kwargs = arguments()
    return dataclasses.replace(plan, args=args, kwargs=kwargs)


_Op = Literal["==", "!=", "<", "<=", ">", ">="]
_FLIPPED: dict[_Op, _Op] = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}
_COMPARISONS: dict[type, _Op] = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_NEGATION: dict[str, tuple[_Op, _Op]] = {
    "==": ("==", "!="), "!=": ("!=", "=="), "<": ("<", ">="), ">=": (">=", "<"), ">": (">", "<="), "<=": ("<=", ">"),
}  # fmt: skip
"""Each comparison a guard may make: itself and its negation."""


def guard_sources(rc: RecordedCalls, plan: _Plan) -> dict[str, tuple[str, int | None]]:
    """How a guard names the traced call's tensors (``h``, ``cache['key_0']``): per name, the input and,
    for an input holding several tensors, the tensor's position among them (a size rule's ``item``).

    The names are those torch.export gives its inputs: the argument's name, then the key path of
    the tensor inside it (under the pytree registrations of :func:`export_context`). An input
    whose tensors do not line up with its slots of the alignment gets no nested names.
    """
    from torch.utils import _pytree as pytree

    slots = collections.Counter(plan.alignment.owners)
    kwargs = plan.kwargs
    if plan.flatten_var_kw and rc.var_keyword in kwargs:
        kwargs = {**kwargs, **kwargs[rc.var_keyword]}
    sources: dict[str, tuple[str, int | None]] = {}
    for owner, count in slots.items():
        name = owner_name(rc, owner)
        if name in kwargs:
            value = kwargs[name]
        elif isinstance(owner, int) and owner < len(plan.args):
            value = plan.args[owner]
        else:
            continue
        if count == 1:
            sources[name] = (name, None)
            continue
        leaves = [path for path, leaf in pytree.tree_flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)]
        if len(leaves) == count:
            sources.update({f"{name}{pytree.keystr(path)}": (name, i) for i, path in enumerate(leaves)})
    return sources


def split_rule(
    message: str, sources: Mapping[str, tuple[str, int | None]]
) -> tuple[SizeCondition, SizeCondition] | str:
    """The guard of ``Guard failed: EXPR`` as two size conditions: the one the program holds, and its negation.

    A guard has one when it compares arithmetic (``+ - * // %``, whole numbers) of sizes of tensors ``sources``
    names (:func:`guard_sources`) with a number or other such arithmetic. A product of sizes (each maybe ``//
    k``) plus a number compared with a number keeps its plain form (``1 + cache['key_0'].size()[2] >= 3``:
    ``axis 2 of cache (tensor 0) >= 2``); any other is an ``expr`` (``x.size()[3] == x.size()[2]``: ``s0 - s1
    == 0``; ``(8 + -1 * (x.size()[2] % 8)) % 8 == 0``). Otherwise the reason it has none, in words.
    """
    found = _GUARD.search(message)
    if found is None:
        return "the program refused them on no guard"
    expr = found.group(1).strip().rstrip(".")
    of: list[tuple[str, int] | tuple[str, int, int]] = []
    unknown: list[str] = []

    def name(size: re.Match[str]) -> str:
        if size.group(1) not in sources:
            unknown.append(size.group(0))
            return "s"
        source, item = sources[size.group(1)]
        term = (source, int(size.group(2))) if item is None else (source, int(size.group(2)), item)
        of.extend([] if term in of else [term])
        return f"s{of.index(term)}"

    try:
        tree = ast.parse(_SIZE.sub(name, expr), mode="eval").body
    except SyntaxError:
        tree = None
    if unknown:
        return f"the guard {expr} names {unknown[0]!r}, not a size of a tensor the program takes"
    if not isinstance(tree, ast.Compare) or len(tree.ops) != 1 or type(tree.ops[0]) not in _COMPARISONS or not of:
        return f"the guard {expr} does not compare sizes"
    left, right, op = tree.left, tree.comparators[0], _COMPARISONS[type(tree.ops[0])]
    if isinstance(left, ast.Constant):  # 0 == s0 % 4 reads s0 % 4 == 0
        left, right, op = right, left, _FLIPPED.get(op, op)
    value = _whole(right)
    if value is None:
        left, value = ast.BinOp(left, ast.Sub(), right), 0
    addends = _chain(left, ast.Add)
    constant = sum(_whole(a) or 0 for a in addends)
    sizes = [a for a in addends if _whole(a) is None]
    factors = [_factor(f) for f in _chain(sizes[0], ast.Mult)] if len(sizes) == 1 else [None]
    plain = [f for f in factors if f is not None]
    rule: dict[str, Any] = dict(of=of, value=value, expr=ast.unparse(left))
    if len(plain) == len(factors) and value >= constant:  # a product of sizes plus a number: the plain form
        div = [d for _, d in plain]
        rule = dict(of=[of[i] for i, _ in plain], value=value - constant, div=div if max(div) > 1 else None)
    holds, negated = _NEGATION[op]
    try:
        return SizeCondition(op=holds, **rule), SizeCondition(op=negated, **rule)
    except pydantic.ValidationError:
        return f"the guard {expr} uses what a size rule has not (only + - * // % of sizes and whole numbers)"


def _chain(node: ast.expr, op: type) -> list[ast.expr]:
    """The operands of ``a op b op c ...`` (``node`` alone when it is no such operation)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, op):
        return [*_chain(node.left, op), *_chain(node.right, op)]
    return [node]


def _factor(node: ast.expr) -> tuple[int, int] | None:
    """A size ``s3`` or ``s3 // 14`` as its position and divisor (``(3, 14)``); None for anything else."""
    size, divisor = node, 1
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
        size, divisor = node.left, _whole(node.right) or 0
    if isinstance(size, ast.Name) and re.fullmatch(r"s\d+", size.id) and divisor >= 1:
        return int(size.id[1:]), divisor
    return None


def _whole(node: ast.expr) -> int | None:
    """The whole number ``node`` is, or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    return None


def derived_dims(rc: RecordedCalls, plan: _Plan, message: str) -> dict[str, tuple[str | None, int, int]]:
    """When torch.export refused ``plan``'s named dimensions (``Constraints violated (H, W)``): the derived
    dimensions (:func:`iobundle.replay.infer.derive_dims`) of the names it found constraints on, inferred
    from the sizes each name had in the recorded calls; empty when there are none (or no names)."""
    found = re.search(r"Constraints violated \(([^)]*)\)", message)
    if found is None or plan.dim_names is None:
        return {}
    violated = {v.strip() for v in found.group(1).split(",")}
    sizes: dict[str, list[int | None]] = {}
    for position, slots in enumerate(plan.alignment.slots):
        for key, names in zip(slots, plan.dim_names):
            if key is None:
                continue
            for axis, name in names.items():
                row = sizes.setdefault(name, [None] * len(plan.alignment.slots))
                row[position] = int(rc.store.shape(key)[axis]) if row[position] is None else row[position]
    return derive_dims(sizes, {n for n in sizes if re.sub(r"\W", "_", n) in violated})


@dataclass
class _Plan:
    """What one export runs: the module, the traced call's arguments, its dynamic shapes and dims."""

    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dynamic_shapes: Any
    alignment: Alignment
    traced: int
    flatten_var_kw: bool
    oblivious: bool
    dynamic_batch: bool = False
    dynamic: bool = True
    dims: list[list[int]] = field(default_factory=list)
    dim_names: list[dict[int, str]] | None = None  # per slot, with dim_names
    batch_axes: list[int | None] = field(default_factory=list)  # per slot, see program_batch_axes
    autocast: ReplayAutocast | None = None  # the torch.autocast ``module`` runs under (the traced call's)
