"""Dynamic shapes of calls that align only group by group: one set of shapes per keyword group.

A bundle whose calls pass different keyword names, none passing them all (a cross-attention
VLM's prefill passes ``pixel_values``, its decode calls the image states instead), has no single
``dynamic_shapes``: export makes one program per :class:`~iobundle.replay.infer.KeywordGroup`,
and each group's shapes are inferred from its calls alone, as that program's export infers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from iobundle.calls import RecordedCalls
from iobundle.replay.infer._align import BatchSpec, DynamicSpec, KeywordGroup, align_calls, keyword_groups, phase_calls
from iobundle.replay.infer._batch import BatchAxis, batch_axes
from iobundle.replay.infer._dim_names import DimNamesSpec
from iobundle.replay.infer._dynamic import infer_dynamic_shapes

__all__ = ["GroupShapes", "infer_group_shapes"]


@dataclass(frozen=True)
class GroupShapes:
    """The dynamic shapes of one keyword group's calls.

    Attributes:
        group: The calls and the keyword names they pass (and do not).
        dynamic_shapes: What :func:`~iobundle.replay.infer.infer_dynamic_shapes` infers from them.
        batch_axes: The batch axis taken in each tensor the batch spec selects (empty without one).
    """

    group: KeywordGroup
    dynamic_shapes: tuple[Any, ...] | dict[str, Any]
    batch_axes: tuple[BatchAxis, ...] = ()


def _without(spec: Any, absent: tuple[str, ...]) -> Any:
    """A batch, ``dynamic`` or ``dim_names`` spec without the inputs ``absent`` (only other groups pass them)."""
    if spec is None or isinstance(spec, bool):
        return spec
    if isinstance(spec, Mapping):
        return {k: v for k, v in spec.items() if k not in absent}
    return [k for k in spec if k not in absent]


def infer_group_shapes(
    rc: RecordedCalls,
    set_batch_dimension_for: BatchSpec = None,
    *,
    dim_names: DimNamesSpec = False,
    dynamic: DynamicSpec = None,
) -> list[GroupShapes]:
    """Per keyword group (:func:`~iobundle.replay.infer.keyword_groups`), the shapes of its calls; ``[]`` without groups.

    See ``Bundle.infer_group_shapes``; a keyword only other groups pass is left out of a group's options.
    """
    result = []
    for group in keyword_groups(rc):
        calls = phase_calls(rc, group.calls)
        spec, axes = _without(set_batch_dimension_for, group.absent), _without(dynamic, group.absent)
        names_spec = _without(dim_names, group.absent)
        shapes = infer_dynamic_shapes(calls, spec, dim_names=names_spec, dynamic=axes)
        found = batch_axes(calls, align_calls(calls), spec) if spec else []
        result.append(GroupShapes(group, shapes, tuple(a for a in found if a is not None)))
    return result
