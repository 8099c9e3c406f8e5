"""The one path syntax for a tensor in a call: what reports show and what ``--atol NAME=...`` takes.

A path starts at an argument's name (``input_ids``) or, for outputs, at a field of the output
(``logits``); a lone output tensor is ``output``. A field of a dict or of a registered class whose
context names its items is ``.name`` (``outputs.logits`` is ``logits``: the output is the root);
any other item is ``[i]``: ``past_key_values[3]``, ``output[1]``, ``encoder_outputs.hidden_states[2]``.

Patterns (``Tolerances``, ``--atol``/``--rtol NAME=...``) are ``fnmatch`` patterns over paths in
which ``[``/``]`` are the path's own brackets, not character classes, and an index may also be
written the older way, as a dotted part: ``past_key_values.3``, ``past_key_values.*`` and
``past_key_values[*]`` all match ``past_key_values[3]``; a leading ``outputs.`` (the npz key of
an output) is dropped.

The stored path of a tensor (:func:`call_paths`: npz keys, a segment's tensor names) is another,
flat syntax that names every tensor of a call uniquely: ``args.0``, ``kwargs.past_key_values.3``,
``outputs.logits``, each part escaped (:func:`escape_key`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

from iobundle.schema import CallEntry, DictNode, ListNode, Node, ObjectNode, TensorNode, TupleNode

__all__ = ["OUTPUT_ROOT", "call_paths", "child_path", "escape_key", "item_labels", "path_matches", "tensor_paths"]

OUTPUT_ROOT = "output"


def item_labels(node: Node) -> list[str | None]:
    """The label of each item of a container: a dict's string keys, a registered class's named fields, else None.

    A registered class's context names its items only when it holds one label per item (a
    ``DynamicCache``'s ``["full", "full"]`` names its layers, not its 2 x layers tensors).
    """
    if isinstance(node, DictNode):
        return [k if isinstance(k, str) else None for k in node.keys]
    if isinstance(node, ObjectNode) and isinstance(node.context, list) and len(node.context) == len(node.items):
        return [k if isinstance(k, str) else None for k in node.context]
    return [None] * len(getattr(node, "items", ()))


def child_path(path: str, label: str | None, index: Any, *, root: str = OUTPUT_ROOT) -> str:
    """The path of an item: ``path.label`` (``label`` alone at the root), else ``path[index]`` (``root[index]``)."""
    if label:
        return f"{path}.{label}" if path else label
    return f"{path or root}[{index}]"


def tensor_paths(node: Node | None, path: str = "", *, root: str = OUTPUT_ROOT) -> list[tuple[str, TensorNode]]:
    """Each tensor of ``node`` with its path (see the module docstring), in flattening order.

    Args:
        node: A tree (an output, or one argument).
        path: The path of ``node`` itself: ``""`` for an output tree, an argument's name for an input.
        root: The name of an unnamed root: a lone tensor is ``root``, its items ``root[i]``.
    """
    leaves: list[tuple[str, TensorNode]] = []

    def walk(n: Node, at: str) -> None:
        if isinstance(n, TensorNode):
            leaves.append((at or root, n))
        elif isinstance(n, (ListNode, TupleNode, DictNode, ObjectNode)):
            keys = n.keys if isinstance(n, DictNode) else range(len(n.items))
            for label, key, child in zip(item_labels(n), keys, n.items):
                walk(child, child_path(at, label, key, root=root))

    if node is not None:
        walk(node, path)
    return leaves


_INDEX = re.compile(r"\[([^\]]*)\]")


def _dotted(path: str) -> str:
    """``a[3].b`` as ``a.3.b``: the form paths and patterns are compared in."""
    return _INDEX.sub(r".\1", path)


@functools.lru_cache(maxsize=1024)
def _pattern(pattern: str) -> re.Pattern[str]:
    text = _dotted(pattern.removeprefix("outputs."))
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text), re.DOTALL)


def path_matches(pattern: str, path: str) -> bool:
    """Whether the tensor at ``path`` is named by ``pattern`` (an exact path, or a pattern; see the module docstring)."""
    if pattern == path:
        return True
    dotted = _dotted(path)
    if _dotted(pattern.removeprefix("outputs.")) == dotted:
        return True
    return bool(_pattern(pattern).fullmatch(dotted))


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def escape_key(key: object) -> str:
    """``key`` as one part of a stored path: ``%XX`` (UTF-8 bytes) for each character but ``[A-Za-z0-9_-]``."""
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8", "surrogatepass")), str(key))


def _stored_paths(node: Node | None, prefix: str) -> Iterator[tuple[str, str]]:
    """``(path, key)`` of every tensor of ``node`` below ``prefix`` (used as it is), in flattening order."""
    if isinstance(node, TensorNode):
        yield prefix, node.key
    elif isinstance(node, (ListNode, TupleNode)):
        for i, item in enumerate(node.items):
            yield from _stored_paths(item, f"{prefix}.{i}")
    elif isinstance(node, DictNode):
        for key, item in zip(node.keys, node.items):
            yield from _stored_paths(item, f"{prefix}.{escape_key(key)}")
    elif isinstance(node, ObjectNode):
        context: Any = node.context
        named = (
            isinstance(context, list) and len(context) == len(node.items) and all(isinstance(c, str) for c in context)
        )
        for name, item in zip(context if named else range(len(node.items)), node.items):
            yield from _stored_paths(item, f"{prefix}.{escape_key(name)}")


def call_paths(call: CallEntry) -> list[tuple[str, str]]:
    """``(stored path, key)`` of every tensor of ``call``: ``args.0``, ``kwargs.NAME...``, ``outputs...``, ``state...``.

    The paths are unique within the call (every part escaped); a key passed twice has two paths.
    """
    pairs = [p for j, a in enumerate(call.args) for p in _stored_paths(a, f"args.{j}")]
    pairs += [p for k, v in call.kwargs.items() for p in _stored_paths(v, f"kwargs.{escape_key(k)}")]
    return pairs + list(_stored_paths(call.outputs, "outputs")) + list(_stored_paths(call.state, "state"))
