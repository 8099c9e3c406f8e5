"""Align recorded calls: the best call, the layout, and where each call's tensors go in it.

The rules follow the InputObserver API (see DESIGN.md), with its known defects fixed:

- the "best" call is the first one with the most leaves (tensors, None, constants), as
  torch's pytree counts them; every call is aligned on it;
- the layout is the best call's structure, where an argument it holds no tensor in (absent,
  None, an empty container) takes its structure from the first call that has tensors there;
- an argument absent from a call (not passed, or None) becomes None slots; an argument that
  is present but holds no tensor where the layout has some (an empty cache) too;
- an argument present in two calls must hold the same number of tensors;
- some call must contain every keyword argument passed in any call;
- a dimension is dynamic when its size differs across calls, or when batch forcing says so.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from iobundle._units import format_calls
from iobundle.calls import (
    RecordedCalls,
    count_leaves,
    count_tensors,
    positional_names,
    tensor_keys,
)
from iobundle.errors import AlignmentError
from iobundle.schema import (
    CallEntry,
    DictNode,
    ListNode,
    Node,
    NoneNode,
    ObjectNode,
    TensorNode,
    TupleNode,
    call_key,
    deferred_shape,
)

__all__ = [
    "Alignment",
    "align_call",
    "align_calls",
    "call_shape",
]

BatchSpec = Collection[int | str] | bool | None
DynamicSpec = Mapping[int | str, Collection[int]] | None
"""Axes to make dynamic even if their size never varied: ``{"input_ids": {1}, "cache": {2}}``.

A key is an argument (a name, a position, or a name collected by ``**kwargs``); the axes apply
to every tensor of that argument with enough dimensions (negative axes count from the end)."""


@dataclass(frozen=True)
class Alignment:
    """Every ok call expressed as the best call's tensor slots.

    Attributes:
        calls: The ok calls, in recording order.
        best: Index in ``calls`` of the call whose structure every call is aligned on.
        slots: Per call, one tensor key or None per tensor of the layout.
        owners: Per slot, the positional index or keyword name of the argument it belongs to.
        layout: The best call, where it holds no tensor in an argument that other calls fill,
            with that argument's structure taken from the first call that has tensors there.
        observed_dims: Filled by :func:`flat_dynamic_dims`: per slot, the dimensions whose size
            differs across calls (its result without batch forcing nor ``dynamic``, computed once).
    """

    calls: list[CallEntry]
    best: int
    slots: list[list[str | None]]
    owners: list[int | str]
    layout: CallEntry
    observed_dims: list[list[int]] = field(default_factory=list, compare=False, repr=False)

    @property
    def best_call(self) -> CallEntry:
        """The layout every call is aligned on (the best call, completed)."""
        return self.layout

    @functools.cached_property
    def n_slots(self) -> dict[int | str, int]:
        """How many tensor slots each argument of the layout has (counted once, not per call)."""
        return dict(collections.Counter(self.owners))


def _n_leaves(call: CallEntry) -> int:
    return sum(count_leaves(a) for a in call.args) + sum(count_leaves(v) for v in call.kwargs.values())


def _is_absent(node: Node | None) -> bool:
    return node is None or isinstance(node, NoneNode)


def _bind_to_best(rc: RecordedCalls, call: CallEntry, best: CallEntry) -> tuple[list[Node], dict[str, Node]]:
    """Return ``call``'s arguments laid out like ``best``'s: same positional count, keywords by name."""
    args = list(call.args)
    kwargs = dict(call.kwargs)
    n_best = len(best.args)
    pos_names = positional_names(rc.signature)
    if len(args) > n_best:
        for i in range(n_best, len(args)):
            if i >= len(pos_names):
                var = rc.var_positional
                raise AlignmentError(
                    f"Call {call.index} passes {len(args)} positional arguments but call {best.index} passes "
                    f"{n_best}; the extra ones go to *{var[0] if var else 'args'} and cannot be moved to keywords. "
                    "Record a call that passes every variadic argument, or remove them with remove_inputs()."
                )
            if _is_absent(args[i]):
                continue  # a positional None is an absent argument, not a keyword the best call lacks
            name = pos_names[i]
            if name in kwargs:
                raise AlignmentError(f"Call {call.index}: argument {name!r} is given both by position and by name.")
            kwargs = {name: args[i], **kwargs}
        args = args[:n_best]
    elif len(args) < n_best:
        for i in range(len(args), n_best):
            param = pos_names[i] if i < len(pos_names) else None
            args.append(kwargs.pop(param) if param is not None and param in kwargs else NoneNode())
    return args, kwargs


class _CallShape(NamedTuple):
    """One call's inputs as a structure (hashable, tensor keys erased) and the keys it erased, in slot order."""

    key: Hashable
    keys: list[str]


