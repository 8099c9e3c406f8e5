"""Align recorded calls and infer ``torch.export`` arguments and ``dynamic_shapes`` from them.

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
import functools
import weakref
from collections.abc import Collection, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from iobundle.calls import (
    RecordedCalls,
    TensorStore,
    build_value,
    count_leaves,
    count_tensors,
    lookup_node_type,
    map_structure,
    positional_names,
    replace_tensors,
    tensor_keys,
)
from iobundle.errors import AlignmentError, DynamicShapeError, InputSelectionError
from iobundle.replay.infer._dim_names import DimNamesSpec, name_dims
from iobundle.schema import (
    CallEntry,
    ConstNode,
    DictNode,
    ListNode,
    Node,
    NoneNode,
    ObjectNode,
    OpaqueNode,
    TensorNode,
    TupleNode,
)

__all__ = [
    "call_shape",
    "collect_tensor_keys",
    "received_arguments",
    "spread_var_keyword",
    "Alignment",
    "align_call",
    "align_calls",
    "aligned_tensors",
    "infer_arguments",
    "infer_dynamic_shapes",
    "remove_inputs",
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


def _fingerprint(node: Node, keys: list[str]) -> Hashable:
    """The structure of ``node`` with its tensor keys erased; appends those keys to ``keys`` in flattening order.

    Two trees with equal fingerprints differ at most in their tensor keys and in the contexts
    of their registered classes, which alignment never reads (see :func:`call_shape`).
    """
    cls = type(node)
    if cls is TensorNode:
        keys.append(node.key)  # type: ignore[union-attr]
        return _TENSOR
    if cls is NoneNode:
        return _NONE
    if cls is ListNode or cls is TupleNode:
        return (cls, _fingerprints(node.items, keys))  # type: ignore[union-attr]
    if cls is DictNode:
        return (cls, tuple(node.keys), _fingerprints(node.items, keys))  # type: ignore[union-attr]
    if cls is ObjectNode:
        return (cls, node.type, node.version, _fingerprints(node.items, keys))  # type: ignore[union-attr]
    if cls is ConstNode:
        value = node.value  # type: ignore[union-attr]
        return (cls, type(value), value)
    if cls is OpaqueNode:
        return (cls, node.type)  # type: ignore[union-attr]
    keys.extend(tensor_keys(node))  # a subclass of a node type: the generic walk
    return object()  # equal to nothing: a call holding one is aligned on its own


def _fingerprints(nodes: list[Node], keys: list[str]) -> tuple[Hashable, ...]:
    """:func:`_fingerprint` of each of ``nodes`` (tensors inline: most children are)."""
    result: list[Hashable] = []
    for node in nodes:
        if type(node) is TensorNode:
            keys.append(node.key)  # type: ignore[union-attr]
            result.append(_TENSOR)
        else:
            result.append(_fingerprint(node, keys))
    return tuple(result)


_TENSOR, _NONE = "tensor", "none"
_CONTAINERS = frozenset({ListNode, TupleNode, DictNode, ObjectNode})
_LEAVES = frozenset({NoneNode, ConstNode, OpaqueNode})


def collect_tensor_keys(node: Node, keys: list[str]) -> None:
    """Append the tensor keys of ``node`` to ``keys`` in flattening order (``tensor_keys``, without a generator)."""
    cls = type(node)
    if cls is TensorNode:
        keys.append(node.key)  # type: ignore[union-attr]
    elif cls in _CONTAINERS:
        for child in node.items:  # type: ignore[union-attr]
            if type(child) is TensorNode:
                keys.append(child.key)  # type: ignore[union-attr]
            else:
                collect_tensor_keys(child, keys)
    elif cls not in _LEAVES:
        keys.extend(tensor_keys(node))  # a subclass of a node type: the generic walk


class _CallShape(NamedTuple):
    """One call's inputs as a structure (hashable, tensor keys erased) and the keys it erased, in slot order."""

    key: Hashable
    keys: list[str]


