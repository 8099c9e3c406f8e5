"""What ``iobundle shapes`` prints: dynamic shapes (per keyword group, with batch axes) as Python-like text or JSON.

Strings from a bundle are drawn as text (:func:`iobundle._escape.terminal_text`); ``torch.export.Dim``
objects are recognised by their attributes, so nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from iobundle._escape import terminal_text

__all__ = [
    "BATCH_AXES_KEY",
    "GROUPS_KEY",
    "GROUPS_REASON",
    "dynamic_shapes_to_json",
    "format_batch_axes",
    "format_dynamic_shapes",
    "format_dynamic_shapes_json",
    "format_group_shapes",
    "format_group_shapes_json",
]

WIDTH = 100
"""Dynamic shapes longer than this are spread over several lines."""


def _hint_name(dim: Any) -> str | None:
    """``"DYNAMIC"`` for iobundle's marker and torch's, the name of torch's other hints (AUTO, STATIC), else None."""
    if isinstance(dim, str):
        return None
    from iobundle.replay import DYNAMIC  # loaded already: the shapes came from it

    if dim is DYNAMIC:
        return DYNAMIC.name
    hint = getattr(dim, "type", None)  # torch.export.Dim.DYNAMIC / AUTO / STATIC (a _DimHint)
    return str(hint.name) if hint is not None and hasattr(hint, "name") else None


def _dim_text(dim: Any) -> str:
    hint = _hint_name(dim)
    return repr(dim) if hint is None else f"Dim.{hint}"


def _dim_json(dim: Any) -> str:
    hint = _hint_name(dim)
    return str(getattr(dim, "__name__", dim)) if hint is None else hint


def _one_line(value: Any) -> str:
    if isinstance(value, dict):
        if value and all(isinstance(k, int) for k in value):
            return "{" + ", ".join(f"{k}: {_dim_text(v)}" for k, v in value.items()) + "}"
        return "{" + ", ".join(f"{k!r}: {_one_line(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        inner = ", ".join(_one_line(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_one_line(v) for v in value) + "]"
    return repr(value)


def _pretty(value: Any, indent: int) -> list[str]:
    line = _one_line(value)
    if len(line) + indent <= WIDTH or not isinstance(value, (dict, list, tuple)) or not value:
        return [line]
    if isinstance(value, dict) and all(isinstance(k, int) for k in value):
        return [line]  # a tensor's dims: never split
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        opening, closing = "{", "}"
        entries = [(f"{k!r}: ", v) for k, v in value.items()]
    else:
        opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        entries = [("", v) for v in value]
    lines = [opening]
    for prefix, item in entries:
        sub = _pretty(item, indent + 4 + len(prefix))
        lines.append(pad + prefix + sub[0])
        lines.extend(sub[1:])
        lines[-1] += ","
    lines.append(" " * indent + closing)
    return lines


def format_dynamic_shapes(dynamic_shapes: Any) -> str:
    """Python-like text of a ``dynamic_shapes`` structure: ``{'x': {0: Dim.DYNAMIC}}``, split when long."""
    return "\n".join(map(terminal_text, _pretty(dynamic_shapes, 0)))


def dynamic_shapes_to_json(dynamic_shapes: Any) -> Any:
    """The structure as JSON values: tuples become lists, dims ``"DYNAMIC"`` (a hint) or the ``Dim``'s name."""
    value = dynamic_shapes
    if isinstance(value, dict):
        if value and all(isinstance(k, int) for k in value):
            return {str(k): _dim_json(v) for k, v in value.items()}
        return {str(k): dynamic_shapes_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dynamic_shapes_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _dim_json(value)


#: The key of ``shapes --json`` that holds the batch axes (not an identifier: no parameter is called so).
BATCH_AXES_KEY = "$batch_axes"


def _group_batch_axes(batch_axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Consecutive tensors of one input with the same axis and reason, as one entry."""
    groups: list[dict[str, Any]] = []
    for found in batch_axes:
        last = groups[-1] if groups else None
        if last and (last["input"], last["axis"], last["reason"]) == (found.name, found.axis, found.reason):
            last["tensors"].append(found.position)
            continue
        groups.append({"input": found.name, "tensors": [found.position], "count": found.count,
                       "axis": found.axis, "reason": found.reason})  # fmt: skip
    return groups


def format_batch_axes(batch_axes: Sequence[Any]) -> str:
    """The batch axis taken in each input and why, as Python comments (the text stays Python)."""
    lines = ["# batch axes (the batch: the leading size of input_ids, or of the first input, in each call):"]
    for group in _group_batch_axes(batch_axes):
        tensors = group["tensors"]
        where = group["input"]
        if group["count"] > 1:
            where += (
                f" (tensors {tensors[0]}-{tensors[-1]} of {group['count']})" if len(tensors) > 1 else f"[{tensors[0]}]"
            )
        taken = "none" if group["axis"] is None else f"axis {group['axis']}"
        lines.append(f"#   {where}: {taken}: {group['reason']}")
    return "\n".join(map(terminal_text, lines))


def format_dynamic_shapes_json(dynamic_shapes: Any, batch_axes: Sequence[Any] | None = None) -> str:
    """``dynamic_shapes_to_json`` as indented JSON text, with the batch axes under :data:`BATCH_AXES_KEY` if given."""
    value = dynamic_shapes_to_json(dynamic_shapes)
    if batch_axes is not None and isinstance(value, dict):
        value[BATCH_AXES_KEY] = [
            {k: v for k, v in group.items() if k != "count"} for group in _group_batch_axes(batch_axes)
        ]
    return json.dumps(value, indent=2)


#: Why a bundle's calls have dynamic shapes per keyword group, not one set (inspect and shapes say it).
GROUPS_REASON = (
    "no call passes every keyword name the others pass, so export makes one program per group, "
    "each inferred from its calls alone"
)

#: The key of ``shapes --json`` that holds the keyword groups, in place of one set of shapes.
GROUPS_KEY = "$groups"


def format_group_shapes(group_shapes: Sequence[Any], *, header: bool = True) -> str:
    """Each keyword group's calls and keywords as a Python comment, then its shapes (and batch axes, if taken)."""
    lines = [f"# dynamic shapes per keyword group: {GROUPS_REASON}"] if header else []
    for found in group_shapes:
        lines.append(terminal_text("# " + found.group.describe()))
        lines.append(format_dynamic_shapes(found.dynamic_shapes))
        if found.batch_axes:
            lines.append(format_batch_axes(found.batch_axes))
    return "\n".join(lines)


def format_group_shapes_json(group_shapes: Sequence[Any], *, batch: bool = False) -> str:
    """The keyword groups as indented JSON under :data:`GROUPS_KEY`: calls, keywords, shapes (and batch axes)."""
    groups = []
    for found in group_shapes:
        entry: dict[str, Any] = {
            "calls": list(found.group.calls),
            "keywords": list(found.group.keywords),
            "absent": list(found.group.absent),
            "distinct": list(found.group.distinct),
            "dynamic_shapes": dynamic_shapes_to_json(found.dynamic_shapes),
        }
        if batch:
            entry["batch_axes"] = [
                {k: v for k, v in group.items() if k != "count"} for group in _group_batch_axes(found.batch_axes)
            ]
        groups.append(entry)
    return json.dumps({GROUPS_KEY: groups, "reason": GROUPS_REASON}, indent=2)