def call_shape(call: CallEntry) -> _CallShape:
    """What alignment reads of ``call``: every input's structure and its constants; its keys apart.

    Alignment (:func:`_bind_to_best`, :func:`_complete`, :func:`_match`, :func:`align_call`) reads
    the number of positional arguments, keyword names and order, node kinds, dict keys, class
    names, lengths and constants, never a tensor key's value: two calls of one structure
    (``iobundle.schema.call_key``, which holds all that and more) align the same way, key for
    key. Computed once per call entry (entries are
    immutable) and kept while the entry lives: opening a bundle checks the keys with it, and
    inference reuses it.
    """
    deferred = deferred_shape(call)  # a call opened from format version 3: known per structure
    if deferred is not None:
        return _CallShape(*deferred)
    hit = _CALL_SHAPES.get(id(call))
    if hit is not None and hit[0]() is call:
        return hit[1]
    keys: list[str] = []
    structure = call_key(call, keys)
    shape = _CallShape(structure, keys)
    ref = _EntryRef(call, _forget_shape)
    ref.key = id(call)
    _CALL_SHAPES[ref.key] = (ref, shape)
    return shape


class _EntryRef(weakref.ref["CallEntry"]):
    """A weak reference to a call entry that remembers the ``id`` it is filed under."""

    __slots__ = ("key",)
    key: int


_CALL_SHAPES: dict[int, tuple[_EntryRef, _CallShape]] = {}
""":func:`call_shape` of each live call entry, by ``id``."""


def _forget_shape(ref: _EntryRef) -> None:
    hit = _CALL_SHAPES.get(ref.key)
    if hit is not None and hit[0] is ref:
        del _CALL_SHAPES[ref.key]


def align_calls(rc: RecordedCalls, *, memo: bool = True) -> Alignment:
    """Align every ok call of ``rc`` on its best call.

    The work is done once per distinct call structure (:func:`call_shape`), then each call's
    keys are put in the slots its structure maps them to; the result is computed once per
    version of ``rc`` (:meth:`RecordedCalls.touch` invalidates it).

    Args:
        rc: The recorded calls.
        memo: False aligns every call on its own and caches nothing: the reference the
            memoised path is tested against (the same result, slower on many calls).

    Raises:
        AlignmentError: No call was recorded, constants differ between calls, an argument holds a
            different number of tensors in two calls, or no call holds every keyword argument.
    """
    cached = _ALIGNED.get(id(rc)) if memo else None
    if cached is not None and cached[0]() is rc and cached[1] == _version(rc):
        return cached[2]
    calls = rc.ok_calls
    if not calls:
        raise AlignmentError(
            "No successful call was recorded. Run the model inside `with observer(model):` "
            "(failed calls are kept in the bundle but never used for inference)."
        )
    if not memo:
        counts = [_n_leaves(c) for c in calls]
        best_i = counts.index(max(counts))
        layout = _layout(rc, calls, calls[best_i])
        alignment = _new_alignment(calls, best_i, layout)
        alignment.slots.extend(align_call(rc, alignment, call) for call in calls)
        return alignment
    shapes = [call_shape(c) for c in calls]
    firsts: dict[Hashable, int] = {}  # per structure, its first call
    for i, shape in enumerate(shapes):
        firsts.setdefault(shape.key, i)
    leaves = {key: _n_leaves(calls[i]) for key, i in firsts.items()}
    counts = [leaves[shape.key] for shape in shapes]
    best_i = counts.index(max(counts))
    layout = _layout(rc, [calls[i] for i in firsts.values()], calls[best_i])
    alignment = _new_alignment(calls, best_i, layout)
    templates: dict[Hashable, list[int | None] | None] = {}
    for call, shape in zip(calls, shapes):
        if shape.key in templates:
            template = templates[shape.key]
            if template is not None:
                keys = shape.keys
                alignment.slots.append([None if i is None else keys[i] for i in template])
                continue
        slots = align_call(rc, alignment, call)
        alignment.slots.append(slots)
        if shape.key not in templates:
            templates[shape.key] = _template(slots, shape.keys)
    _ALIGNED[id(rc)] = (weakref.ref(rc, functools.partial(_forget, id(rc))), _version(rc), alignment)
    return alignment


