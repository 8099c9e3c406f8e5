"""Static axes that look like batch or sequence axes: exported static only because no call varied them.

A dimension is dynamic when its size varied across the recorded calls. One that never varied is
exported static, and the checks on the recorded calls cannot notice: a seq2seq decoder recorded
from one ``generate()`` accepts only the source length it was recorded with.
:func:`static_dim_hints` names such axes from the structure of the calls (one size at the batch
axis of every input, see :mod:`iobundle.replay.infer._batch`: a batch; an axis of one size shared by several inputs at sequence positions: a
prompt or encoder length), so that the user can make them dynamic (``dynamic=`` /
``--dynamic NAME:AXIS``). It reads shapes and dtype names only: no torch for a bundle.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from iobundle.calls import FLOATING_NAMES, RecordedCalls, TensorStore
from iobundle.replay.infer._align import BatchSpec, DynamicSpec, align_calls, owner_name
from iobundle.replay.infer._batch import find_batch_axes
from iobundle.replay.infer._dynamic import flat_dynamic_dims

__all__ = ["StaticDimHint", "static_dim_hints"]


@dataclass(frozen=True)
class StaticDimHint:
    """Axes exported static only because every recorded call had the same size there.

    Attributes:
        kind: ``"batch"`` (the batch axis of every input that has one) or ``"sequence"`` (an axis shared
            by several inputs).
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
                f"the batch axes ({where}) are {self.size} in every call: they look like the batch and are "
                "exported static. Make them dynamic with --batch-all (set_batch_dimension_for=True) if the model "
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


def _is_floating(store: TensorStore, key: str) -> bool:
    """Whether ``key`` holds floating-point numbers: from the manifest's dtype name when the store has it."""
    name = getattr(store, "safetensors_dtype", None)
    return store.dtype(key).is_floating_point if name is None else name(key) in FLOATING_NAMES


def static_dim_hints(rc: RecordedCalls, batch: BatchSpec = None, dynamic: DynamicSpec = None) -> list[StaticDimHint]:
    """Axes that look like batch or sequence axes and are static only because every call had the same size.

    Batch: the batch axis of the tensor inputs that have one (see
    :func:`iobundle.replay.infer.find_batch_axes`) has one size, shared by at least two inputs,
    and some of them are static. Sequence: a static axis at a sequence position (see
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
        floats.append(key is not None and _is_floating(rc.store, key))
    hints = []
    batched = [
        (i, found.axis, shape[found.axis])
        for i, (found, shape) in enumerate(zip(find_batch_axes(rc, alignment), shapes))
        if shape and found.axis is not None
    ]
    sizes = {size for _, _, size in batched}
    if len(sizes) == 1 and len({alignment.owners[i] for i, _, _ in batched}) > 1:
        static = [(owner_name(rc, alignment.owners[i]), axis) for i, axis, _ in batched if axis not in dims[i]]
        if static:
            hints.append(StaticDimHint("batch", sizes.pop(), tuple(static)))
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
