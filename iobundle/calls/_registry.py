"""The registry of node types: classes a recorded tree may hold besides containers.

A node type turns an object into children (tensors, containers, other nodes) and a
JSON-able context, and back. Bundles name node types by a stable string; replay
resolves that string only through this registry, never by importing it. Reading a bundle's
shapes needs only a node type's layout (:func:`node_layout`), which the built-in node types
keep as plain data: that runs no provider, so it imports no library.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iobundle.calls._layouts import BUILTIN_LAYOUTS, Layout

__all__ = [
    "NodeType",
    "find_node_type",
    "lookup_node_type",
    "node_layout",
    "register_node_type",
    "register_provider",
]

Flatten = Callable[[Any], tuple[list[Any], Any]]
Unflatten = Callable[[list[Any], Any], Any]


@dataclass(frozen=True)
class NodeType:
    """How one class is stored in a recorded tree.

    Attributes:
        name: Stable name written in manifests, e.g. ``"transformers.DynamicCache"``.
        version: Version of the flattened layout; bumped when ``flatten`` changes.
        cls: The class handled (exact type match).
        flatten: ``obj -> (children, context)``; the context must be JSON-able and must not
            change between calls of the same structure (torch.export compares structures).
        unflatten: ``(children, context) -> obj``.
        empty_dim: For a container of growing tensors (a KV cache), the dimension along which a
            child that is None (a layer not filled yet) stands for a zero-length tensor. Shape
            inference then counts that dimension as seen with size 0, and fills the slot with
            a tensor empty along it. None: a None child is simply absent.
        child_empty_dims: ``context -> [empty_dim per child]``, for a container whose children do
            not all grow along one dimension (a cache holding keys and values besides convolution
            states); when given, it decides per child instead of ``empty_dim``.
    """

    name: str
    version: int
    cls: type
    flatten: Flatten
    unflatten: Unflatten
    empty_dim: int | None = None
    child_empty_dims: Callable[[Any], list[int | None]] | None = None


_LOCK = threading.Lock()
_BY_NAME: dict[str, NodeType] = {}
_BY_CLASS: dict[type, NodeType] = {}
# Providers register the node types of a whole library. One runs the first time a class of its
# module prefix is met (again for each new class: libraries define classes lazily), or when a
# name it owns is looked up.
_PROVIDERS: dict[str, Callable[[], None]] = {}
_PROVIDED: set[str] = set()
_MISSED: set[type] = set()


def register_node_type(node_type: NodeType) -> None:
    """Register ``node_type``; a later registration of the same name or class replaces it."""
    with _LOCK:
        old = _BY_NAME.pop(node_type.name, None)
        if old is not None:
            _BY_CLASS.pop(old.cls, None)
        _BY_NAME[node_type.name] = node_type
        _BY_CLASS[node_type.cls] = node_type


def register_provider(prefix: str, provider: Callable[[], None]) -> None:
    """Register a function that registers the node types of the library ``prefix`` on first use."""
    _PROVIDERS[prefix] = provider


def _run_provider(prefix: str) -> None:
    if prefix in _PROVIDERS:
        _PROVIDED.add(prefix)
        _PROVIDERS[prefix]()


def find_node_type(obj: Any) -> NodeType | None:
    """Return the node type for ``obj``'s exact class, or None."""
    cls = type(obj)
    node_type = _BY_CLASS.get(cls)
    if node_type is None and cls not in _MISSED:
        prefix = cls.__module__.split(".", 1)[0]
        if prefix in _PROVIDERS:
            _run_provider(prefix)
            node_type = _BY_CLASS.get(cls)
            if node_type is None:
                _MISSED.add(cls)
    return node_type


def lookup_node_type(name: str) -> NodeType | None:
    """Return the node type registered under ``name``, or None. Never imports ``name``."""
    node_type = _BY_NAME.get(name)
    if node_type is None:
        prefix = name.split(".", 1)[0]
        if prefix in _PROVIDERS and prefix not in _PROVIDED:
            _run_provider(prefix)
            node_type = _BY_NAME.get(name)
    return node_type


def node_layout(name: str, version: int) -> Layout | None:
    """Return the layout of node type ``name`` at ``version`` (registered, else built in), or None.

    Unlike :func:`lookup_node_type` it runs no provider: the layouts of the built-in node types
    (transformers' caches) are plain data, so reading a bundle's shapes imports neither
    transformers nor torch. A node type registered under ``name`` with another version has none.

    Example:
        >>> node_layout("transformers.DynamicCache", 1).empty_dim
        -2
    """
    node_type = _BY_NAME.get(name)
    if node_type is not None and node_type.version == version:
        return Layout(node_type.empty_dim, node_type.child_empty_dims)
    return BUILTIN_LAYOUTS.get((name, version))