_ALIGNED: dict[int, tuple[weakref.ref[RecordedCalls], tuple[int, int, int], Alignment]] = {}
"""The last alignment of each live :class:`RecordedCalls`, by ``id``, with the version it was computed at."""


def _version(rc: RecordedCalls) -> tuple[int, int, int]:
    """What invalidates a cached alignment: a touch, another list of calls, a call appended."""
    return rc.version, id(rc.calls), len(rc.calls)


def _forget(key: int, _: weakref.ref[RecordedCalls]) -> None:
    _ALIGNED.pop(key, None)


def _template(slots: list[str | None], keys: list[str]) -> list[int | None] | None:
    """``slots`` as positions in ``keys`` (the call's keys in flattening order); None if a key repeats."""
    positions = {key: i for i, key in enumerate(keys)}
    if len(positions) != len(keys) or not positions.keys() >= {key for key in slots if key is not None}:
        return None  # a tensor passed twice: which position a slot took is ambiguous, align such calls one by one
    return [None if key is None else positions[key] for key in slots]


def _new_alignment(calls: list[CallEntry], best_i: int, layout: CallEntry) -> Alignment:
    owners: list[int | str] = [i for i, a in enumerate(layout.args) for _ in range(count_tensors(a))]
    owners += [k for k, v in layout.kwargs.items() for _ in range(count_tensors(v))]
    return Alignment(calls=calls, best=best_i, slots=[], owners=owners, layout=layout)


def _layout(rc: RecordedCalls, calls: list[CallEntry], best: CallEntry) -> CallEntry:
    """``best`` with the parts where it holds no tensor but another call does taken from that call.

    The first of ``calls`` (in order) that holds tensors in such a part gives it; a call
    structured like one before it (:func:`call_shape`) gives nothing more, so ``calls`` may be
    the first call of each structure only.
    """
    args, kwargs = list(best.args), dict(best.kwargs)
    for call in calls:
        if call is best:
            continue
        try:
            call_args, call_kwargs = _bind_to_best(rc, call, best)
        except AlignmentError:
            continue  # align_call reports it
        args = [_complete(a, c) for a, c in zip(args, call_args)]
        kwargs = {k: _complete(v, call_kwargs[k]) if k in call_kwargs else v for k, v in kwargs.items()}
    if args == best.args and kwargs == best.kwargs:
        return best
    return best.model_copy(update={"args": args, "kwargs": kwargs})