def call_shape(call: CallEntry) -> _CallShape:
    """What alignment reads of ``call``: every input's structure and its constants; its keys apart.

    Alignment (:func:`_bind_to_best`, :func:`_complete`, :func:`_match`, :func:`align_call`) reads
    the number of positional arguments, keyword names and order, node kinds, dict keys, class
    names, lengths and constants, never a tensor key's value nor a class's context: two calls of
    one shape align the same way, key for key. Computed once per call entry (entries are
    immutable) and kept while the entry lives: opening a bundle checks the keys with it, and
    inference reuses it.
    """
    hit = _CALL_SHAPES.get(id(call))
    if hit is not None and hit[0]() is call:
        return hit[1]
    keys: list[str] = []
    kwargs, constants = call.kwargs, call.cst_kwargs
    structure = (
        _fingerprints(call.args, keys),
        tuple(kwargs),
        _fingerprints(list(kwargs.values()), keys) if kwargs else (),
        tuple([(k, type(v), v) for k, v in constants.items()]) if constants else (),
    )
    shape = _CallShape(structure, keys)
    ref = _EntryRef(call, _forget_shape)
    ref.key = id(call)
    _CALL_SHAPES[ref.key] = (ref, shape)
    return shape


class _EntryRef(weakref.ref):  # type: ignore[type-arg]
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
        keys = [] if _is_absent(node) else _match_tensors(node, best_node)  # type: ignore[arg-type]
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


def _batch_forced(rc: RecordedCalls, owner: int | str, spec: BatchSpec) -> bool:
    if not spec:
        return False
    if spec is True:
        return True
    assert not isinstance(spec, bool)
    if owner in spec:
        return True
    return isinstance(owner, int) and owner < len(rc.names) and rc.names[owner] in spec


def empty_dims(alignment: Alignment) -> list[int | None]:
    """Per slot, the dimension along which an absent tensor stands for an empty one, or None.

    It is the ``empty_dim`` of the node type directly holding the tensor in the best call
    (a KV cache: a layer not filled yet is a zero-length tensor along the sequence).
    """
    result: list[int | None] = []

    def walk(node: Node, dim: int | None) -> None:
        if isinstance(node, TensorNode):
            result.append(dim)
            return
        if isinstance(node, ObjectNode):
            node_type = lookup_node_type(node.type)
            dim = None if node_type is None else node_type.empty_dim
        for child in getattr(node, "items", ()):
            walk(child, dim)

    best = alignment.best_call
    for node in [*best.args, *best.kwargs.values()]:
        walk(node, None)
    return result


def _forced_axes(rc: RecordedCalls, alignment: Alignment, dynamic: DynamicSpec) -> dict[int | str, set[int]]:
    """``dynamic`` keyed by the owners of :attr:`Alignment.owners` (positions of named parameters become names)."""
    if not dynamic:
        return {}
    owners = set(alignment.owners)
    result: dict[int | str, set[int]] = {}
    for key, axes in dynamic.items():
        owner: int | str = key
        if isinstance(key, int) and key not in owners and key < len(rc.names) and rc.names[key] in owners:
            owner = rc.names[key]
        elif isinstance(key, str) and key not in owners and key in rc.names and rc.names.index(key) in owners:
            owner = rc.names.index(key)
        if owner not in owners:
            inputs = ", ".join(
                str(rc.names[o]) if isinstance(o, int) and o < len(rc.names) else str(o)
                for o in dict.fromkeys(alignment.owners)
            )
            raise DynamicShapeError(
                f"dynamic={{{key!r}: ...}}: no recorded call passes a tensor in {key!r}. Inputs holding tensors: {inputs}."
            )
        result.setdefault(owner, set()).update(int(a) for a in axes)
    return result


def _shapes(store: TensorStore, keys: list[str]) -> list[tuple[int, ...]]:
    """The shapes of ``keys``: all at once when the store can (``store.shapes``), else one by one."""
    many = getattr(store, "shapes", None)
    return list(map(store.shape, keys)) if many is None else many(keys)


