"""What ``torch.export`` traces (the module, the traced call, its arguments and dynamic shapes) and the trace."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Collection, Iterator
from typing import Any

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls, ReplayAutocast, module_device_type, replay_autocast
from iobundle.errors import ExportError
from iobundle.replay.export._call_checks import ExportReport
from iobundle.replay.export._dims import GuardRemedy, _first_line, _Plan, derived_dims, program_batch_axes
from iobundle.replay.infer import (
    Alignment,
    DimNamesSpec,
    DynamicSpec,
    align_calls,
    fed_shapes,
    flat_dynamic_dims,
    infer_arguments,
    infer_dynamic_shapes,
    name_dims,
    named_dims_hint,
    select_call,
    spread_var_keyword,
    to_export_dims,
    to_torch_dims,
)
from iobundle.schema import ObjectNode


def signed_subclass(cls: type, forward: Any, signature: inspect.Signature, *aliases: str) -> type:
    """A subclass of ``cls`` whose ``forward`` (and ``aliases``) is ``forward``, carrying ``signature``.

    ``forward`` is looked up on the class, so each instance gets its own subclass; the signature
    gets ``self`` first, as a bound method needs.
    """
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    methods = dict.fromkeys(("forward", *aliases), forward)
    return type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__})


class _MethodAsModule(torch.nn.Module):
    """Exposes ``model.<method>`` as ``forward`` with an explicit signature (no ``**kwargs``).

    torch.export rejects ``dynamic_shapes`` for arguments collected by ``**kwargs``; listing
    the recorded names as keyword parameters avoids that.
    """

    def __new__(cls, model: torch.nn.Module, method_name: str, signature: inspect.Signature) -> _MethodAsModule:
        def forward(self: _MethodAsModule, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.model, self._method_name)(*args, **kwargs)

        return super().__new__(signed_subclass(cls, forward, signature))

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

        return super().__new__(signed_subclass(cls, forward, signature))

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
        if kind == inspect.Parameter.VAR_POSITIONAL or not (p.has_default or kind == inspect.Parameter.KEYWORD_ONLY):
            params.append(inspect.Parameter(p.name, kind))
        else:  # a keyword-only parameter without a default gets None
            params.append(inspect.Parameter(p.name, kind, default=p.default if p.has_default else None))
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in extra]
    return inspect.Signature(params)


def _same_parameters(model: torch.nn.Module, rc: RecordedCalls) -> bool:
    """Whether ``model.forward`` takes the parameters the calls were recorded with (names and kinds).

    A model recorded through a wrapper (a peft adapter's ``forward(*args, **kwargs)``) and exported
    as the module it wraps (merged: ``forward(x)``) is traced through the recorded signature, which
    the inferred dynamic shapes are keyed by.
    """
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return True
    recorded = [(p.name, p.kind) for p in rc.signature.parameters]
    return [(p.name, p.kind.name) for p in parameters] == recorded


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
    if flatten_var_kw or rc.signature.method != "forward" or not _same_parameters(model, rc):
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
