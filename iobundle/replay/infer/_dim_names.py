"""Names for the dynamic dimensions of recorded inputs (``infer_dynamic_shapes(dim_names=...)``).

``dim_names=True`` names every dynamic dimension from what was recorded (the user's view is
``Bundle.infer_dynamic_shapes``):

- dimensions whose sizes are equal in every call share one name (one symbol in the graph); an
  absent input counts with the stand-in it is fed (``infer_arguments``: the prefill's empty
  cache is zero-length along its sequence, with the batch of the other calls);
- well-known inputs get conventional names (``batch_size``, ``sequence_length``,
  ``past_sequence_length``, ...), by parameter name for plain tensors (``input_ids``,
  ``attention_mask``, ``pixel_values``, ``decoder_*``, ...) and by recorded structure for
  transformers caches under any argument name (self- and cross-attention caches, ``StaticCache``
  layers, sliding-window layers, whose length differs from the full layers');
- any other is ``<input>_dim_<d>`` (``<input>_<k>_dim_<d>`` for the k-th tensor of a nested input).

A dict names dimensions explicitly by input name or position (a list: one dict per tensor of a
nested input); what it leaves out is ``<input>_dim_<d>``, and what it names becomes dynamic.
``torch.onnx.export`` takes the result as is; :func:`to_export_dims` makes shared
``torch.export.Dim`` objects of the names for ``torch.export.export``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls import (
    DYNAMIC_CACHE_NAME,
    ENCODER_DECODER_CACHE_NAME,
    STATIC_CACHE_NAME,
    RecordedCalls,
    attention_name,
    dynamic_cache_parts,
)
from iobundle.errors import InputSelectionError
from iobundle.replay.infer._dynamic_dim import to_torch_dims
from iobundle.schema import Node, ObjectNode, TensorNode

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from iobundle.replay.infer._align import Alignment

__all__ = [
    "DimNamesSpec",
    "derive_dims",
    "name_dims",
    "named_dims_hint",
    "onnx_axis_names",
    "rename_onnx_axes",
    "to_export_dims",
]

#: ``True`` (derive names), or explicit names by input name or position.
DimNamesSpec = bool | Mapping[int | str, Any]

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"
ENCODER_SEQUENCE = "encoder_sequence_length"

# Conventional names of plain tensor inputs, by parameter name and rank: {rank: {dim: name}}.
# A rank absent from an entry gets no conventional name (the fallback applies).
_KNOWN_INPUTS: dict[str, dict[int, dict[int, str]]] = {
    "input_ids": {2: {0: BATCH, 1: SEQUENCE}},
    "inputs_embeds": {3: {0: BATCH, 1: SEQUENCE}},
    "token_type_ids": {2: {0: BATCH, 1: SEQUENCE}},
    "labels": {2: {0: BATCH, 1: SEQUENCE}},
    "hidden_states": {3: {0: BATCH, 1: SEQUENCE}},
    "position_embeddings": {3: {0: BATCH, 1: SEQUENCE}},
    "attention_mask": {2: {0: BATCH, 1: TOTAL}, 4: {0: BATCH, 2: SEQUENCE, 3: TOTAL}},
    "position_ids": {1: {0: SEQUENCE}, 2: {0: BATCH, 1: SEQUENCE}, 3: {1: BATCH, 2: SEQUENCE}},
    "cache_position": {1: {0: SEQUENCE}},
    "pixel_values": {
        4: {0: "num_images", 2: "height", 3: "width"},
        5: {0: BATCH, 1: "num_frames", 3: "height", 4: "width"},
    },
    "input_features": {3: {0: BATCH, 2: "feature_length"}},
    "input_values": {2: {0: BATCH, 1: "audio_length"}},
    "encoder_hidden_states": {3: {0: BATCH, 1: ENCODER_SEQUENCE}},
    "encoder_attention_mask": {2: {0: BATCH, 1: ENCODER_SEQUENCE}},
    "encoder_outputs": {3: {0: BATCH, 1: ENCODER_SEQUENCE}},
}
# Plain tensors passed as a cache (a legacy tuple of (key, value) pairs, or one tensor): (B, H, L, D).
_CACHE_PARAMETERS = frozenset({"cache", "past_key_values", "past_key_value", "past_key_values_cache"})
_DECODER_PREFIX = "decoder_"


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the layout sits: its input, its rank in that input, its role in a cache."""

    owner: int | str
    name: str
    position: int  # among the tensors of its input
    count: int  # tensors of its input
    cache: str | None = None  # "self", "cross", "static", "sliding"
    cache_part: str | None = None  # "key", "value", "length", "state", "indexer_key", "indexer_position"


