"""Export a model from recorded calls with ``torch.export`` / ``torch.onnx``, checked on every call."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls, ReplayAutocast, module_device_type, replay_autocast, tensor_keys
from iobundle.errors import BundleExistsError, ExportError, ToleranceError
from iobundle.replay.check import (
    INPUT_SLOTS_KEY,
    OUTPUT_NAMES_KEY,
    OUTPUT_PATHS_KEY,
    Comparison,
    Tolerances,
    compare_outputs,
    flatten_outputs,
    output_paths,
)
from iobundle.replay.export._dims import (
    GUARD_REMEDIES,
    BatchCheck,
    GuardRemedy,
    _first_line,
    _Plan,
    check_other_batch,
    cut_plan,
    derived_dims,
    guard_sources,
    program_batch_axes,
    split_rule,
)
from iobundle.replay.infer import (
    Alignment,
    DimNamesSpec,
    DynamicSpec,
    align_calls,
    call_sizes,
    call_structure,
    fed_shapes,
    flat_dynamic_dims,
    infer_arguments,
    infer_dynamic_shapes,
    name_dims,
    named_dims_hint,
    onnx_axis_names,
    phase_calls,
    placeholder_inputs,
    received_arguments,
    rename_onnx_axes,
    select_call,
    spread_var_keyword,
    to_export_dims,
    to_torch_dims,
)
from iobundle.schema import ObjectNode, SizeCondition, conditions_met

__all__ = [
    "CallCheck",
    "ExportReport",
    "ExportResult",
    "SplitProgram",
    "export_onnx",
    "export_program",
    "save_onnx",
]

logger = logging.getLogger(__name__)

CHECK_TASK = "check exported program"
# Weights from this size on are saved as external data (MODEL.onnx.data beside MODEL.onnx): written
# tensor by tensor, where an inline save first builds the whole protobuf, then its serialised bytes,
# two more copies of the weights (benchmarks/large.py measured the export's peak at 4.7x the weights).
EXTERNAL_DATA_BYTES = 256 * 1024**2


@dataclass
class CallCheck:
    """How the exported program did on one recorded call."""

    index: int
    success: bool | None
    abs: float = 0.0
    rel: float = 0.0
    error: str | None = None
    absent_inputs: list[str | int] = field(default_factory=list)
    seconds: float = 0.0
    reference: str = "recorded"
    """What the program's outputs were compared with: ``"recorded"`` outputs, or the ``"eager"`` model's
    on the same inputs (a call without recorded outputs, as in a redacted bundle)."""


@dataclass
class ExportReport:
    """What ``export`` did: the traced call, the options and patches, and one check per recorded call."""

    traced_call: int
    export_seconds: float = 0.0
    check_seconds: float = 0.0
    onnx_seconds: float | None = None
    options: list[str] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    calls: list[CallCheck] = field(default_factory=list)
    batch_check: Any = None
    """A ``BatchCheck`` (see :mod:`iobundle.replay.export._dims`): the program on a batch size never recorded."""

    @property
    def failures(self) -> list[CallCheck]:
        """Calls that failed or differ (calls fed stand-ins for inputs absent at capture are not counted)."""
        return [c for c in self.calls if c.success is False]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        n_ok = sum(1 for c in self.calls if c.success)
        eager = sum(1 for c in self.calls if c.reference == "eager")
        note = f"; {eager} without recorded outputs compared with the eager model" if eager else ""
        return f"{n_ok}/{len(self.calls)} recorded calls reproduced (traced call {self.traced_call}{note})"


@dataclass
class ExportResult:
    """What :func:`export_program` returns: the program, its report and, when it was split, the second program."""

    program: torch.export.ExportedProgram
    report: ExportReport
    split: SplitProgram | None = None
    """The second program, for the sizes this one refuses on a guard that is a size rule, or None."""
    plan: Any = field(default=None, repr=False)
    """How the program was traced (the alignment, the traced call, the dims), which :func:`save_onnx` reads."""


@dataclass(kw_only=True)
class SplitProgram(ExportResult):
    """The second program of a split: traced from the inputs the first refused on a guard, for the sizes it refused.

    Those inputs are recorded calls (``calls``) or, when the first program served every recorded
    call, the check beyond them (a recorded call cut to another batch).

    It is the first program's ``split`` (:func:`export_program`'s result is the first);
    :func:`iobundle.replay.export.export_programs` writes both, with a program index whose size
    rules (``first``, ``second``: :class:`iobundle.schema.SizeCondition`) select between them.
    """

    first: Any
    second: Any
    calls: tuple[int, ...] = ()
    """The recorded calls the second program serves (exported and checked on them), when the first
    refused them on the guard; empty for a split for sizes beyond the recorded calls."""


class _MethodAsModule(torch.nn.Module):
    """Exposes ``model.<method>`` as ``forward`` with an explicit signature (no ``**kwargs``).

    torch.export rejects ``dynamic_shapes`` for arguments collected by ``**kwargs``; listing
    the recorded names as keyword parameters avoids that.
    """

    def __new__(cls, model: torch.nn.Module, method_name: str, signature: inspect.Signature) -> _MethodAsModule:
        # ``forward`` is looked up on the class, so each instance gets its own subclass whose
        # ``forward`` carries the signature (with ``self`` first, as a bound method needs).
        def forward(self: _MethodAsModule, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.model, self._method_name)(*args, **kwargs)

        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_param, *signature.parameters.values()]
        )
        subclass = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        return super().__new__(subclass)

    def __init__(self, model: torch.nn.Module, method_name: str, signature: inspect.Signature) -> None:
        super().__init__()
        self.model = model
        self._method_name = method_name


class _UnderAutocast(torch.nn.Module):
    """Runs ``module`` under the autocast the traced call was recorded under; ``forward`` keeps its signature.

    ``torch.export`` ignores an autocast entered around it, but keeps one entered inside the traced
    function (a ``wrap_with_autocast`` region, which ``torch.onnx`` lowers to casts to the autocast
    dtype): the program computes what the recorded model computed, and the eager checks run the
    same way.
    """

    def __new__(cls, module: torch.nn.Module, autocast: ReplayAutocast) -> _UnderAutocast:
        signature = inspect.signature(module.forward)

        def forward(self: _UnderAutocast, *args: Any, **kwargs: Any) -> Any:
            with self.autocast.context():
                return self.module(*args, **kwargs)

        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_param, *signature.parameters.values()]
        )
        subclass = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        return super().__new__(subclass)

    def __init__(self, module: torch.nn.Module, autocast: ReplayAutocast) -> None:
        super().__init__()
        self.module = module
        self.autocast = autocast


def _explicit_signature(rc: RecordedCalls, extra: list[str]) -> inspect.Signature:
    params = []
    for p in rc.signature.parameters:
        if p.kind == "VAR_KEYWORD":
            continue
        kind = getattr(inspect.Parameter, p.kind)
        default = p.default if p.has_default else (None if p.kind != "VAR_POSITIONAL" else inspect.Parameter.empty)
        if kind in (inspect.Parameter.VAR_POSITIONAL,):
            params.append(inspect.Parameter(p.name, kind))
        elif p.has_default or kind == inspect.Parameter.KEYWORD_ONLY:
            params.append(inspect.Parameter(p.name, kind, default=default))
        else:
            params.append(inspect.Parameter(p.name, kind))
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in extra]
    return inspect.Signature(params)


def _uses_transformers(rc: RecordedCalls) -> bool:
    def walk(node: Any) -> bool:
        if isinstance(node, ObjectNode):
            return node.type.startswith("transformers.") or any(walk(n) for n in node.items)
        return any(walk(n) for n in getattr(node, "items", ()))

    return any(walk(n) for c in rc.ok_calls for n in [*c.args, *c.kwargs.values()])


def _plan(
    rc: RecordedCalls,
    model: torch.nn.Module,
    batch: Collection[int | str] | bool | None,
    dynamic: DynamicSpec = None,
    dim_names: DimNamesSpec = False,
    derived: dict[str, tuple[str | None, int, int]] | None = None,
) -> _Plan:
    alignment = align_calls(rc)
    traced = choose_traced_call(rc, alignment, batch, dynamic)
    args, kwargs = infer_arguments(rc, traced, as_args_kwargs=True, alignment=alignment)
    ds = infer_dynamic_shapes(rc, batch, dim_names=dim_names, dynamic=dynamic)
    slot_names = None
    if dim_names is False:
        ds = to_torch_dims(ds)
    else:
        ds, _ = to_export_dims(ds, derived)  # one torch.export.Dim per name: equal names, one symbol
        slot_names = name_dims(
            rc, alignment, flat_dynamic_dims(rc, alignment, batch, dynamic), dim_names, fed_shapes(rc, alignment)
        )
    var_kw = rc.var_keyword
    names = set(rc.names)
    extra = [k for k in kwargs if k not in names]
    flatten_var_kw = bool(var_kw and extra)
    module: torch.nn.Module = model
    if flatten_var_kw or rc.signature.method != "forward":
        module = _MethodAsModule(model, rc.signature.method, _explicit_signature(rc, extra if flatten_var_kw else []))
    autocast = replay_autocast(alignment.calls[traced].autocast, module_device_type(model))
    if autocast is not None:
        module = _UnderAutocast(module, autocast)
    if flatten_var_kw and isinstance(ds, dict):
        ds = spread_var_keyword(ds, var_kw)
    # A dynamic dimension seen as 0 or 1 is specialised by torch.export unless size-oblivious.
    dims = flat_dynamic_dims(rc, alignment, batch, dynamic)
    if slot_names is not None:  # an explicitly named dimension is dynamic
        dims = [sorted({*d, *n}) for d, n in zip(dims, slot_names)]
    oblivious = False
    for index, dynamic_axes in enumerate(dims):
        sizes = [rc.store.shape(key) for s in alignment.slots if (key := s[index]) is not None]
        if len(sizes) < len(alignment.slots) or any(shape[d] in (0, 1) for shape in sizes for d in dynamic_axes):
            oblivious = oblivious or bool(dynamic_axes)
    axes = program_batch_axes(rc, alignment, batch)
    dynamic_batch = any(axis is not None and axis in d for axis, d in zip(axes, dims))
    return _Plan(
        module, tuple(args), kwargs, ds, alignment, traced, flatten_var_kw, oblivious, dynamic_batch, any(dims),
        dims=dims, dim_names=slot_names, batch_axes=axes, autocast=autocast,
    )  # fmt: skip


def choose_traced_call(
    rc: RecordedCalls,
    alignment: Alignment,
    batch: Collection[int | str] | bool | None,
    dynamic: DynamicSpec = None,
) -> int:
    """The call to trace: the one that needs the fewest stand-ins and has the fewest dynamic sizes of 0 or 1.

    A call with every input present follows the code path most calls take (a decode step
    with a filled cache rather than the prefill with an empty one); a dynamic size above 1
    gives torch.export nothing to specialise. Ties go to the earliest call, as
    ``infer_arguments`` does by default.
    """
    dims = flat_dynamic_dims(rc, alignment, batch, dynamic)
    best = alignment.best_call
    default = select_call(alignment)

    def cost(i: int) -> tuple[int, int, int, int, int]:
        call, slots = alignment.calls[i], alignment.slots[i]
        absent = sum(1 for key in slots if key is None)
        small = sum(
            1
            for key, dynamic in zip(slots, dims)
            if key is not None
            for d in dynamic
            if rc.store.shape(key)[d] in (0, 1)
        )
        laid_out = len(call.args) == len(best.args) and len(call.kwargs) == len(best.kwargs)
        return absent, len(call.filled), int(not laid_out), small, int(i != default)

    return min(range(len(alignment.calls)), key=cost)


@contextlib.contextmanager
def export_context(
    rc: RecordedCalls,
    *,
    oblivious: bool,
    report: ExportReport,
    model: torch.nn.Module | None = None,
    dynamic_batch: bool = False,
    dynamic: bool = True,
    remedy: GuardRemedy | None = None,
    specialised: bool = False,
) -> Iterator[None]:
    """Everything export and the checks need, scoped: pytree registrations, size-oblivious mode.

    With ``model`` (tracing only), the patches of :mod:`iobundle.replay.export._patches` that apply
    to it are entered too and listed by name on ``report.patches``, and so is ``remedy`` (one of
    :data:`~iobundle.replay.export._dims.GUARD_REMEDIES`), listed on ``report.options``; with
    ``specialised`` (a trace without them specialised a dynamic dimension), the patches meant for
    that case as well.
    """
    with contextlib.ExitStack() as stack:
        if _uses_transformers(rc):
            from iobundle.calls import transformers_pytree_nodes

            stack.enter_context(transformers_pytree_nodes())
            report.options.append("transformers pytree nodes registered")
        if oblivious:
            import torch.fx.experimental._config as fx_config

            stack.enter_context(fx_config.patch(backed_size_oblivious=True))  # type: ignore[attr-defined]
            report.options.append("backed_size_oblivious=True (a dynamic dimension was observed as 0 or 1)")
        if model is not None:
            from iobundle.replay.export._patches import export_patches

            stack.enter_context(
                export_patches(
                    model, dynamic=dynamic, dynamic_batch=dynamic_batch, applied=report.patches, specialised=specialised
                )
            )
            if remedy is not None:
                stack.enter_context(remedy.context())
                report.options.append(f"remedy {remedy.name}: {remedy.does}")
        yield


def _check_calls(
    rc: RecordedCalls,
    plan: _Plan,
    run: Any,
    *,
    tolerances: Tolerances,
    report: ExportReport,
    eager: Any = None,
    on_progress: ProgressCallback | None = None,
) -> None:
    begin = time.perf_counter()
    total = len(plan.alignment.calls)
    notify(on_progress, CHECK_TASK, 0, total)
    for i, call in enumerate(plan.alignment.calls):
        t0 = time.perf_counter()
        check = CallCheck(index=call.index, success=None)
        try:
            slots = plan.alignment.slots[i]
            check.absent_inputs = placeholder_inputs(plan.alignment, call, slots)
            args, kwargs = infer_arguments(rc, i, as_args_kwargs=True, alignment=plan.alignment)
            if plan.flatten_var_kw:
                kwargs = spread_var_keyword(kwargs, rc.var_keyword)
            obtained = flatten_outputs(run(*args, **kwargs))
            if call.outputs is not None:
                expected = [rc.store.get(k) for k in tensor_keys(call.outputs)]
            elif eager is not None:  # nothing recorded (a redacted bundle): the eager model is the reference
                eager_args, eager_kwargs = received_arguments(rc, call)  # fresh copies, as the model received them
                with torch.no_grad():
                    expected = flatten_outputs(eager(*eager_args, **eager_kwargs))
                check.reference = "eager"
            else:
                check.error = "ran; no recorded outputs to compare with"
                check.seconds = time.perf_counter() - t0
                report.calls.append(check)
                continue
            own = tolerances.for_call(call)  # its own torch.autocast state: float32 outputs may take its dtype's row
            half = any(str(getattr(e, "dtype", "")).replace("torch.", "") in own.by_dtype for e in expected)
            if (own.per_output or half) and call.outputs is not None:
                cmp = _compare_per_output(expected, obtained, output_paths(call.outputs), own)
            else:
                cmp = compare_outputs(expected, obtained, atol=own.atol, rtol=own.rtol)
            check.success, check.abs, check.rel, check.error = cmp.success, cmp.abs, cmp.rel, cmp.error
            if check.absent_inputs and not cmp.success:
                check.success = None  # fed a stand-in the model never saw: not a numeric mismatch
        except Exception as exc:  # a call the program cannot run is a failed check, not a crash
            check.success, check.error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        check.seconds = time.perf_counter() - t0
        report.calls.append(check)
        notify(on_progress, CHECK_TASK, i + 1, total, f"call {call.index}")
    report.check_seconds = time.perf_counter() - begin


def _compare_per_output(
    expected: list[Any], obtained: list[Any], names: list[str], tolerances: Tolerances
) -> Comparison:
    """:func:`compare_outputs` output by output, each with its tolerances (``--atol logits=1e-3``, its dtype's)."""
    if len(expected) != len(obtained) or len(names) != len(expected):
        return compare_outputs(expected, obtained, atol=tolerances.atol, rtol=tolerances.rtol)
    result = Comparison()
    for name, e, o in zip(names, expected, obtained):
        atol, rtol = tolerances.for_output(name, dtype=str(getattr(e, "dtype", "")))
        one = compare_outputs([e], [o], atol=atol, rtol=rtol)
        result.abs, result.rel = max(result.abs, one.abs), max(result.rel, one.rel)
        if not one.success and result.success:
            result.success, result.error = (
                False,
                one.error or f"{name}: out of tolerance (atol={atol:g}, rtol={rtol:g})",
            )
    return result


def _refuse_unknown_tolerances(rc: RecordedCalls, tolerances: Tolerances) -> None:
    names = [[name] for call in rc.ok_calls if call.outputs is not None for name in output_paths(call.outputs)]
    unused = tolerances.unused(names)
    if unused and names:
        known = ", ".join(dict.fromkeys(n[0] for n in names))
        raise ToleranceError(f"Tolerances for {unused} match no recorded output. Recorded outputs: {known}.")


_SPECIALISED = "your code specialized it to be a constant"


def _trace(
    rc: RecordedCalls,
    plan: _Plan,
    report: ExportReport,
    *,
    strict: bool,
    remedy: GuardRemedy | None,
    specialised: bool,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of the plan, in its :func:`export_context` (the patches that apply, ``remedy``)."""
    with export_context(
        rc,
        oblivious=plan.oblivious,
        report=report,
        model=plan.module,
        dynamic_batch=plan.dynamic_batch,
        dynamic=plan.dynamic,
        remedy=remedy,
        specialised=specialised,
    ):
        return torch.export.export(
            plan.module, plan.args, plan.kwargs, dynamic_shapes=plan.dynamic_shapes, strict=strict
        )


def _export_error(exc: BaseException, plan: _Plan, report: ExportReport) -> ExportError:
    hint = named_dims_hint(str(exc)) if plan.dim_names is not None else ""
    return ExportError(
        f"torch.export failed on recorded call {report.traced_call}: {_first_line(exc)}{hint}\n"
        "Set IOBUNDLE_DEBUG=1 for the full traceback.",
        report=report,
    )


def _export(
    rc: RecordedCalls,
    model: torch.nn.Module,
    *,
    batch: Any,
    strict: bool,
    report: ExportReport | None = None,
    dynamic: DynamicSpec = None,
    dim_names: DimNamesSpec = False,
    on_progress: ProgressCallback | None = None,
    remedy: GuardRemedy | None = None,
) -> tuple[torch.export.ExportedProgram, _Plan, ExportReport]:
    notify(on_progress, "torch.export", 0, 1)
    plan = _plan(rc, model, batch, dynamic, dim_names)
    report = report or ExportReport(traced_call=plan.alignment.calls[plan.traced].index)
    if plan.autocast is not None:
        report.options.append(f"traced and checked under {plan.autocast.describe()}, as the calls were recorded")
    begin = time.perf_counter()
    kept = len(report.options), len(report.patches)
    try:
        ep = _trace(rc, plan, report, strict=strict, remedy=remedy, specialised=False)
    except Exception as exc:
        from iobundle.replay.export._patches import specialisation_patches

        derived = derived_dims(rc, plan, str(exc))
        if derived:  # named dimensions tied by the model's code (a patch grid and its mask): derived Dims
            plan = _plan(rc, model, batch, dynamic, dim_names, derived)
            report.options.append(
                "derived dimensions inferred from the recorded sizes: "
                + ", ".join(
                    f"{n} = {k} * {r or 'a dimension of its own'}" + (f" + {c}" if c else "")
                    for n, (r, k, c) in derived.items()
                )
                + f" (torch.export found constraints on the named dimensions: {_first_line(exc)})"
            )
            try:
                ep = _trace(rc, plan, report, strict=strict, remedy=remedy, specialised=False)
                report.export_seconds = time.perf_counter() - begin
                notify(on_progress, "torch.export", 1, 1)
                return ep, plan, report
            except Exception:  # the first refusal says more (torch's suggested fixes for the names given)
                raise _export_error(exc, plan, report) from exc
        retry = _SPECIALISED in str(exc) and specialisation_patches(
            plan.module, dynamic=plan.dynamic, dynamic_batch=plan.dynamic_batch
        )
        if not retry:
            raise _export_error(exc, plan, report) from exc
        # The model's code made a dynamic dimension a constant: trace again with the patches for
        # that (``sizes_through_int``); when they do not help, the first trace's failure is raised.
        first = exc
        del report.options[kept[0] :], report.patches[kept[1] :]
        report.options.append(f"traced again with {', '.join(retry)}: the first trace failed: {_first_line(first)}")
        try:
            ep = _trace(rc, plan, report, strict=strict, remedy=remedy, specialised=True)
        except Exception as again:
            cause = first if _SPECIALISED in str(again) else again
            raise _export_error(cause, plan, report) from cause
    report.export_seconds = time.perf_counter() - begin
    notify(on_progress, "torch.export", 1, 1)
    return ep, plan, report


def export_program(
    rc: RecordedCalls,
    model: torch.nn.Module,
    *,
    set_batch_dimension_for: Collection[int | str] | bool | None = None,
    strict: bool = False,
    check: bool = True,
    dynamic: DynamicSpec = None,
    check_batch: bool = True,
    dim_names: DimNamesSpec = False,
    on_progress: ProgressCallback | None = None,
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
        result.split = _split_recorded_calls(
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
) -> SplitProgram | None:
    """A second program for the recorded calls the first refused on a guard that is a size rule, or None.

    When every call the program fails is refused on a guard, the first one's guard is a size rule
    (:func:`split_rule`), each refused call has the structure of some reproduced call (the same
    inputs present: sides of a size rule, not phases), every refused call meets the rule's negation
    and every reproduced call the rule itself, the refused calls are exported again on their own
    (:func:`export_program` on those calls: their own traced call and dynamic shapes, checked on
    them; never split again) and the first program keeps the others: ``report.calls`` then lists
    only those, and ``report.options`` says what was split.
    Otherwise the report's options say why the calls were not split, and None.
    """
    refused = [c for c in report.calls if c.success is False]
    if not refused or not all("Guard failed" in (c.error or "") for c in refused):
        return None
    indices = [c.index for c in refused]
    with export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)):
        sources = guard_sources(rc, plan)  # under the pytree registrations: a cache's tensors by their key paths
    rule = split_rule(refused[0].error or "", sources)
    if isinstance(rule, str):
        report.options.append(f"calls {indices} refused on a guard, not split into two programs: {rule}")
        return None
    holds, negation = rule
    position = {call.index: i for i, call in enumerate(plan.alignment.calls)}

    def meets(index: int, condition: SizeCondition) -> bool:
        return conditions_met([condition], call_sizes(rc, plan.alignment, position[index]))

    served = [c.index for c in report.calls if c.success is not False]
    shapes = {i: call_structure(rc, plan.alignment, position[i]) for i in [*indices, *served]}
    alone = [i for i in indices if all(shapes[i] != shapes[j] for j in served)]
    if alone:
        report.options.append(
            f"calls {indices} refused on a guard, not split into two programs: calls {alone} have a structure "
            "no reproduced call has (a phase of their own, not a side of a size rule)"
        )
        return None
    stray = [i for i in indices if not meets(i, negation)] + [i for i in served if not meets(i, holds)]
    if stray:
        report.options.append(
            f"calls {indices} refused on a guard, not split into two programs: the size rule "
            f"{holds.describe()} does not separate them from the others (calls {stray} are on the wrong side)"
        )
        return None
    try:
        second = _export_checked(phase_calls(rc, indices), model, check=True, split=False, on_progress=None, **options)
    except ExportError as exc:
        report.options.append(
            f"calls {indices} refused on a guard ({negation.describe()}): a second program from them failed "
            f"({_first_line(exc)})"
        )
        return None
    report.calls = [c for c in report.calls if c.index not in indices]
    report.options.append(
        f"split by a size rule between the recorded calls: this program serves {holds.describe()} (calls "
        f"{served}); calls {indices} ({negation.describe()}), refused on a guard of the model's code "
        f"({(refused[0].error or '').split('Guard failed: ')[-1]}), are served by a second program traced "
        f"from call {second.report.traced_call}"
    )
    logger.info("%s", report.options[-1])
    return SplitProgram(
        second.program, second.report, plan=second.plan, first=holds, second=negation, calls=tuple(indices)
    )


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
        result.split = split
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
) -> SplitProgram | None:
    """A second program traced from the refused inputs, for the sizes the first program's guard excludes.

    Kept only when the guard is a size rule (:func:`split_rule`: a product of sizes of inputs that
    hold one tensor, compared with a number) and the second program agrees with the eager model on
    the refused inputs (the same check). Then ``report.batch_check`` becomes that check, naming the
    split, and the second program's report says where it was traced from.
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
    return SplitProgram(ep2, attempt, plan=cut, first=holds, second=refused)


def export_onnx(
    rc: RecordedCalls,
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    set_batch_dimension_for: Collection[int | str] | bool | None = None,
    strict: bool = False,
    check: bool = True,
    dynamic: DynamicSpec = None,
    dim_names: DimNamesSpec = False,
    on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
) -> str:  # fmt: skip
    """Export ``model`` to ONNX at ``path`` through ``torch.export`` (checked on every call first).

    The graph's outputs are named after the recorded outputs (``logits``, the names validation
    reports and ``output_atol`` takes; see :func:`iobundle.replay.check.output_paths`). The ONNX
    file carries, in its metadata, which recorded tensor feeds which graph input and which
    recorded output each graph output reproduces, so validation maps them through the exported
    program's signature rather than by guessing from names. With ``dim_names``, the graph's symbolic
    dimensions bear the names (``batch_size``, ``past_sequence_length``, ...). Weights of 256 MiB
    or more are saved as external data, ``<path>.data`` beside the file. The arguments are those
    of :func:`export_program`, the tolerance keywords of the check included.

    Raises:
        ExportError: ``torch.export`` or ``torch.onnx.export`` failed, or (with ``check``) the
            exported program does not reproduce a recorded call.
        BundleExistsError: ``path`` (or ``<path>.data``) is a symbolic link: nothing is written through one.
        ToleranceError: A per-output tolerance names no recorded output (before anything is traced).

    .. versionchanged:: 0.2
        ``output_atol``, ``output_rtol`` and ``tolerances``, as :func:`export_program` takes them.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
    result = export_program(
        rc, model, set_batch_dimension_for=set_batch_dimension_for, strict=strict, check=check, dynamic=dynamic,
        dim_names=dim_names, on_progress=on_progress, tolerances=tolerances,
    )  # fmt: skip
    return save_onnx(rc, result, path, on_progress=on_progress)


def save_onnx(
    rc: RecordedCalls,
    result: ExportResult,
    path: str | os.PathLike[str],
    *,
    on_progress: ProgressCallback | None = None,
) -> str:
    """Convert the program of :func:`export_program`'s ``result`` from ``rc`` to ONNX at ``path``; return the path.

    Weights of 256 MiB or more are saved as external data, ``<path>.data`` beside the file.

    Raises:
        ExportError: ``torch.onnx.export`` failed, or the program does not take the recorded tensors.
        BundleExistsError: ``path`` (or ``<path>.data``) is a symbolic link: nothing is written through one.
    """
    for target in (Path(path), Path(f"{path}.data")):
        if target.is_symlink():
            raise BundleExistsError(
                f"'{target}' is a symbolic link; iobundle never writes through one. Remove it, or choose another path."
            )
    ep, report, plan = result.program, result.report, result.plan
    sig = ep.graph_signature
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    inputs = [
        s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)
    ]
    outputs = [
        s.arg.name for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT and isinstance(s.arg, TensorArgument)
    ]
    n_slots = len(plan.alignment.owners)
    if len(inputs) != n_slots:
        raise ExportError(
            f"The exported program takes {len(inputs)} tensor inputs but the recorded calls hold {n_slots}.",
            report=report,
        )
    begin = time.perf_counter()
    notify(on_progress, "torch.onnx.export", 0, 1)
    try:
        from iobundle.replay.export._onnx_optimizer import linear_rewrite_rules
        from iobundle.replay.export._onnx_rewrites import converted_folding, rewrite_for_onnx

        report.options += [f"rewritten for ONNX: {r}" for r in rewrite_for_onnx(ep)]
        with (
            export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)),
            linear_rewrite_rules(),  # the optimizer's O(nodes²) rules left out
        ):
            program = converted_folding(
                ep, lambda: torch.onnx.export(ep, (), dynamo=True, verbose=False), report.options
            )
        assert program is not None
        if plan.dim_names is not None:
            rename_onnx_axes(program.model, onnx_axis_names(ep, inputs, plan.dim_names))
        # Outputs are named after the recorded outputs they reproduce, and the metadata maps them.
        recorded = _recorded_names(plan, len(program.model.graph.outputs))
        if recorded is not None:
            from iobundle.replay.export._onnx_names import name_graph_inputs, name_graph_outputs

            program.model.metadata_props[OUTPUT_PATHS_KEY] = json.dumps(name_graph_outputs(program.model, recorded))
            name_graph_inputs(program.model, inputs)
        # The ONNX graph takes the user inputs in the program's order, but may rename one (an input
        # also returned as an output may stay ``<name>_orig``): map the ONNX names by position.
        graph_inputs = [v.name for v in program.model.graph.inputs]
        names = graph_inputs if len(graph_inputs) == len(inputs) else inputs
        program.model.metadata_props[INPUT_SLOTS_KEY] = json.dumps(dict(zip(names, range(len(names)))))
        program.model.metadata_props[OUTPUT_NAMES_KEY] = json.dumps([v.name for v in program.model.graph.outputs])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = sum(
            v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None
        )
        program.save(str(path), external_data=weights >= EXTERNAL_DATA_BYTES)
    except ExportError:
        raise
    except Exception as exc:
        from iobundle.replay.export._onnx_rewrites import untranslated_op

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = untranslated_op(str(exc), ep) or f"{type(exc).__name__}: {first}"
        raise ExportError(f"torch.onnx.export failed: {why}", report=report) from exc
    report.onnx_seconds = time.perf_counter() - begin
    notify(on_progress, "torch.onnx.export", 1, 1)
    logger.info("exported %s (%d inputs, %d outputs)", path, len(inputs), len(outputs))
    return str(path)


def _recorded_names(plan: _Plan, n_outputs: int) -> list[str] | None:
    """The recorded outputs' names (:func:`output_paths`) of the traced call, else of the first call that has
    ``n_outputs`` of them; None when no call does (a redacted bundle): the graph keeps its node names."""
    calls = [plan.alignment.calls[plan.traced], *plan.alignment.calls]
    for call in calls:
        names = output_paths(call.outputs) if call.outputs is not None else []
        if len(names) == n_outputs and len(set(names)) == n_outputs:
            return names
    return None