def flat_dynamic_dims(
    rc: RecordedCalls, alignment: Alignment, batch: BatchSpec = None, dynamic: DynamicSpec = None
) -> list[list[int]]:
    """Per slot, the dimensions whose size differs across calls (plus dim 0 where batch is forced, and ``dynamic``).

    A slot absent from some call whose node type declares an ``empty_dim`` counts as seen with
    size 0 along it (the prefill's empty cache), so that dimension is dynamic.

    Raises:
        DynamicShapeError: A tensor changes rank, or ``dynamic`` names an input or an axis no tensor has.
    """
    plain = not batch and not dynamic
    if plain and (alignment.observed_dims or not alignment.owners):
        return [list(dims) for dims in alignment.observed_dims]
    result = []
    empty = empty_dims(alignment)
    forced = _forced_axes(rc, alignment, dynamic)
    used: dict[int | str, set[int]] = {owner: set() for owner in forced}
    columns = list(zip(*alignment.slots))  # per slot, its key in every call
    for index, owner in enumerate(alignment.owners):
        column = columns[index]
        present = [key for key in column if key is not None]
        shapes = _shapes(rc.store, present)
        ranks = set(map(len, shapes))
        if len(ranks) > 1:
            raise DynamicShapeError(
                f"Tensor {index} of argument {owner!r} has different ranks across calls: {sorted(ranks)}. "
                "A dynamic shape cannot describe a change of rank; record calls of one rank."
            )
        rank = ranks.pop() if ranks else 0
        sizes = list(zip(*shapes))  # per dimension, its size in every call
        dims = [d for d in range(rank) if len(set(sizes[d])) > 1]
        empty_dim = empty[index]
        if empty_dim is not None and rank and len(present) < len(column):
            empty_dim %= rank
            if empty_dim not in dims and any(sizes[empty_dim]):
                dims = sorted([*dims, empty_dim])
        if rank and _batch_forced(rc, owner, batch) and 0 not in dims:
            dims = [0, *dims]
        for axis in forced.get(owner, ()):
            if -rank <= axis < rank:
                used[owner].add(axis)
                dims = sorted({*dims, axis % rank})
        result.append(dims)
    for owner, axes in forced.items():
        if axes - used[owner]:
            raise DynamicShapeError(
                f"dynamic={{{owner!r}: {sorted(axes)}}}: no tensor of {owner!r} has axis {sorted(axes - used[owner])[0]}; "
                "give an axis below the rank of the input's tensors."
            )
    if plain:
        alignment.observed_dims[:] = [list(dims) for dims in result]
    return result


def _post_process_var_keyword(rc: RecordedCalls, mapping: dict[str, Any]) -> dict[str, Any]:
    """Group names that are not parameters under the ``**kwargs`` parameter, as torch.export expects."""
    var_kw = rc.var_keyword
    if not var_kw:
        return mapping
    names = set(rc.names)
    extra = {k: v for k, v in mapping.items() if k not in names}
    if not extra:
        return mapping
    if var_kw in mapping:
        raise AlignmentError(
            f"A keyword argument is named {var_kw!r}, like the **{var_kw} parameter that collects extra keywords; "
            "torch.export cannot tell them apart. Rename it or remove it with remove_inputs()."
        )
    return {**{k: v for k, v in mapping.items() if k in names}, var_kw: extra}


def _assemble(
    rc: RecordedCalls, args: list[Any], kwargs: dict[str, Any], cst: dict[str, Any]
) -> tuple[Any, ...] | dict[str, Any]:
    """Shape ``args``/``kwargs`` (built from the best call) the way torch.export wants them."""
    var = rc.var_positional
    if not kwargs and not cst and not var:
        return tuple(args)
    if not args:
        return _post_process_var_keyword(rc, {**kwargs, **cst})
    if not var:
        return _post_process_var_keyword(rc, {**dict(zip(rc.names, args)), **kwargs, **cst})
    n_named = min(len(args), var[1])
    return _post_process_var_keyword(
        rc, {**dict(zip(rc.names[:n_named], args[:n_named])), var[0]: tuple(args[n_named:]), **kwargs, **cst}
    )


