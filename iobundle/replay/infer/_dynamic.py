"""Dynamic shapes from aligned calls: which dimensions vary, which batch forcing adds, their names.

The result is plain data (:data:`DYNAMIC` or a name per dynamic dimension), so that inferring from
a bundle needs no torch; the stand-ins for absent tensors (:func:`_fill_tensor`) do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls import (
    RecordedCalls,
    TensorStore,
    map_structure,
    node_layout,
)
from iobundle.errors import AlignmentError, DynamicShapeError
from iobundle.replay.infer._align import Alignment, BatchSpec, DynamicSpec, align_calls
from iobundle.replay.infer._batch import batch_axes
from iobundle.replay.infer._dim_names import DimNamesSpec, name_dims
from iobundle.replay.infer._dynamic_dim import DYNAMIC
from iobundle.schema import (
    Node,
    ObjectNode,
    TensorNode,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def empty_dims(alignment: Alignment) -> list[int | None]:
    """Per slot, the dimension along which an absent tensor stands for an empty one, or None.

    It is the ``empty_dim`` of the node type directly holding the tensor in the best call
    (a KV cache: a layer not filled yet is a zero-length tensor along the sequence), read from
    its layout (:func:`~iobundle.calls.node_layout`): no provider runs, no library is imported.
    """
    result: list[int | None] = []

    def walk(node: Node, dim: int | None) -> None:
        if isinstance(node, TensorNode):
            result.append(dim)
            return
        items = getattr(node, "items", ())
        dims: list[int | None] = [dim] * len(items)
        if isinstance(node, ObjectNode):
            layout = node_layout(node.type, node.version)
            dims = [None if layout is None else layout.empty_dim] * len(items)
            if layout is not None and layout.child_empty_dims is not None:
                per_child = layout.child_empty_dims(node.context)
                dims = per_child if len(per_child) == len(items) else dims
        for child, child_dim in zip(items, dims, strict=True):
            walk(child, child_dim)

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
    """Per slot, the dimensions whose size differs across calls (plus the batch axis where ``batch`` asks, and ``dynamic``).

    The batch axis of each tensor is found from the sizes of the calls (see
    :mod:`iobundle.replay.infer._batch`); a tensor without one is left alone.

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
    batch_at = batch_axes(rc, alignment, batch)
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
        found = batch_at[index]
        if found is not None and found.axis is not None and found.axis < rank and found.axis not in dims:
            dims = sorted([found.axis, *dims])
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
    """Infer the ``dynamic_shapes`` argument of ``torch.export.export`` from ``rc``, torch-free.

    What ``Bundle.infer_dynamic_spec`` returns (the options: ``Bundle.infer_dynamic_shapes``); each
    dynamic dimension is :data:`DYNAMIC` (or its name), registered classes as lists of their children.
    """
    alignment = align_calls(rc)
    flat = flat_dynamic_dims(rc, alignment, set_batch_dimension_for, dynamic)
    names = None if dim_names is False else name_dims(rc, alignment, flat, dim_names, fed_shapes(rc, alignment))
    best = alignment.best_call
    it = iter(range(len(flat)))

    def leaf(_: TensorNode) -> dict[int, Any]:
        index = next(it)
        if names is None:
            return dict.fromkeys(flat[index], DYNAMIC)
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
    device = rc.store.device(key) if hasattr(rc.store, "device") else rc.store.get(key).device  # a file's: unread
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