def _input_name(rc: RecordedCalls, owner: int | str) -> str:
    if isinstance(owner, int):
        var = rc.var_positional
        if var is not None and owner >= var[1]:
            return f"{var[0]}_{owner - var[1]}"  # the n-th value of *args
        return rc.names[owner] if owner < len(rc.names) else f"arg{owner}"
    return owner


def _slots(rc: RecordedCalls, alignment: Alignment) -> list[_Slot]:
    """One :class:`_Slot` per tensor of the layout, in slot order."""
    layout = alignment.best_call
    result: list[_Slot] = []
    pieces: list[tuple[int | str, Node]] = [(i, a) for i, a in enumerate(layout.args)]
    pieces += list(layout.kwargs.items())
    for owner, node in pieces:
        found: list[tuple[str | None, str | None]] = []
        _walk(node, None, None, found)
        name = _input_name(rc, owner)
        result.extend(
            _Slot(owner=owner, name=name, position=k, count=len(found), cache=cache, cache_part=part)
            for k, (cache, part) in enumerate(found)
        )
    return result


def _walk(node: Node, cache: str | None, part: str | None, found: list[tuple[str | None, str | None]]) -> None:
    if isinstance(node, TensorNode):
        found.append((cache, part))
        return
    if isinstance(node, ObjectNode):
        items = node.items
        if node.type == ENCODER_DECODER_CACHE_NAME:
            for index, child in enumerate(items):
                _walk(child, "cross" if index == 1 else (cache or "self"), None, found)
            return
        if node.type == DYNAMIC_CACHE_NAME:
            parts = dynamic_cache_parts(node.context)
            for index, child in enumerate(items):
                kind, part = parts[index] if len(parts) == len(items) else (None, "key" if index % 2 == 0 else "value")
                role = cache or "self"
                sliding = isinstance(kind, dict) and (
                    "sliding" in kind or ("linear" in kind and attention_name(kind.get("attention")) == "sliding")
                )
                if sliding and role == "self":
                    role = "sliding"
                _walk(child, role, part, found)
            return
        if node.type == STATIC_CACHE_NAME:
            for index, child in enumerate(items):
                _walk(child, "static", ("key", "value", "length")[index % 3], found)
            return
    for child in getattr(node, "items", ()):
        _walk(child, cache, part, found)


def _cache_name(cache: str, prefix: str) -> str:
    if cache == "cross":
        return ENCODER_SEQUENCE
    if cache == "static":
        return "max_cache_length"
    if cache == "sliding":
        return f"{prefix}sliding_{PAST}"
    return f"{prefix}{PAST}"


def conventional_name(slot: _Slot, dim: int, rank: int) -> str | None:
    """The conventional name of dimension ``dim`` of a tensor of rank ``rank`` at ``slot``, if it has one."""
    name = slot.name
    prefix = ""
    if name.startswith(_DECODER_PREFIX):
        name, prefix = name[len(_DECODER_PREFIX) :], _DECODER_PREFIX
    if slot.cache is not None:
        if slot.cache_part == "length" or rank < 2:
            return None
        if dim == 0:
            return BATCH
        if slot.cache_part in ("state", "indexer_position"):  # no sequence axis at rank - 2
            return None
        if dim == rank - 2:
            return _cache_name(slot.cache, prefix)
        return None
    if name in _CACHE_PARAMETERS and rank == 4:
        return {0: BATCH, 2: f"{prefix}{PAST}"}.get(dim)
    found = _KNOWN_INPUTS.get(name, {}).get(rank, {}).get(dim)
    if found is None:
        return None
    return found if found == BATCH or not prefix else prefix + found