def _complete(layout: Node, node: Node) -> Node:
    """``layout`` where a part holding no tensor (None, an empty container) is replaced by ``node``'s."""
    if count_tensors(node) == 0:
        return layout
    if count_tensors(layout) == 0:
        if isinstance(layout, (NoneNode, ListNode, TupleNode, DictNode, ObjectNode)):
            return node
        return layout  # a constant where another call has tensors: align_call reports it
    if isinstance(layout, DictNode) and isinstance(node, DictNode):
        children = dict(zip(node.keys, node.items))
        items = [_complete(item, children[k]) if k in children else item for k, item in zip(layout.keys, layout.items)]
        return layout.model_copy(update={"items": items})
    if (
        isinstance(layout, (ListNode, TupleNode, ObjectNode))
        and type(node) is type(layout)
        and len(node.items) == len(layout.items)
        and (not isinstance(layout, ObjectNode) or layout.type == getattr(node, "type", None))
    ):
        items = [_complete(a, b) for a, b in zip(layout.items, node.items)]
        return layout.model_copy(update={"items": items})
    return layout


def _match_tensors(node: Node, best: Node) -> list[str | None]:
    """The tensor keys of ``node`` laid out like ``best``'s tensors.

    Dicts are matched by key (a call may build its dicts in another order), and a part
    missing from ``node`` (an absent key, None where ``best`` has tensors) gives None slots.
    When the two trees differ otherwise, the keys are returned in flattening order.
    """
    matched = _match(node, best)
    return list(tensor_keys(node)) if matched is None else matched


def _match(node: Node, best: Node) -> list[str | None] | None:
    if isinstance(best, TensorNode):
        if isinstance(node, TensorNode):
            return [node.key]
        return [None] if isinstance(node, NoneNode) else None
    if isinstance(node, NoneNode):
        return [None] * count_tensors(best)
    if isinstance(best, DictNode):
        if not isinstance(node, DictNode) or not set(node.keys) <= set(best.keys):
            return None
        children = dict(zip(node.keys, node.items))
        result: list[str | None] = []
        for key, child in zip(best.keys, best.items):
            part = _match(children[key], child) if key in children else [None] * count_tensors(child)
            if part is None:
                return None
            result.extend(part)
        return result
    if isinstance(best, (ListNode, TupleNode, ObjectNode)):
        if type(node) is not type(best) or len(node.items) != len(best.items):
            return None
        if isinstance(best, ObjectNode) and getattr(node, "type", None) != best.type:
            return None
        result = []
        for child, best_child in zip(node.items, best.items):
            part = _match(child, best_child)
            if part is None:
                return None
            result.extend(part)
        return result
    return [] if count_tensors(node) == 0 else None


def align_call(rc: RecordedCalls, alignment: Alignment, call: CallEntry) -> list[str | None]:
    """Lay ``call`` out as the best call's tensor slots (None where absent)."""
    best = alignment.best_call
    if call.cst_kwargs != best.cst_kwargs:
        raise AlignmentError(
            f"Calls {best.index} and {call.index} pass different constants: {best.cst_kwargs} vs "
            f"{call.cst_kwargs}. One exported program cannot serve both; record calls that agree, "
            "or remove the argument with remove_inputs()."
        )
    args, kwargs = _bind_to_best(rc, call, best)
    extra = [k for k in kwargs if k not in best.kwargs]
    if extra:
        raise AlignmentError(
            f"Call {call.index} passes keyword argument(s) {extra} that call {best.index} (the call with the "
            f"most tensors) does not. At least one call to the observed model must contain every keyword argument: pass a "
            "placeholder with InputObserver(value_if_missing={...}) or remove it with remove_inputs()."
        )
    slots: list[str | None] = []
    pieces: list[tuple[int | str, Node | None, Node]] = [(i, args[i], a) for i, a in enumerate(best.args)]
    pieces += [(k, kwargs.get(k), v) for k, v in best.kwargs.items()]
    for owner, node, best_node in pieces:
        n = alignment.n_slots.get(owner, 0)
        keys = [] if node is None or _is_absent(node) else _match_tensors(node, best_node)
        if not any(k is not None for k in keys):
            slots.extend([None] * n)
            continue
        if len(keys) != n:
            what = f"Positional argument {owner}" if isinstance(owner, int) else f"Named argument {owner!r}"
            raise AlignmentError(
                f"{what} has {len(keys)} tensors in call {call.index} but {n} in call {best.index}. "
                "An argument present in two calls must flatten to the same number of tensors."
            )
        slots.extend(keys)
    return slots


