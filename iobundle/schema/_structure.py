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


def _frozen(context: object) -> Hashable:
    """A context as a hashable value that tells JSON values apart (``1``, ``1.0``, ``True``, ``"1"``)."""
    if type(context) is list and all(type(v) is str for v in context):
        return tuple(context)  # a cache's layer kinds: the common case, kept cheap
    return repr(context)  # distinct for distinct JSON values (a tuple never equals a str)


def tree_key(node: Node, keys: list[str]) -> Hashable:
    """The structure of ``node`` with its tensor keys erased; appends those keys to ``keys`` in flattening order."""
    if node.kind == "tensor":
        keys.append(node.key)
        return "tensor"
    if node.kind == "none":
        return "none"
    if node.kind == "list" or node.kind == "tuple":
        return (node.kind, _tree_keys(node.items, keys))
    if node.kind == "dict":
        return ("dict", tuple(node.keys), _tree_keys(node.items, keys))
    if node.kind == "node":
        frozen = node.context if node.context is None else _frozen(node.context)
        return ("node", node.type, node.version, frozen, _tree_keys(node.items, keys))
    if node.kind == "const":
        return ("const", type(node.value), node.value)
    return ("opaque", node.type, node.reason)


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
    if node.kind == "tensor":
        keys.append(node.key)
    elif node.kind == "list" or node.kind == "tuple" or node.kind == "dict" or node.kind == "node":
        for child in node.items:
            if child.kind == "tensor":
                keys.append(child.key)
            else:
                collect_tensor_keys(child, keys)
    return keys


def call_key(call: CallEntry, keys: list[str], *, outputs: bool = False) -> Hashable:
    """The structure of ``call`` (see the module docstring); its tensor keys are appended to ``keys``.

    Args:
        call: A call entry of a manifest.
        keys: Receives the inputs' tensor keys, then (with ``outputs``) the outputs' and the module state's.
        outputs: Whether the output tree and the module state are part of the structure.
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
        key += tuple(None if tree is None else tree_key(tree, keys) for tree in (call.outputs, call.state))
    return key
