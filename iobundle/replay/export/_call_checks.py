"""What export reports, and the check of an exported program on every recorded call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.errors import ToleranceError
from iobundle.replay.check import Comparison, Tolerances, compare_outputs, flatten_outputs, output_paths
from iobundle.replay.export._dims import _Plan
from iobundle.replay.infer import infer_arguments, placeholder_inputs, received_arguments, spread_var_keyword

__all__ = ["CallCheck", "ExportReport"]


CHECK_TASK = "check exported program"


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
