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

from iobundle.schema._manifest import CallEntry, Node, TensorNode

__all__ = ["call_key", "collect_tensor_keys", "tree_key"]

_CONTAINERS = frozenset({"list", "tuple", "dict", "node"})


def _frozen(context: object) -> Hashable:
    """A context as a hashable value that tells JSON values apart (``1``, ``1.0``, ``True``, ``"1"``)."""
    if type(context) is list and all(type(v) is str for v in context):
        return tuple(context)  # a cache's layer kinds: the common case, kept cheap
    return repr(context)  # distinct for distinct JSON values (a tuple never equals a str)


def tree_key(node: Node, keys: list[str]) -> Hashable:
    """The structure of ``node`` with its tensor keys erased; appends those keys to ``keys`` in flattening order."""
    kind = node.kind
    if kind == "tensor":
        keys.append(node.key)  # type: ignore[union-attr]
        return kind
    if kind == "none":
        return kind
    if kind == "list" or kind == "tuple":
        return (kind, _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if kind == "dict":
        return (kind, tuple(node.keys), _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if kind == "node":
        context = node.context  # type: ignore[union-attr]
        frozen = context if context is None else _frozen(context)
        return (kind, node.type, node.version, frozen, _tree_keys(node.items, keys))  # type: ignore[union-attr]
    if kind == "const":
        value = node.value  # type: ignore[union-attr]
        return (kind, type(value), value)
    return (kind, node.type, node.reason)  # type: ignore[union-attr]  # opaque


def _tree_keys(nodes: list[Node], keys: list[str]) -> tuple[Hashable, ...]:
    """:func:`tree_key` of each of ``nodes`` (tensors inline: most children are)."""
    result: list[Hashable] = []
    for node in nodes:
        if type(node) is TensorNode:
            keys.append(node.key)
            result.append("tensor")
        else:
            result.append(tree_key(node, keys))
    return tuple(result)


def collect_tensor_keys(node: Node, keys: list[str]) -> list[str]:
    """Append the tensor keys of ``node`` to ``keys`` in flattening order; return ``keys``."""
    kind = node.kind
    if kind == "tensor":
        keys.append(node.key)  # type: ignore[union-attr]
    elif kind in _CONTAINERS:
        for child in node.items:  # type: ignore[union-attr]
            if child.kind == "tensor":
                keys.append(child.key)  # type: ignore[union-attr]
            else:
                collect_tensor_keys(child, keys)
    return keys


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