def fallback_name(slot: _Slot, dim: int) -> str:
    """``<input>_dim_<d>``, or ``<input>_<k>_dim_<d>`` for the k-th tensor of a nested input."""
    base = re.sub(r"\W", "_", slot.name)
    if not base or base[0].isdigit():
        base = f"arg_{base}"
    return f"{base}_dim_{dim}" if slot.count == 1 else f"{base}_{slot.position}_dim_{dim}"


def name_dims(
    rc: RecordedCalls,
    alignment: Alignment,
    flat: list[list[int]],
    spec: DimNamesSpec,
    shapes: list[list[tuple[int, ...]]],
) -> list[dict[int, str]]:
    """Per slot of ``alignment``, a name for each dynamic dimension (``flat``) and each explicitly named one.

    ``shapes`` gives, per slot, the shape each call feeds the program, stand-ins for absent
    tensors included (an empty cache layer is zero-length along its sequence): dimensions share
    a name when those sizes are equal in every call.

    Raises:
        InputSelectionError: ``spec`` names an input that is neither a parameter nor recorded,
            gives a dimension a tensor does not have, or is not a bool or a dict of dicts of names.
    """
    slots = _slots(rc, alignment)
    ranks = [len(per_call[0]) if per_call else 0 for per_call in shapes]
    if spec is True:
        return _derived_names(slots, ranks, flat, shapes)
    if not isinstance(spec, Mapping):
        raise InputSelectionError(
            f"dim_names: unexpected type {type(spec).__name__}; pass True (derive names) or a dict "
            "{input name or position: {dimension: name}}."
        )
    explicit = _explicit_names(rc, slots, ranks, spec)
    result = []
    for index, slot in enumerate(slots):
        names = {d: fallback_name(slot, d) for d in flat[index]}
        names.update(explicit[index])
        result.append(dict(sorted(names.items())))
    return result


def _derived_names(
    slots: list[_Slot], ranks: list[int], flat: list[list[int]], shapes: list[list[tuple[int, ...]]]
) -> list[dict[int, str]]:
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for index, dims in enumerate(flat):
        for d in dims:
            groups.setdefault(tuple(shape[d] for shape in shapes[index]), []).append((index, d))
    result: list[dict[int, str]] = [{} for _ in slots]
    used: set[str] = set()
    for members in groups.values():
        proposals = [conventional_name(slots[i], d, ranks[i]) for i, d in members]
        name = next((p for p in proposals if p is not None), None) or fallback_name(slots[members[0][0]], members[0][1])
        unique, n = name, 2
        while unique in used:
            unique, n = f"{name}_{n}", n + 1
        used.add(unique)
        for i, d in members:
            result[i][d] = unique
    return [dict(sorted(names.items())) for names in result]


def _explicit_names(
    rc: RecordedCalls, slots: list[_Slot], ranks: list[int], spec: Mapping[int | str, Any]
) -> list[dict[int, str]]:
    result: list[dict[int, str]] = [{} for _ in slots]
    recorded = {s.name for s in slots}
    for key, value in spec.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InputSelectionError(f"dim_names: unexpected type {type(key).__name__} for the key {key!r}.")
        if isinstance(key, int):
            if not 0 <= key < len(rc.names):
                raise InputSelectionError(
                    f"dim_names: position {key} is outside the signature of {rc.signature.qualname} ({rc.names})."
                )
            name = rc.names[key]
        else:
            name = key
        if name not in recorded and name not in rc.names:
            raise InputSelectionError(
                f"dim_names: {key!r} is neither a parameter of {rc.signature.qualname} nor a recorded input "
                f"(inputs: {sorted(recorded)})."
            )
        members = [i for i, s in enumerate(slots) if s.name == name]
        if not members:
            continue  # a parameter never passed: nothing to name
        per_tensor = _per_tensor(key, value, len(members))
        for i, dims in zip(members, per_tensor):
            for d, dim_name in dims.items():
                if isinstance(d, bool) or not isinstance(d, int) or not -ranks[i] <= d < ranks[i]:
                    raise InputSelectionError(
                        f"dim_names[{key!r}]: dimension {d!r} does not exist in its tensor {slots[i].position} "
                        f"of rank {ranks[i]}."
                    )
                if not isinstance(dim_name, str) or not dim_name:
                    raise InputSelectionError(f"dim_names[{key!r}][{d}]: a name is a non-empty str, got {dim_name!r}.")
                result[i][d % ranks[i]] = dim_name
    return result