def infer_dynamic_shapes(
    rc: RecordedCalls,
    set_batch_dimension_for: BatchSpec = None,
    *,
    dim_names: DimNamesSpec = False,
    dynamic: DynamicSpec = None,
) -> tuple[Any, ...] | dict[str, Any]:
    """Infer the ``dynamic_shapes`` argument of ``torch.export.export`` from the recorded calls.

    Args:
        rc: The recorded calls.
        set_batch_dimension_for: Names or positions whose dim 0 is dynamic even if constant,
            or True for every input.
        dim_names: False for ``Dim.DYNAMIC``; True or a dict for names (strings), see
            :mod:`iobundle.replay.infer._dim_names`.
        dynamic: Axes to make dynamic even if their size never varied (see :data:`DynamicSpec`).

    Returns:
        A tuple when the best call passes positional tensors only, otherwise a dict by name;
        nested like the inputs, registered classes as lists of their children.
    """
    alignment = align_calls(rc)
    flat = flat_dynamic_dims(rc, alignment, set_batch_dimension_for, dynamic)
    names = None if dim_names is False else name_dims(rc, alignment, flat, dim_names, fed_shapes(rc, alignment))
    best = alignment.best_call
    it = iter(range(len(flat)))

    def leaf(_: TensorNode) -> dict[int, Any]:
        index = next(it)
        if names is None:
            return dict.fromkeys(flat[index], torch.export.Dim.DYNAMIC)
        return dict(names[index])

    ds_args = [map_structure(a, leaf) for a in best.args]
    ds_kwargs = {k: map_structure(v, leaf) for k, v in best.kwargs.items()}
    return _assemble(rc, ds_args, ds_kwargs, dict.fromkeys(best.cst_kwargs))


def _stand_in(
    rc: RecordedCalls, alignment: Alignment, index: int, dims: list[int], empty_dim: int | None = None
) -> tuple[str, list[int], bool]:
    """How an absent tensor is stood in for: the observed tensor it copies, the stand-in's shape, zeros or empty.

    It is the last observed tensor of the slot with its dynamic dimension set to 0 (``empty_dim``,
    see :func:`empty_dims`, when given, else the last dynamic one), or zeros of its shape when no
    dimension is dynamic; a tensor already empty stands for itself.
    """
    present = [key for s in alignment.slots if (key := s[index]) is not None]
    if not present:
        raise AlignmentError(f"No call holds tensor {index} of argument {alignment.owners[index]!r}.")
    key = present[-1]
    shape = list(rc.store.shape(key))
    if 0 in shape:
        return key, shape, False
    if empty_dim is not None:
        empty_dim %= len(shape)
    if not dims and empty_dim is None:
        return key, shape, True
    shape[empty_dim if empty_dim is not None else max(dims)] = 0
    return key, shape, False


def _fill_tensor(
    rc: RecordedCalls, alignment: Alignment, index: int, dims: list[int], empty_dim: int | None = None
) -> torch.Tensor:
    """A stand-in for an absent tensor (see :func:`_stand_in`)."""
    key, shape, zeros = _stand_in(rc, alignment, index, dims, empty_dim)
    if list(rc.store.shape(key)) == shape and not zeros:
        return rc.store.get(key)
    device = rc.store.get(key).device
    make = torch.zeros if zeros else torch.empty
    return make(shape, dtype=rc.store.dtype(key), device=device)


def fed_shapes(rc: RecordedCalls, alignment: Alignment) -> list[list[tuple[int, ...]]]:
    """Per slot, the shape of the tensor each call feeds the program (stand-ins for absent ones included)."""
    dims = flat_dynamic_dims(rc, alignment)
    empty = empty_dims(alignment)
    result: list[list[tuple[int, ...]]] = []
    for index in range(len(alignment.owners)):
        stand_in: tuple[int, ...] | None = None
        shapes = []
        for slots in alignment.slots:
            key = slots[index]
            if key is None:
                if stand_in is None:
                    stand_in = tuple(_stand_in(rc, alignment, index, dims[index], empty[index])[1])
                shapes.append(stand_in)
            else:
                shapes.append(tuple(rc.store.shape(key)))
        result.append(shapes)
    return result


