"""Which axis of each recorded input is the batch: found from the sizes of the calls, not assumed to be 0.

``set_batch_dimension_for`` (``--batch``, ``--batch-all``) makes the batch axis of inputs
dynamic. The batch is not always axis 0: a vision-language decoder with 3-D rotary positions
passes ``position_ids`` of shape ``(3 or 4, batch, length)``. The rule, per tensor slot:

1. The batch of a call is the leading size of ``input_ids`` in that call, or, without
   ``input_ids``, of the first tensor input (the *reference*). A call without the reference
   says nothing about the batch and is skipped.
2. A *candidate* axis of a tensor has the size of the batch in every call that holds both
   the tensor and the reference (a size equal to the batch in one call only is a coincidence).
3. One candidate: it is the batch axis. Several (a ``(batch, heads, length, dim)`` cache with
   as many heads as rows): the axis the input's layout calls the batch (the conventional names
   of :mod:`iobundle.replay.infer._dim_names`: axis 1 of 3-D ``position_ids``, axis 0 of a
   cache layer) when it is one of them, else the first candidate. None: the input has no batch
   axis and is left alone.

An input named explicitly in ``set_batch_dimension_for`` for which no axis qualifies keeps
axis 0 (the user said it has a batch; the reason says that no size matched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from iobundle.calls import RecordedCalls
from iobundle.replay.infer import _dim_names

if TYPE_CHECKING:
    from iobundle.replay.infer._align import Alignment, BatchSpec

__all__ = ["BatchAxis", "batch_axes", "batch_forced", "find_batch_axes"]

_REFERENCE = "input_ids"


@dataclass(frozen=True)
class BatchAxis:
    """The batch axis found for one tensor slot, and why.

    Attributes:
        owner: The position or name of the argument holding the tensor.
        name: The argument's name (its position when it has none).
        position: The tensor's rank among the tensors of its argument.
        count: How many tensors the argument holds.
        axis: The batch axis, or None when the tensor has none.
        reason: Why that axis (or none) was taken, in words.
    """

    owner: int | str
    name: str
    position: int
    count: int
    axis: int | None
    reason: str

    @property
    def label(self) -> str:
        """``name``, or ``name[k]`` for the k-th tensor of a nested input."""
        return self.name if self.count == 1 else f"{self.name}[{self.position}]"


def _axes_text(axes: list[int]) -> str:
    return "axis " + str(axes[0]) if len(axes) == 1 else "axes " + ", ".join(map(str, axes))


def _reference_slot(slots: list[_dim_names._Slot], shapes: list[list[tuple[int, ...] | None]]) -> int | None:
    """The slot whose leading size is the batch: ``input_ids``, else the first tensor that has a dimension."""
    ranked = [i for i, per_call in enumerate(shapes) if any(s for s in per_call if s is not None)]
    named = [i for i in ranked if slots[i].name == _REFERENCE and slots[i].position == 0]
    return next(iter(named or ranked), None)


def find_batch_axes(rc: RecordedCalls, alignment: Alignment) -> list[BatchAxis]:
    """Per slot of ``alignment``, its batch axis and the reason (see the module docstring for the rule)."""
    slots = _dim_names._slots(rc, alignment)
    shapes: list[list[tuple[int, ...] | None]] = []
    for index in range(len(alignment.owners)):
        keys = [row[index] for row in alignment.slots]
        present = [k for k in keys if k is not None]
        many = getattr(rc.store, "shapes", None)
        found = iter(list(map(rc.store.shape, present)) if many is None else many(present))
        shapes.append([None if k is None else tuple(next(found)) for k in keys])
    reference = _reference_slot(slots, shapes)
    batches: list[int | None] = [None] * len(alignment.slots)
    if reference is not None:
        batches = [s[0] if s else None for s in shapes[reference]]
    known = sorted({b for b in batches if b is not None})
    result = []
    for index, slot in enumerate(slots):

        def make(axis: int | None, reason: str, slot: _dim_names._Slot = slot) -> BatchAxis:
            return BatchAxis(slot.owner, slot.name, slot.position, slot.count, axis, reason)

        seen = [(s, b) for s, b in zip(shapes[index], batches) if s is not None and b is not None]
        rank = max((len(s) for s, _ in seen), default=0)
        if index == reference:
            result.append(make(0, f"the reference: its leading size is the batch ({'/'.join(map(str, known))})"))
            continue
        if not seen or not rank:
            why = "a scalar" if seen else "never recorded in a call that holds the reference"
            result.append(make(None, f"no batch axis: {why}"))
            continue
        if len({len(s) for s, _ in seen}) > 1:  # the shape inference refuses it with a DynamicShapeError
            result.append(make(None, "no batch axis: its rank changes across calls"))
            continue
        candidates = [d for d in range(rank) if all(s[d] == b for s, b in seen)]
        coincidences = [d for d in range(rank) if d not in candidates and any(s[d] == b for s, b in seen)]
        note = f"; {_axes_text(coincidences)} equal the batch in some calls only" if coincidences else ""
        if not candidates:
            result.append(make(None, f"no batch axis: no axis has the batch's size in every call{note}"))
            continue
        if len(candidates) == 1:
            result.append(make(candidates[0], f"the only axis of the batch's size in every call{note}"))
            continue
        conventional = [d for d in candidates if _dim_names.conventional_name(slot, d, rank) == _dim_names.BATCH]
        if conventional:
            result.append(
                make(conventional[0], f"{_axes_text(candidates)} have the batch's size in every call; "
                     f"axis {conventional[0]} is the batch in the layout of {slot.name}")
            )  # fmt: skip
        else:
            result.append(
                make(candidates[0], f"{_axes_text(candidates)} have the batch's size in every call; the first is taken")
            )
    return result


def batch_forced(rc: RecordedCalls, owner: int | str, spec: BatchSpec) -> bool:
    """Whether ``spec`` (``set_batch_dimension_for``) asks for the batch of ``owner`` to be dynamic."""
    if not spec:
        return False
    if spec is True:
        return True
    assert not isinstance(spec, bool)
    if owner in spec:
        return True
    return isinstance(owner, int) and owner < len(rc.names) and rc.names[owner] in spec


def batch_axes(rc: RecordedCalls, alignment: Alignment, spec: BatchSpec) -> list[BatchAxis | None]:
    """Per slot, the batch axis ``spec`` makes dynamic (with its reason), or None where it asks for none.

    An input named explicitly whose tensor has no batch axis by the rule keeps axis 0.
    """
    if not spec:
        return [None] * len(alignment.owners)
    result: list[BatchAxis | None] = []
    for found in find_batch_axes(rc, alignment):
        if not batch_forced(rc, found.owner, spec):
            result.append(None)
        elif found.axis is None and spec is not True:
            result.append(
                BatchAxis(
                    found.owner, found.name, found.position, found.count, 0,
                    f"named in set_batch_dimension_for; axis 0 taken ({found.reason})",
                )
            )  # fmt: skip
        else:
            result.append(found)
    return result