def owner_name(rc: RecordedCalls, owner: int | str) -> str:
    """The name of an argument of :attr:`Alignment.owners` (a parameter name, else its position)."""
    if isinstance(owner, int) and owner < len(rc.names):
        return rc.names[owner]
    return str(owner)


def call_sizes(rc: RecordedCalls, alignment: Alignment, position: int) -> Callable[[str, int, int | None], int | None]:
    """``size(input, axis, item)`` of the ``position``-th aligned call, as :func:`iobundle.schema.sizes_match`
    asks it: that axis of the input's ``item``-th tensor (in the layout's order, None where the call
    lacks it), or of its first tensor present when ``item`` is None."""
    slots = alignment.slots[position]

    def size(name: str, axis: int, item: int | None = None) -> int | None:
        owned = [key for owner, key in zip(alignment.owners, slots) if owner_name(rc, owner) == name]
        if item is not None:
            owned = owned[item : item + 1]
        for key in owned:
            if key is not None:
                shape = rc.store.shape(key)
                return int(shape[axis]) if axis < len(shape) else None
            if item is not None:
                return None
        return None

    return size


def call_values(
    rc: RecordedCalls, alignment: Alignment, position: int
) -> Callable[[str], tuple[list[int], list[int]] | None]:
    """``value(input)`` of the ``position``-th aligned call, as :func:`iobundle.schema.values_match` asks it: the
    shape and flattened elements of the input's first tensor present (None without one, or for floats)."""
    slots = alignment.slots[position]

    def value(name: str) -> tuple[list[int], list[int]] | None:
        key = next((k for o, k in zip(alignment.owners, slots) if owner_name(rc, o) == name and k is not None), None)
        tensor = rc.store.get(key) if key is not None else None
        if tensor is None or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return None
        return list(tensor.shape), [int(v) for v in tensor.flatten().tolist()]

    return value


def call_structure(rc: RecordedCalls, alignment: Alignment, position: int) -> dict[str, str]:
    """The structure of the ``position``-th aligned call: per input, which of its tensors it holds.

    An input is ``absent`` when none of its tensors is there (not passed, None, a cache that
    holds no tensor yet, or a ``value_if_missing`` placeholder), ``empty`` when every tensor it
    holds has a zero-length dimension, ``K/N`` when only K of its N tensors are there.
    """
    call, slots = alignment.calls[position], alignment.slots[position]
    filled = {str(f) for f in call.filled}
    keys: dict[int | str, list[str | None]] = {}
    for owner, key in zip(alignment.owners, slots):
        keys.setdefault(owner, []).append(key)
    result = {}
    for owner, owned in keys.items():
        name = owner_name(rc, owner)
        present = [k for k in owned if k is not None]
        if not present or name in filled or str(owner) in filled:
            result[name] = "absent"
        elif all(0 in rc.store.shape(k) for k in present):
            result[name] = "empty"
        elif len(present) < len(owned):
            result[name] = f"{len(present)}/{len(owned)}"
        else:
            result[name] = "present"
    return result