def aligned_tensors(
    rc: RecordedCalls, alignment: Alignment, slots: list[str | None], extra: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The tensors of one aligned call, absent ones replaced by stand-ins (see :func:`_fill_tensor`)."""
    dims: list[list[int]] | None = None
    empty: list[int | None] = []
    result = []
    for index, key in enumerate(slots):
        if key is not None:
            result.append(extra[key] if extra and key in extra else rc.store.get(key))
            continue
        if dims is None:
            dims = flat_dynamic_dims(rc, alignment)
            empty = empty_dims(alignment)
        result.append(_fill_tensor(rc, alignment, index, dims[index], empty[index]))
    return result


def placeholder_inputs(alignment: Alignment, call: CallEntry, slots: list[str | None]) -> list[int | str]:
    """Inputs of ``call`` that were absent at capture and are fed a stand-in (empty tensor, zeros, placeholder).

    The model never saw those values: when such a call differs, it is reported as not checked
    rather than as a numeric mismatch (an empty stand-in for an absent cache usually matches;
    one for an absent mask usually does not).
    """
    owners = [alignment.owners[i] for i, key in enumerate(slots) if key is None]
    return list(dict.fromkeys([*call.filled, *owners]))


def _rebuild(rc: RecordedCalls, best: CallEntry, tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
    local = {f"\x00{i}": t for i, t in enumerate(tensors)}
    fresh: Iterator[Node] = (TensorNode(key=k) for k in local)
    args_nodes = [replace_tensors(a, fresh) for a in best.args]
    kwargs_nodes = {k: replace_tensors(v, fresh) for k, v in best.kwargs.items()}
    get = local.__getitem__
    args = [build_value(n, get, path=f"args[{i}]") for i, n in enumerate(args_nodes)]
    kwargs = {k: build_value(n, get, path=k) for k, n in kwargs_nodes.items()}
    return args, kwargs


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied into a storage of its own if it views a larger one (a bundle's memory-mapped file).

    Arguments handed to the user or to ``torch.export`` must not share one storage: ``torch.save``
    refuses views of one buffer as different dtypes, and torch.export bounds dynamic sizes by the
    storage a tensor views (a batch capped at what the file happens to hold).
    """
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def select_call(alignment: Alignment) -> int:
    """The call infer_arguments uses by default: the first laid out exactly like the best call."""
    best = alignment.best_call
    for i, call in enumerate(alignment.calls):
        if len(call.args) == len(best.args) and len(call.kwargs) == len(best.kwargs):
            return i
    return alignment.best


def infer_arguments(
    rc: RecordedCalls,
    index: int | None = None,
    *,
    flat: bool = False,
    as_args_kwargs: bool = False,
    alignment: Alignment | None = None,
    slots: list[str | None] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Build arguments for ``torch.export.export`` from one recorded call (absent inputs filled).

    Args:
        rc: The recorded calls.
        index: Which ok call to use; by default the first call laid out like the best call.
        flat: Return the flat list of tensors instead of the nested structure.
        as_args_kwargs: Always return ``(args, kwargs)``.
        alignment: A precomputed alignment.
        slots: Aligned tensor keys to use instead of a recorded call's.
        extra: Tensors for keys of ``slots`` that ``rc.store`` does not hold.

    Raises:
        AlignmentError: ``index`` is out of range, or the arguments cannot be laid out as asked.
    """
    alignment = alignment or align_calls(rc)
    if slots is None:
        if index is None:
            index = select_call(alignment)
        if not -len(alignment.calls) <= index < len(alignment.calls):
            raise AlignmentError(f"No recorded call {index}: there are {len(alignment.calls)} successful calls.")
        slots = alignment.slots[index]
    tensors = [_own_storage(t) for t in aligned_tensors(rc, alignment, slots, extra)]
    if flat:
        return tensors
    best = alignment.best_call
    args, kwargs = _rebuild(rc, best, tensors)
    kwargs = {**kwargs, **best.cst_kwargs}
    if as_args_kwargs:
        return tuple(args), kwargs
    if not kwargs:
        return tuple(args)
    if not args:
        return kwargs
    if rc.var_positional:
        raise AlignmentError(
            f"The arguments cannot be returned as one tuple or one dict because of *{rc.var_positional[0]} in "
            "the signature. Call infer_arguments(as_args_kwargs=True)."
        )
    return {**dict(zip(rc.names, args)), **kwargs}


def remove_inputs(rc: RecordedCalls, names: Collection[str]) -> int:
    """Remove the named inputs from every recorded call, as if they had never been passed.

    A positional argument followed by others in a call moves those to keywords.

    Returns:
        How many inputs were removed, summed over the calls (0 when no call passed any).

    Raises:
        InputSelectionError: A name is not a parameter, or removing it would need to pass an argument
            that follows ``*args`` by keyword (the message names the variadic).
    """
    names = set(names)
    params = set(rc.names)
    unknown = sorted(
        n for n in names if n not in params and not any(n in c.kwargs or n in c.cst_kwargs for c in rc.calls)
    )
    if unknown:
        raise InputSelectionError(
            f"remove_inputs: {unknown} are neither parameters of {rc.signature.method} nor recorded inputs."
        )
    pos_names = list(positional_names(rc.signature))
    var = rc.var_positional
    new_calls = []
    removed = 0
    for call in rc.calls:
        removed += sum(1 for k in call.kwargs if k in names) + sum(1 for k in call.cst_kwargs if k in names)
        removed += sum(1 for n, a in zip(pos_names, call.args) if n in names and not _is_absent(a))
        if var is not None and var[0] in names:
            removed += max(0, len(call.args) - var[1])
        args = list(call.args)
        kwargs = {k: v for k, v in call.kwargs.items() if k not in names}
        cst = {k: v for k, v in call.cst_kwargs.items() if k not in names}
        if var is not None and var[0] in names:
            args = args[: var[1]]
        cut = [i for i, n in enumerate(pos_names[: len(args)]) if n in names]
        if cut:
            first = cut[0]
            if len(args) > len(pos_names):
                raise InputSelectionError(
                    f"remove_inputs({sorted(names)}): call {call.index} passes positional arguments after "
                    f"{pos_names[first]!r} that belong to *{var[0] if var else 'args'}; they cannot become keywords. "
                    f"Remove *{var[0] if var else 'args'} too, or record calls that pass {pos_names[first]!r} by name."
                )
            moved = {}
            for i in range(first, len(args)):
                param = rc.parameter(pos_names[i])
                if pos_names[i] in names:
                    continue
                if param is not None and param.kind == "POSITIONAL_ONLY":
                    raise InputSelectionError(
                        f"remove_inputs: {pos_names[i]!r} is positional-only and follows a removed argument."
                    )
                moved[pos_names[i]] = args[i]
            args = args[:first]
            kwargs = {**moved, **kwargs}
            order = {n: i for i, n in enumerate(rc.names)}
            kwargs = dict(sorted(kwargs.items(), key=lambda kv: order.get(kv[0], len(order))))
        filled = [f for f in call.filled if f not in names]
        new_calls.append(call.model_copy(update={"args": args, "kwargs": kwargs, "cst_kwargs": cst, "filled": filled}))
    rc.calls = new_calls
    rc.value_if_missing = [v for v in rc.value_if_missing if v.key not in names]
    rc.touch()
    return removed


def received_arguments(
    rc: RecordedCalls, call: CallEntry, device: str | torch.device | None = None
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments the model received in ``call``, to call the eager model with (``run``, the export check).

    Fresh copies (the model may change its inputs in place; the store is read-only), moved to
    ``device`` when given; the placeholders the observer filled in for absent inputs
    (``value_if_missing``) are left out, as the model never saw them; constants included.
    """

    def tensor(key: str) -> torch.Tensor:
        t = rc.store.get(key).clone()
        return t.to(device) if device is not None else t

    names = list(positional_names(rc.signature))
    args = []
    for i, node in enumerate(call.args):
        filled = i in call.filled or (i < len(names) and names[i] in call.filled)
        args.append(None if filled else build_value(node, tensor, path=f"args[{i}]"))
    kwargs = {k: build_value(v, tensor, path=k) for k, v in call.kwargs.items() if k not in call.filled}
    kwargs.update(call.cst_kwargs)
    return args, kwargs


def spread_var_keyword(mapping: dict[str, Any], var_keyword: str | None) -> dict[str, Any]:
    """``mapping`` with the entries under ``**var_keyword`` spread among the others (``{**rest, **mapping[var_kw]}``)."""
    if not var_keyword or var_keyword not in mapping:
        return mapping
    return {**{k: v for k, v in mapping.items() if k != var_keyword}, **mapping[var_keyword]}
