"""Dimensions beyond what the calls show: the exported program on a batch size no call had.

A dimension is dynamic when its size varied across the recorded calls; one that never varied is
exported static (``iobundle.replay.infer.static_dim_hints`` names those that look like a batch or
a sequence). :func:`check_other_batch` runs an exported program whose batch is dynamic on a
recorded call cut (or repeated) to another batch size and compares it with the eager model and
the recorded outputs.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.replay.check import compare_outputs, flatten_outputs
from iobundle.replay.infer import Alignment, infer_arguments

__all__ = ["BatchCheck", "check_other_batch"]

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
        error: Why the check could not run, if it failed to.
    """

    call: int
    recorded_batch: int
    batch: int
    success: bool | None = False
    abs_eager: float | None = None
    abs_recorded: float | None = None
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            verdict = "failed: " if self.success is False else ""
            return f"batch {self.batch} (call {self.call} cut from batch {self.recorded_batch}): {verdict}{self.error}"
        parts = [f"max abs vs eager {self.abs_eager:.3g}" if self.abs_eager is not None else None]
        parts.append(f"vs recorded rows {self.abs_recorded:.3g}" if self.abs_recorded is not None else None)
        verdict = "ok" if self.success else "DIFFERS"
        detail = ", ".join(p for p in parts if p)
        return f"batch {self.batch} (call {self.call} cut from batch {self.recorded_batch}): {verdict} ({detail})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _resize(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``t`` with ``batch`` rows along dimension 0: its first rows, or its rows repeated."""
    if batch <= t.shape[0]:
        return t[:batch].clone()
    reps = -(-batch // t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].clone()


def check_other_batch(
    rc: RecordedCalls, plan: _Plan, ep: torch.export.ExportedProgram, *, atol: float, rtol: float
) -> BatchCheck:
    """Run ``ep`` and the eager model on the traced call cut to batch B - 1 (or repeated to 2 when B is 1).

    Only tensors whose dimension 0 is dynamic and equal to the call's batch are resized. The
    program's outputs are compared with the eager model's on the same inputs (the verdict), and
    with the recorded outputs resized the same way (reported, not judged).
    The eager model runs first: when it rejects the resized inputs (a VLM prefill whose image
    features are flattened across the batch), the check is inconclusive (``success=None``).
    Never raises: a failure is reported on the result.
    """
    alignment, index = plan.alignment, plan.traced
    call = alignment.calls[index]
    tensors = infer_arguments(rc, index, flat=True, alignment=alignment)
    sizes = collections.Counter(t.shape[0] for t, d in zip(tensors, plan.dims) if 0 in d and t.dim())
    recorded = sizes.most_common(1)[0][0] if sizes else 0
    result = BatchCheck(call=call.index, recorded_batch=recorded, batch=recorded - 1 if recorded > 1 else 2)
    try:
        keys = [f"\x02{i}" for i in range(len(tensors))]
        resized = {
            k: _resize(t, result.batch) if 0 in d and t.dim() and t.shape[0] == recorded else t
            for k, t, d in zip(keys, tensors, plan.dims)
        }

        def arguments() -> tuple[tuple[Any, ...], dict[str, Any]]:
            args, kwargs = infer_arguments(
                rc, alignment=alignment, slots=list(keys), extra=resized, as_args_kwargs=True
            )
            if plan.flatten_var_kw and rc.var_keyword in kwargs:
                kwargs = {**{k: v for k, v in kwargs.items() if k != rc.var_keyword}, **kwargs[rc.var_keyword]}
            return args, kwargs

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
    except Exception as exc:  # a report, never a crash: the recorded calls already passed
        result.success, result.error = False, _first_line(exc)
    logger.info("beyond the recorded calls: %s", result.summary())
    return result


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
