"""Re-run the eager model on the recorded inputs and compare with the recorded outputs (numerical drift)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls, module_device_type, replay_autocast, tensor_keys
from iobundle.errors import ReplayError
from iobundle.replay.check._compare import OutputCheck, Scratch, compare_call, flatten_outputs, output_paths
from iobundle.replay.check._tolerances import Tolerances, check_error_stat_name
from iobundle.replay.check._validate import (
    ValidationReport,
    _require_outputs,
    recorded_output_names,
    refuse_unknown_outputs,
    refuse_unused,
)
from iobundle.replay.infer import received_arguments

__all__ = ["rerun_model"]

logger = logging.getLogger(__name__)


def rerun_model(
    rc: RecordedCalls, model: torch.nn.Module, *, device: str | torch.device | None = None,
    on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
    tolerances: Tolerances | None = None,
) -> ValidationReport:  # fmt: skip
    """Call ``model`` again on the inputs of every recorded call and compare with the recorded outputs.

    This measures the numerical drift between the machine (or library versions) that recorded the
    bundle and this one: the same model, the same inputs, another run. Each call gets fresh copies
    of its recorded inputs (the model may update a cache in place), runs under ``torch.no_grad()``
    and under the ``torch.autocast`` it was recorded under (on the model's device type: a call
    recorded under CUDA autocast re-runs under CPU autocast of the same dtype on a CPU), and its outputs are compared output by output as in :func:`iobundle.replay.validate_onnx`.
    A call that raises is a failed row (its ``error`` says why); failed recorded calls are skipped.

    Args:
        rc: The recorded calls.
        model: The model; its observed method (``signature.method``) is called.
        device: Move the inputs there first (the model must already be there), e.g. ``"cuda"``.
        on_progress: Called with a :class:`~iobundle.replay.ProgressEvent` after each call.
        tolerances: The whole comparison as one value; without it, it is built from the keyword
            options ``atol``, ``rtol``, ``output_atol``, ``output_rtol``, ``check_error_stat`` and
            ``error_quantile``, which mean what they mean to :func:`iobundle.replay.check_discrepancies`.

    Returns:
        A :class:`ValidationReport` with ``kind="run"``; rows carry ``duration_torch`` (at capture)
        and ``duration_rerun`` (here).

    Raises:
        NothingToCompareError: No ok call has recorded outputs (a redacted bundle), as in ``validate_onnx``.
        ReplayError: The model has no method named like the recorded one.
        ToleranceError: A statistic is unknown, or a per-output tolerance names no output.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile)
    check_error_stat_name(tolerances.check_error_stat, tolerances.error_quantile)
    _require_outputs(rc)
    method = getattr(model, rc.signature.method, None)
    if not callable(method):
        raise ReplayError(
            f"The model ({type(model).__name__}) has no method {rc.signature.method!r}, the one the bundle recorded. "
            "Pass the model whose method was observed."
        )
    begin = time.perf_counter()
    calls = rc.ok_calls
    tolerances = tolerances.for_calls(calls)  # the report names the calls under torch.autocast
    device_type = torch.device(device).type if device is not None else module_device_type(model)
    refuse_unknown_outputs(tolerances, recorded_output_names(calls))  # before the run, not after it
    rows: list[dict[str, Any]] = []
    checks: list[OutputCheck] = []
    scratch = Scratch()
    notify(on_progress, "re-run", 0, len(calls))
    for done, call in enumerate(calls, start=1):
        expected = [rc.store.get(k) for k in tensor_keys(call.outputs)] if call.outputs is not None else []
        t0 = time.perf_counter()
        row: dict[str, Any]
        autocast = None
        try:
            args, kwargs = received_arguments(rc, call, device)
            autocast = replay_autocast(call.autocast, device_type)
            with torch.no_grad(), autocast.context() if autocast is not None else contextlib.nullcontext():
                obtained = flatten_outputs(method(*args, **kwargs))
            error = None
        except Exception as exc:  # a call the model cannot run is a failed row, not a crash
            obtained, error = (
                [],
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            )
        seconds = time.perf_counter() - t0
        if error is not None:
            row = {"SUCCESS": False, "error": error, "abs": float("nan"), "rel": float("nan"), "n": 0, "dnan": 0}
        else:
            row, call_checks = compare_call(
                expected, obtained, call_index=call.index, names=output_paths(call.outputs), tolerances=tolerances.for_call(call),
                scratch=scratch,
            )  # fmt: skip
            checks.extend(call_checks)
        row.update(index=call.index, duration_torch=call.latency, duration_rerun=seconds)
        if autocast is not None:
            row["ran"] = f"eager model under {autocast.describe()}, as recorded"
        rows.append(row)
        logger.debug("call %d re-run in %.3fs: %s", call.index, seconds, "ok" if row["SUCCESS"] else "differs")
        notify(on_progress, "re-run", done, len(calls), f"call {call.index}")
    refuse_unused(tolerances, checks)
    return ValidationReport(
        rows=rows, seconds=time.perf_counter() - begin, outputs=checks, tolerances=tolerances,
        subject=type(model).__name__, kind="run",
    )  # fmt: skip