def _per_tensor(key: int | str, value: Any, count: int) -> list[Mapping[Any, Any]]:
    if isinstance(value, Mapping):
        return [value] * count
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != count:
            raise InputSelectionError(
                f"dim_names[{key!r}] gives {len(value)} entries but the input holds {count} tensors; give one "
                "dict (or None) per tensor, or a single dict for all of them."
            )
        return [{} if v is None else _dims_dict(key, v) for v in value]
    raise InputSelectionError(
        f"dim_names[{key!r}]: expected a dict {{dimension: name}} or a list of them, got {type(value).__name__}."
    )


def _dims_dict(key: int | str, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise InputSelectionError(
            f"dim_names[{key!r}]: expected dicts {{dimension: name}}, got {type(value).__name__}."
        )
    return value


def derive_dims(
    sizes: Mapping[str, Sequence[int | None]], names: Collection[str]
) -> dict[str, tuple[str | None, int, int]]:
    """Derived dimensions among ``names``, inferred from the sizes each name had in the recorded calls.

    ``sizes`` gives, per name, its size in each recorded call (None where the call lacks it). A
    name whose size is ``k * B + c`` in every call, for a smaller name ``B`` of varying size and
    integers ``k >= 1``, ``c`` (the patches of a ViT's ``pixel_values`` and its patch mask: 28, 42,
    56 and 2, 3, 4; three calls at least when both ``k > 1`` and ``c != 0``), becomes ``(B, k, c)``: a ``torch.export`` derived dimension. A name tied to no
    other whose sizes are all multiples of some ``k > 1`` (sizes 28, 42, 56) becomes
    ``(None, k, 0)``: ``k`` times a dimension of its own. Names only of ``names`` are derived
    (those torch.export found constraints on); a name derived from another relates to its root.
    """
    import math

    chosen = sorted(sizes, key=lambda n: max((v for v in sizes[n] if v is not None), default=0))
    roots: list[str] = []
    derived: dict[str, tuple[str | None, int, int]] = {}
    for name in chosen:
        for root in roots if name in names else []:
            pairs = sorted({(b, a) for b, a in zip(sizes[root], sizes[name]) if a is not None and b is not None})
            if len({b for b, _ in pairs}) < 2 or (pairs[-1][1] - pairs[0][1]) % (pairs[-1][0] - pairs[0][0]):
                continue
            k = (pairs[-1][1] - pairs[0][1]) // (pairs[-1][0] - pairs[0][0])
            c = pairs[0][1] - k * pairs[0][0]
            # Two sizes fit a line of any slope: a relation with both k > 1 and c != 0 needs three. Equal
            # sizes are not derived: two names for one size is the caller's to merge (named_dims_hint).
            fits = all(a == k * b + c for b, a in pairs) and (len(pairs) > 2 or k == 1 or c == 0)
            if k >= 1 and fits and (k, c) != (1, 0):
                derived[name] = (root, k, c)
                break
        else:
            roots.append(name)
    for name in roots:
        k = math.gcd(*(v for v in sizes[name] if v is not None))
        if name in names and k > 1 and not any(r == name for r, _, _ in derived.values()):
            derived[name] = (None, k, 0)
    return derived


def to_export_dims(
    dynamic_shapes: Any, derived: Mapping[str, tuple[str | None, int, int]] | None = None
) -> tuple[Any, dict[str, str]]:
    """Replace every name in ``dynamic_shapes`` by one shared ``torch.export.Dim`` per name (and ``DYNAMIC`` by torch's).

    With ``derived`` (see :func:`derive_dims`), a name ``(root, k, c)`` is the derived dimension
    ``k * root + c`` (``k`` times a dimension of its own when ``root`` is None).

    Returns:
        The converted structure and, per ``Dim`` name, the name it stands for (names that are
        not Python identifiers get a sanitised ``Dim`` name).
    """
    dims: dict[str, Any] = {}
    originals: dict[str, str] = {}

    def dim(name: str) -> Any:
        if name not in dims:
            ident = re.sub(r"\W", "_", name)
            if not ident or ident[0].isdigit():
                ident = f"d_{ident}"
            base, n = ident, 2
            while ident in originals:
                ident, n = f"{base}_{n}", n + 1
            originals[ident] = name
            root, k, c = (derived or {}).get(name, (name, 1, 0))
            if root == name:
                dims[name] = torch.export.Dim(ident)
            else:
                unit = dim(root) if root is not None else torch.export.Dim(f"{ident}_over_{k}")
                dims[name] = k * unit + c if c else k * unit
        return dims[name]

    return to_torch_dims(dynamic_shapes, dim), originals


def rename_onnx_axes(model: Any, mapping: Mapping[str, str]) -> int:
    """Rename the symbolic dimensions of every value of an ``onnx_ir`` model (``s17`` -> ``batch_size``).

    A dimension that is an expression of symbols (``s17 + s27``) has each symbol renamed.

    Returns:
        The number of dimensions renamed.
    """
    if not mapping:
        return 0
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)) + r")\b")
    renamed = 0
    for value in _all_values(model.graph):
        shape = value.shape
        if shape is None:
            continue
        dims: list[Any] = []
        changed = False
        for d in shape:
            name = getattr(d, "value", None)  # an onnx_ir SymbolicDim; ints are static dimensions
            if isinstance(name, str):
                new = pattern.sub(lambda m: mapping[m.group(1)], name)
                if new != name:
                    dims.append(type(d)(new))
                    changed = True
                    renamed += 1
                    continue
            dims.append(d)
        if changed:
            value.shape = type(shape)(dims)
    return renamed


