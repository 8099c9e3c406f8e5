"""Export a model from recorded calls with ``torch.export``, checked on every call; split in two by a size rule
where a guard of the model's code refuses some calls or batch sizes."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from iobundle._progress import ProgressCallback
from iobundle.calls import RecordedCalls
from iobundle.errors import ExportError
from iobundle.replay.check import Tolerances
from iobundle.replay.export._call_checks import ExportReport, _check_calls, _refuse_unknown_tolerances
from iobundle.replay.export._dims import (
    GUARD_REMEDIES,
    BatchCheck,
    _first_line,
    _Plan,
    check_other_batch,
    cut_plan,
    guard_sources,
    split_rule,
)
from iobundle.replay.export._trace import _export, export_context
from iobundle.replay.infer import DimNamesSpec, DynamicSpec, call_sizes, call_structure, phase_calls
from iobundle.schema import SizeCondition, conditions_met

__all__ = ["ExportResult", "SplitProgram", "export_program"]

logger = logging.getLogger(__name__)


@dataclass
class ExportResult:
    """What :func:`export_program` returns: the program, its report and, when it was split, the other programs."""

    program: torch.export.ExportedProgram
    report: ExportReport
    splits: list[SplitProgram] = field(default_factory=list)
    """The other programs, for the sizes this one refuses on guards that are size rules (each with its rule)."""
    plan: Any = field(default=None, repr=False)
    """How the program was traced (the alignment, the traced call, the dims), which :func:`save_onnx` reads."""
    sizes: list[SizeCondition] = field(default_factory=list)
    """The sizes it serves (every condition holds; empty: any), set when a program is split."""

    @property
    def split(self) -> SplitProgram | None:
        """The first of ``splits`` (None when the program was not split)."""
        return self.splits[0] if self.splits else None


@dataclass(kw_only=True)
class SplitProgram(ExportResult):
    """A program of a split: traced from inputs the first refused on a guard, for the sizes its ``sizes`` hold.

    Those inputs are recorded calls (``calls``) or, when the first program served every recorded
    call, the check beyond them (a recorded call cut to another batch).

    It is among the first program's ``splits`` (:func:`export_program`'s result is the first);
    :func:`iobundle.replay.export.export_programs` writes them all, with a program index whose size
    rules (each program's ``sizes``: :class:`iobundle.schema.SizeCondition`) select between them.
    """

    calls: tuple[int, ...] = ()
    """The recorded calls it serves (exported and checked on them), when the first refused them on a
    guard; empty for a split for sizes beyond the recorded calls."""


def export_program(
    rc: RecordedCalls, model: torch.nn.Module, *, set_batch_dimension_for: Collection[int | str] | bool | None = None,
    strict: bool = False, check: bool = True, dynamic: DynamicSpec = None, check_batch: bool = True,
    dim_names: DimNamesSpec = False, on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
) -> ExportResult:  # fmt: skip
    """Export ``model`` with the inferred arguments and dynamic shapes, then run every recorded call through it.

    Returns the program and its report (``ExportReport``: traced call, options, one check per
    call); on failure the report is the raised error's ``.report``.

    Args:
        rc: The recorded calls.
        model: The model (its observed method is exported).
        set_batch_dimension_for: Inputs whose dim 0 is dynamic even if constant; True for all.
        strict: ``torch.export`` strict mode.
        check: Raise :class:`ExportError` when a call fails or differs beyond ``atol``/``rtol``.
        dynamic: Axes to make dynamic even if their size never varied, e.g. ``{"input_ids": {1}}``.
        check_batch: When the batch is dynamic, also run the program and ``model`` on a recorded
            call cut to another batch size and compare them (``report.batch_check``; never raises).
        dim_names: True or a dict to name the dynamic dimensions (see ``infer_dynamic_shapes``):
            each name becomes one ``torch.export.Dim`` shared by every dimension that bears it.
        on_progress: Called with a :class:`~iobundle.replay.ProgressEvent` when ``torch.export``
            starts and ends, and after each recorded call is checked.
        atol: The absolute tolerance of the check.
        rtol: The relative tolerance of the check.
        output_atol: Per-output absolute tolerances keyed by output name (its path in the output
            tree: ``logits``, ``past_key_values.0``) or ``fnmatch`` pattern, as validate takes them.
        output_rtol: Per-output relative tolerances, keyed like ``output_atol``.
        tolerances: The comparison of the check as one value (tolerances by dtype and per output),
            built by :meth:`~iobundle.replay.check.Tolerances.build`; when given, the four above are ignored.

    Raises:
        ExportError: ``torch.export`` failed, or (with ``check``) a recorded call is not reproduced.
        ToleranceError: A per-output tolerance names no recorded output (before anything is traced).
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
    if tolerances.per_output:
        _refuse_unknown_tolerances(rc, tolerances)
    return _export_checked(
        rc, model, set_batch_dimension_for=set_batch_dimension_for, strict=strict, check=check, dynamic=dynamic,
        check_batch=check_batch, dim_names=dim_names, on_progress=on_progress, tolerances=tolerances, split=True,
    )  # fmt: skip


def _export_checked(
    rc: RecordedCalls,
    model: torch.nn.Module,
    *,
    set_batch_dimension_for: Collection[int | str] | bool | None,
    strict: bool,
    check: bool,
    dynamic: DynamicSpec,
    check_batch: bool,
    dim_names: DimNamesSpec,
    on_progress: ProgressCallback | None,
    tolerances: Tolerances,
    split: bool,
) -> ExportResult:
    """:func:`export_program` after its argument checks; ``split``: the recorded calls may be split by a size rule."""
    tolerances = tolerances.for_calls(rc.ok_calls)  # the report names the calls under torch.autocast
    ep, plan, report = _export(
        rc, model, batch=set_batch_dimension_for, strict=strict, dynamic=dynamic, dim_names=dim_names,
        on_progress=on_progress,
    )  # fmt: skip
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        _check_calls(
            rc, plan, ep.module(), tolerances=tolerances, report=report, eager=plan.module, on_progress=on_progress
        )
    result = ExportResult(ep, report, plan=plan)
    if split and not report.ok:
        result.sizes, result.splits = _split_recorded_calls(
            rc, model, plan, report, set_batch_dimension_for=set_batch_dimension_for, strict=strict,
            dynamic=dynamic, check_batch=check_batch, dim_names=dim_names, tolerances=tolerances,
        )  # fmt: skip
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        if check_batch and plan.dynamic_batch and report.ok:
            report.batch_check = check_other_batch(rc, plan, ep, atol=tolerances.atol, rtol=tolerances.rtol)
    if report.batch_check is not None and report.batch_check.assumption is not None:
        result = _serve_refused_batch(
            rc, model, result, batch=set_batch_dimension_for, strict=strict, dynamic=dynamic,
            dim_names=dim_names, tolerances=tolerances,
        )  # fmt: skip
        report = result.report
    if check and not report.ok:
        bad = ", ".join(f"call {c.index}: {c.error or f'max abs error {c.abs:.3g}'}" for c in report.failures[:5])
        raise ExportError(
            f"The exported program does not reproduce every recorded call ({report.summary()}): {bad}", report=report
        )
    return result


def _split_recorded_calls(
    rc: RecordedCalls,
    model: torch.nn.Module,
    plan: _Plan,
    report: ExportReport,
    **options: Any,
) -> tuple[list[SizeCondition], list[SplitProgram]]:
    """The rule the program keeps and the other programs, for the recorded calls it refused on guards that are size rules.

    When every refused call has the structure of a reproduced one (sides of size rules, not phases), they
    are split guard by guard: the first refused call's guard (:func:`split_rule`), which every reproduced
    call meets, sends the refused calls against it to a program of their own (:func:`_export_side`, split
    again the same way) and the others to the next guard. ``if h % 4 or w % 4`` gives programs for ``h %
    4 != 0``, for ``h % 4 == 0 and w % 4 != 0`` and (the first) for both ``== 0``. Otherwise nothing is
    split, and the report's options say why.
    """
    refused = [c for c in report.calls if c.success is False]
    if not refused or not all("Guard failed" in (c.error or "") for c in refused):
        return [], []
    indices = [c.index for c in refused]
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        sources = guard_sources(rc, plan)  # under the pytree registrations: a cache's tensors by their key paths
    position = {call.index: i for i, call in enumerate(plan.alignment.calls)}

    def meets(index: int, condition: SizeCondition) -> bool:
        return conditions_met([condition], call_sizes(rc, plan.alignment, position[index]))

    served = [c.index for c in report.calls if c.success is not False]
    shapes = {i: call_structure(rc, plan.alignment, position[i]) for i in [*indices, *served]}
    alone = [i for i in indices if all(shapes[i] != shapes[j] for j in served)]
    not_split = f"calls {indices} refused on a guard, not split into two programs"
    if alone:
        report.options.append(
            f"{not_split}: calls {alone} have a structure no reproduced call has (a phase of their own, not a side "
            "of a size rule)"
        )
        return [], []
    kept: list[SizeCondition] = []
    splits: list[SplitProgram] = []
    said: list[str] = []
    left = refused
    while left:
        guard = (left[0].error or "").split("Guard failed: ")[-1]
        rule = split_rule(left[0].error or "", sources)
        if isinstance(rule, str):
            report.options.append(f"{not_split}: {rule}")
            return [], []
        holds, negation = rule
        out = [c.index for c in left if meets(c.index, negation)]
        stray = [i for i in served if not meets(i, holds)] + ([] if left[0].index in out else [left[0].index])
        if stray:
            report.options.append(
                f"{not_split}: the size rule {holds.describe()} does not separate them from the others (calls "
                f"{stray} are on the wrong side)"
            )
            return [], []
        try:
            second = _export_side(phase_calls(rc, out), model, _widened(plan, out, options["dynamic"]), options)
        except ExportError as exc:
            report.options.append(
                f"calls {out} refused on a guard ({negation.describe()}): a program from them failed "
                f"({_first_line(exc)})"
            )
            return [], []
        splits += [
            SplitProgram(
                p.program, p.report, plan=p.plan, sizes=[*kept, negation, *p.sizes],
                calls=getattr(p, "calls", tuple(c.index for c in p.report.calls)),
            )
            for p in [second, *second.splits]
        ]  # fmt: skip
        said.append(f"calls {out} ({negation.describe()}, refused on {guard}) from call {second.report.traced_call}")
        kept.append(holds)
        left = [c for c in left if c.index not in out]
    report.calls = [c for c in report.calls if c.index not in indices]
    report.options.append(
        f"split by size rules between the recorded calls: this program serves "
        f"{' and '.join(c.describe() for c in kept)} (calls {served}); refused on guards of the model's code, "
        f"programs traced from them serve {'; '.join(said)}"
    )
    logger.info("%s", report.options[-1])
    return kept, splits


def _widened(plan: _Plan, calls: list[int], dynamic: DynamicSpec) -> dict[int | str, set[int]]:
    """``dynamic`` and the axes ``plan`` made dynamic, of the inputs every call of ``calls`` passes."""
    axes: dict[int | str, set[int]] = {key: set(value) for key, value in (dynamic or {}).items()}
    rows = [slots for call, slots in zip(plan.alignment.calls, plan.alignment.slots) if call.index in calls]
    for slot, (owner, dims) in enumerate(zip(plan.alignment.owners, plan.dims)):
        if dims and all(row[slot] is not None for row in rows):
            axes.setdefault(owner, set()).update(dims)
    return axes


def _export_side(
    rc: RecordedCalls, model: torch.nn.Module, widened: DynamicSpec, options: dict[str, Any]
) -> ExportResult:
    """The program of a side of a split, traced dynamic where the first program was (``widened``): it serves sizes
    of its side no call had, even from one call; else, when that fails, dynamic where its own calls vary."""
    try:
        return _export_checked(rc, model, check=True, split=True, on_progress=None, **{**options, "dynamic": widened})
    except ExportError as exc:
        logger.info("a side of a split, dynamic where the first program is, failed (%s)", _first_line(exc))
    return _export_checked(rc, model, check=True, split=True, on_progress=None, **options)


def _serve_refused_batch(
    rc: RecordedCalls, model: torch.nn.Module, result: ExportResult, *, tolerances: Tolerances, **options: Any
) -> ExportResult:
    """Re-export with each remedy of ``GUARD_REMEDIES`` until a program serves the batch the first refused on a guard.

    A re-exported program is kept only when it reproduces every recorded call and passes the same
    check (the same recorded call, cut to the same batch); its check then names the remedy and
    how the first program refused. Otherwise the first program is kept, and its check lists what
    each remedy gave (``BatchCheck.tried``).
    """
    plan, report = result.plan, result.report
    first: BatchCheck = report.batch_check
    tried: list[str] = []
    for remedy in GUARD_REMEDIES:
        attempt = ExportReport(traced_call=report.traced_call)
        try:
            ep2, plan2, attempt = _export(rc, model, report=attempt, remedy=remedy, **options)
        except ExportError as exc:
            tried.append(f"{remedy.name}: torch.export failed ({str(exc).splitlines()[0]})")
            continue
        with export_context(rc, oblivious=False, report=ExportReport(traced_call=attempt.traced_call)):
            _check_calls(rc, plan2, ep2.module(), tolerances=tolerances, report=attempt, eager=plan2.module)
            if not attempt.ok:
                tried.append(f"{remedy.name}: {attempt.summary()}")
                continue
            check = check_other_batch(rc, plan2, ep2, atol=tolerances.atol, rtol=tolerances.rtol)
        if check.success is not True:
            tried.append(
                f"{remedy.name}: still {'refused' if check.assumption else 'failed'} ({check.error or 'differs'})"
            )
            continue
        tried.append(f"{remedy.name}: served")
        check.refused, check.assumption, check.remedy, check.tried = first.error, first.assumption, remedy.name, tried
        attempt.batch_check = check
        attempt.export_seconds += report.export_seconds
        logger.info("beyond the recorded calls: %s", check.summary())
        return ExportResult(ep2, attempt, plan=plan2)
    split = _split_program(rc, plan, report, first, tolerances=tolerances, strict=options["strict"], tried=tried)
    if split is not None:
        holds, second = split
        second.sizes = [*result.sizes, *second.sizes]
        result.sizes.append(holds)
        result.splits.append(second)
        return result
    first.tried = tried
    logger.info("beyond the recorded calls: no remedy serves batch %d: %s", first.batch, "; ".join(tried))
    return result


def _split_program(
    rc: RecordedCalls,
    plan: _Plan,
    report: ExportReport,
    first: BatchCheck,
    *,
    tolerances: Tolerances,
    strict: bool,
    tried: list[str],
) -> tuple[SizeCondition, SplitProgram] | None:
    """The rule the first program holds and a second program traced from the refused inputs, for its negation.

    Kept only when the guard is a size rule (:func:`split_rule`) and the second program agrees with the
    eager model on the refused inputs (the same check). Then ``report.batch_check`` becomes that check,
    naming the split, and the second program's report says where it was traced from.
    """
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        sources = guard_sources(rc, plan)
    rule = split_rule(first.error or "", sources)
    if isinstance(rule, str):
        tried.append(f"a second program: no size rule to split on ({rule})")
        return None
    cut = cut_plan(rc, plan)
    where = f"traced from call {first.call} cut to batch {first.batch} (refused by the first program)"
    attempt = ExportReport(traced_call=report.traced_call, options=[where])
    begin = time.perf_counter()
    with export_context(
        rc,
        oblivious=plan.oblivious or first.batch in (0, 1),  # a size 0 or 1 is specialised unless size-oblivious
        report=attempt,
        model=cut.module,
        dynamic_batch=cut.dynamic_batch,
        dynamic=cut.dynamic,
    ):
        try:
            ep2 = torch.export.export(
                cut.module, cut.args, cut.kwargs, dynamic_shapes=cut.dynamic_shapes, strict=strict
            )
        except Exception as exc:
            tried.append(f"a second program: torch.export failed ({_first_line(exc)})")
            return None
    attempt.export_seconds = time.perf_counter() - begin
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        check = check_other_batch(rc, plan, ep2, atol=tolerances.atol, rtol=tolerances.rtol)
    if check.success is not True:
        tried.append(f"a second program: {'refused' if check.assumption else 'failed'} ({check.error or 'differs'})")
        return None
    tried.append("a second program traced from these inputs: served")
    holds, refused = rule
    check.refused, check.assumption, check.tried = first.error, first.assumption, tried
    check.split = {"first": [holds.model_dump(mode="json")], "second": [refused.model_dump(mode="json")]}
    report.batch_check = check
    logger.info("beyond the recorded calls: %s", check.summary())
    return holds, SplitProgram(ep2, attempt, plan=cut, sizes=[refused])