@dataclass(frozen=True)
class KeywordGroup:
    """Recorded calls that pass the same keyword names, where no call passes every name the others pass.

    Attributes:
        calls: The recorded indices (``CallEntry.index``) of its calls, in recording order.
        keywords: The keyword names its calls pass, in the order the calls pass them.
        absent: The keyword names that only calls of other groups pass.
        distinct: The keyword names it passes that some other group does not: with ``absent``,
            what sets it apart.
    """

    calls: tuple[int, ...]
    keywords: tuple[str, ...]
    absent: tuple[str, ...]
    distinct: tuple[str, ...] = ()

    def describe(self) -> str:
        """``calls 1-2: pass states; not image (only other calls pass it)``: what sets the group apart."""
        calls = format_calls(self.calls)
        verb = "passes" if len(self.calls) == 1 else "pass"
        parts = [f"{verb} {', '.join(self.distinct)}"] if self.distinct else []
        if self.absent:
            it = "it" if len(self.absent) == 1 else "them"
            parts.append(f"not {', '.join(self.absent)} (only other calls pass {it})")
        return f"{calls}: {'; '.join(parts) or f'{verb} the keywords every call passes'}"


def keyword_groups(rc: RecordedCalls) -> list[KeywordGroup]:
    """The groups of calls passing the same keyword names, when the calls align only group by group; else ``[]``.

    When the calls align on one layout (:func:`align_calls`), there are no groups. When they
    cannot because no call passes every keyword name the others pass (Idefics' prefill passes
    ``pixel_values``; its decode calls pass, instead, the image states the prefill returned, as
    ``image_encoder_embeddings``), each set of keyword names that some calls pass is a group, in
    the order of its first call. Each group's calls are aligned on their own (:func:`phase_calls`):
    export makes one program per group, and ``inspect`` and ``shapes`` show the shapes of each.

    Raises:
        AlignmentError: The calls cannot be aligned, and some call passes every keyword name (the
            calls differ in something else: their constants, the number of tensors of an input).
    """
    try:
        align_calls(rc)
    except AlignmentError:
        by_names: dict[frozenset[str], list[CallEntry]] = {}
        for call in rc.ok_calls:
            by_names.setdefault(frozenset(call.kwargs), []).append(call)
        names = list(dict.fromkeys(name for call in rc.ok_calls for name in call.kwargs))
        if len(by_names) < 2 or any(len(key) == len(names) for key in by_names):
            raise  # some call passes every name: the calls fail to align for another reason (constants, sizes)
    else:
        return []
    everywhere = frozenset.intersection(*by_names)
    return [
        KeywordGroup(
            calls=tuple(c.index for c in calls),
            keywords=tuple(n for n in names if n in key),
            absent=tuple(n for n in names if n not in key),
            distinct=tuple(n for n in names if n in key and n not in everywhere),
        )
        for key, calls in by_names.items()
    ]


def call_structures(rc: RecordedCalls) -> list[tuple[int, dict[str, str]]]:
    """Each ok call's recorded index and structure (:func:`call_structure`), in recording order.

    When the calls align on one layout (:func:`align_calls`), that alignment gives them. When
    they align only in groups passing the same keyword names (:func:`keyword_groups`), each group
    is aligned on its own, and each structure also lists, as ``absent``, the keywords that only
    other groups pass: two calls of different groups never have the same structure, so each
    group is a phase of its own (one program each).

    Raises:
        AlignmentError: The calls cannot be aligned, and not because they pass different
            keyword names; or a group of calls passing the same names cannot be aligned.
    """
    groups = keyword_groups(rc)
    if not groups:
        alignment = align_calls(rc)
        return [(call.index, call_structure(rc, alignment, i)) for i, call in enumerate(alignment.calls)]
    result = []
    for found in groups:
        group = phase_calls(rc, found.calls)
        alignment = align_calls(group)
        for position, call in enumerate(alignment.calls):
            structure = call_structure(group, alignment, position)
            structure.update((name, "absent") for name in found.absent if name not in structure)
            result.append((call.index, structure))
    return sorted(result, key=lambda item: item[0])


def phase_calls(rc: RecordedCalls, indices: Collection[int]) -> RecordedCalls:
    """The recorded calls ``indices`` (``CallEntry.index``) as recorded calls of their own (same store)."""
    wanted = set(indices)
    return dataclasses.replace(rc, calls=[c for c in rc.calls if c.index in wanted], version=0)
