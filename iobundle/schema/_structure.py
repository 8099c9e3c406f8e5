"""The structure of a call: everything it holds but its tensor keys, as one hashable key.

Two calls have equal :func:`call_key` exactly when they hold the same positional count, keyword
names in the same order, the same node kinds, dict keys, class names, versions and contexts,
constants (value and type), opaque types and reasons, ``cst_kwargs`` and ``filled``, and (with
``outputs``) the same output tree: they differ at most in their tensors. The key is what
alignment caches per call (``iobundle.replay.infer``), what ``inspect`` groups consecutive calls
by (``iobundle.cli``), and what the compact manifest stores once (``structures``). Tensor keys are
appended to a list, in flattening order (inputs, then outputs), by the same walk.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from iobundle.schema._manifest import (
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

__all__ = ["call_key", "tree_key"]

_TENSOR, _NONE = "tensor", "none"


def _frozen(value: Any) -> Hashable:
    """A JSON value as a hashable key that tells ``1``, ``1.0`` and ``True`` apart."""
    cls = type(value)
    if cls is list:
        return (list, tuple(map(_frozen, value)))
    if cls is dict:
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    return (cls, value)


def tree_key(node: Node, keys: list[str]) -> Hashable:
    """The structure of ``node`` with its tensor keys erased; appends those keys to ``keys`` in flattening order."""
    cls = type(node)
    if cls is TensorNode:
        keys.append(node.key)  # type: ignore[union-attr]
        return _TENSOR
    if cls is NoneNode:
        return _NONE
    if cls is ListNode or cls is TupleNode:
        return (cls, _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if cls is DictNode:
        return (cls, tuple(node.keys), _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if cls is ObjectNode:
        context = node.context  # type: ignore[union-attr]
        frozen = context if context is None else _frozen(context)
        return (cls, node.type, node.version, frozen, _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if cls is ConstNode:
        value = node.value  # type: ignore[union-attr]
        return (cls, type(value), value)
    if cls is OpaqueNode:
        return (cls, node.type, node.reason)  # type: ignore[union-attr]
    _walk_keys(node, keys)  # a subclass of a node type: the generic walk
    return object()  # equal to nothing: a call holding one is a structure of its own


def _walk_keys(node: Node, keys: list[str]) -> None:
    if isinstance(node, TensorNode):
        keys.append(node.key)
    elif isinstance(node, (ListNode, TupleNode, DictNode, ObjectNode)):
        for child in node.items:
            _walk_keys(child, keys)


def _tree_keys(nodes: list[Node], keys: list[str]) -> tuple[Hashable, ...]:
    """:func:`tree_key` of each of ``nodes`` (tensors inline: most children are)."""
    result: list[Hashable] = []
    for node in nodes:
        if type(node) is TensorNode:
            keys.append(node.key)  # type: ignore[union-attr]
            result.append(_TENSOR)
        else:
            result.append(tree_key(node, keys))
    return tuple(result)


def call_key(call: CallEntry, keys: list[str], *, outputs: bool = False) -> Hashable:
    """The structure of ``call`` (see the module docstring); its tensor keys are appended to ``keys``.

    Args:
        call: A call entry of a manifest.
        keys: Receives the inputs' tensor keys, then (with ``outputs``) the outputs'.
        outputs: Whether the output tree is part of the structure.
    """
    kwargs, constants = call.kwargs, call.cst_kwargs
    key: tuple[Hashable, ...] = (
        _tree_keys(call.args, keys),
        tuple(kwargs),
        _tree_keys(list(kwargs.values()), keys) if kwargs else (),
        tuple([(k, type(v), v) for k, v in constants.items()]) if constants else (),
        tuple(call.filled),
    )
    if outputs:
        key += (None if call.outputs is None else tree_key(call.outputs, keys),)
    return key