def _all_values(graph: Any) -> list[Any]:
    values = list(graph.inputs) + list(graph.outputs)
    for node in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
        values.extend(node.outputs)
    seen: set[int] = set()
    unique = []
    for v in values:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    return unique


def onnx_axis_names(ep: Any, inputs: Sequence[str], slot_names: Sequence[Mapping[int, str]]) -> dict[str, str]:
    """Map the symbols of ``ep``'s tensor inputs (``s17``) to the names of their dimensions.

    ``inputs`` are the names of the program's tensor inputs, one per slot, in slot order. A
    symbol already named keeps its first name (two names torch.export proved equal).
    """
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    mapping: dict[str, str] = {}
    for input_name, names in zip(inputs, slot_names):
        node = placeholders.get(input_name)
        value = None if node is None else node.meta.get("val")
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        for d, name in names.items():
            size = shape[d] if d < len(shape) else None
            if isinstance(size, torch.SymInt):
                symbol = str(size.node.expr)
                if symbol.isidentifier():
                    mapping.setdefault(symbol, name)
    return mapping


def named_dims_hint(message: str) -> str:
    """What to do when torch.export refuses named dimensions: its suggested fixes, and the way out."""
    if "Suggested fixes" not in message:
        return ""
    fixes = [line.strip() for line in message.split("Suggested fixes:", 1)[1].splitlines() if "=" in line]
    fixes = [f for f in fixes if not f.startswith(("The error", "If you"))][:5]
    return (
        f"\ntorch.export proved relations between named dimensions: {'; '.join(fixes)}. Give equal dimensions "
        "one name with dim_names={input: {dim: name}}, or export without dim_names."
    )
