"""Dimensions beyond what the calls show: static axes that look like batch or sequence axes, other batch sizes.

A dimension is dynamic when its size varied across the recorded calls. One that never varied is
exported static, and the checks on the recorded calls cannot notice: a seq2seq decoder recorded
from one ``generate()`` accepts only the source length it was recorded with.
:func:`static_dim_hints` names such axes from the structure of the calls (dimension 0 shared
by every input: a batch; an axis of one size shared by several inputs at sequence positions: a
prompt or encoder length), so that the user can make them dynamic (``dynamic=`` /
``--dynamic NAME:AXIS``). :func:`check_other_batch` runs an exported program whose batch is
dynamic on a recorded call cut (or repeated) to another batch size and compares it with the
eager model and the recorded outputs.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.replay.check import compare_outputs, flatten_outputs
from iobundle.replay.infer import (
    Alignment,
    BatchSpec,
    DynamicSpec,
    align_calls,
    flat_dynamic_dims,
    infer_arguments,
    owner_name,
)

__all__ = ["BatchCheck", "StaticDimHint", "check_other_batch", "static_dim_hints"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticDimHint:
    """Axes exported static only because every recorded call had the same size there.

    Attributes:
        kind: ``"batch"`` (dimension 0 of every input) or ``"sequence"`` (an axis shared by several inputs).
        size: The size every call had.
        axes: ``(input name, axis)`` pairs.
    """

    kind: str
    size: int
    axes: tuple[tuple[str, int], ...]

    @property
    def flags(self) -> str:
        """The ``--dynamic`` flags that make these axes dynamic."""
        return " ".join(f"--dynamic {name}:{axis}" for name, axis in dict.fromkeys(self.axes))

    def message(self) -> str:
        where = ", ".join(f"{name} axis {axis}" for name, axis in dict.fromkeys(self.axes))
        if self.kind == "batch":
            return (
                f"dimension 0 is {self.size} in every input of every call ({where}): it looks like the batch and is "
                "exported static. Make it dynamic with --batch-all (set_batch_dimension_for=True) if the model "
                "should accept other batch sizes."
            )
        return (
            f"{where} are {self.size} in every call: it looks like a sequence length (a prompt or encoder length) "
            f"and is exported static. Make it dynamic with {self.flags} (dynamic={{NAME: {{AXIS}}}}) if the model "
            "should accept other lengths."
        )


def _sequence_axis(shape: tuple[int, ...], floating: bool) -> int | None:
    """The axis of a tensor that holds positions in the usual layouts, or None.

    ``(B, S)`` ids and masks: 1; ``(B, S, D)`` hidden states: 1; ``(B, H, S, D)`` attention caches: 2.
    """
    rank = len(shape)
    if rank == 2 and not floating:
        return 1
    if rank == 3 and floating:
        return 1
    if rank == 4 and floating:
        return 2
    return None


def static_dim_hints(rc: RecordedCalls, batch: BatchSpec = None, dynamic: DynamicSpec = None) -> list[StaticDimHint]:
    """Axes that look like batch or sequence axes and are static only because every call had the same size.

    Batch: dimension 0 of every tensor input has one size, shared by at least two inputs, and
    some of them are static. Sequence: a static axis at a sequence position (see
    :func:`_sequence_axis`) of size above 1 whose size appears at such a position in at least
    two inputs (the encoder length in ``encoder_hidden_states``, the attention mask and the
    cross-attention cache).

    Raises:
        AlignmentError: The recorded calls cannot be aligned.
    """
    alignment = align_calls(rc)
    dims = flat_dynamic_dims(rc, alignment, batch, dynamic)
    shapes: list[tuple[int, ...] | None] = []
    floats: list[bool] = []
    for index in range(len(alignment.owners)):
        key = next((s[index] for s in alignment.slots if s[index] is not None), None)
        shapes.append(None if key is None else tuple(rc.store.shape(key)))
        floats.append(key is not None and rc.store.dtype(key).is_floating_point)
    hints = []
    firsts = {shape[0] for shape in shapes if shape}
    owners = {alignment.owners[i] for i, shape in enumerate(shapes) if shape}
    if len(firsts) == 1 and len(owners) > 1:
        static = [
            (owner_name(rc, alignment.owners[i]), 0) for i, shape in enumerate(shapes) if shape and 0 not in dims[i]
        ]
        if static:
            hints.append(StaticDimHint("batch", firsts.pop(), tuple(static)))
    by_size: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    for i, shape in enumerate(shapes):
        if not shape:
            continue
        axis = _sequence_axis(shape, floats[i])
        if axis is None or shape[axis] <= 1:
            continue
        dynamic_sizes = {shape[d] for d in dims[i]}
        if axis in dims[i] or shape[axis] in dynamic_sizes:
            continue
        by_size[shape[axis]].append((owner_name(rc, alignment.owners[i]), axis))
    for size, axes in sorted(by_size.items()):
        if len({name for name, _ in axes}) > 1:
            hints.append(StaticDimHint("sequence", size, tuple(dict.fromkeys(axes))))
    return hints


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

    Only tensors whose dimension 0 is dynamic and equal to the call's batch are resized; each run
    gets its own copies, since a model may update its inputs in place. The
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
            # Fresh copies for each run: a model may update its inputs in place (a state-space
            # cache's convolution and recurrent states), which must not reach the other run.
            fresh = {k: t.clone() for k, t in resized.items()}
            args, kwargs = infer_arguments(rc, alignment=alignment, slots=list(keys), extra=fresh, as_args_kwargs=True)
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
