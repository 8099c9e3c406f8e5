"""Convert Python values to recorded trees (``iobundle.schema`` nodes) and back.

A tree holds containers, None, scalars, tensor references (by key) and instances of
registered classes. Only tensors are leaves for alignment and shape inference;
scalars and None inside a tree are part of its structure.
"""

from __future__ import annotations

import itertools
import json
import operator
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls._paths import OUTPUT_ROOT, child_path, item_labels
from iobundle.calls._registry import find_node_type, lookup_node_type
from iobundle.errors import AlignmentError, UnsafeBundleError
from iobundle.schema import (
    ConstNode,
    DictNode,
    ListNode,
    Node,
    NoneNode,
    ObjectNode,
    OpaqueNode,
    TensorNode,
    TupleNode,
    collect_tensor_keys,
)

if TYPE_CHECKING:
    import torch
    import torch.utils._pytree as torch_pytree
else:
    torch = lazy_module("torch", globals())
    torch_pytree = lazy_module("torch.utils._pytree", globals(), "torch_pytree")

__all__ = [
    "NONE_NODE",
    "PYTREE_PREFIX",
    "TensorCollector",
    "build_value",
    "count_leaves",
    "count_tensors",
    "iter_tensor_nodes",
    "map_structure",
    "qualified_name",
    "record_value",
    "replace_tensors",
    "tensor_keys",
]

NONE_NODE = NoneNode()
PYTREE_PREFIX = "pytree:"
_SCALARS = (bool, int, float, str)
_CONTAINER_TYPES = frozenset({list, tuple, dict})


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_KEY_SET = {"key"}
"""The fields set of every tensor node the collector makes: one object for all (frozen models never change
it; a copy gets its own). With :class:`_Seen`, a recorded tensor leaves two objects for Python's cyclic
collector to track, not four: its full collections walk what calls retain, so this is a cost per tensor.
An entry leaves soon after its tensor is freed (a cache's tensors, replaced at the next step)."""


_new, _set = object.__new__, object.__setattr__
_deref: Callable[[Any], Any] = weakref.ref.__call__  # a weak reference's object (or None), for map()
_VERSION = operator.attrgetter("_version")


def _key_node(key: str) -> TensorNode:
    """``TensorNode(key=key)`` for a key the collector made (``t123``), built as ``model_construct`` builds it
    (0.53 µs where validating and sharing the fields set took 0.74): once per new tensor of every call."""
    node = _new(TensorNode)
    _set(node, "__dict__", {"kind": "tensor", "key": key})
    _set(node, "__pydantic_fields_set__", _KEY_SET)
    _set(node, "__pydantic_extra__", None)
    _set(node, "__pydantic_private__", None)
    return node


class _Seen(weakref.ref["torch.Tensor"]):
    """A tensor met while recording, by weak reference, with what tells whether it changed since, and its node.

    No callback: a cache's tensors die every step, inside the model's forward, which a call per tensor
    would slow down. An entry whose tensor is gone stays until its id is met again or the next sweep
    (:meth:`TensorCollector._sweep`); every look-up checks the reference first.
    """

    __slots__ = ("layout", "node", "version")
    node: TensorNode
    layout: int
    """The hash of the tensor's shape and strides (:func:`_layout`)."""
    version: int


_SWEEP_MIN = 1024
"""The collector looks for entries of tensors gone once it holds this many, or twice as many as after the last look."""


def _layout(tensor: torch.Tensor) -> int:
    """The hash of ``tensor``'s shape and strides, which ``t.data = other`` changes without its version counter.

    An int, where two tuples would be two more objects per recorded tensor for Python's cyclic collector
    to count and walk while the tensor lives (a decode step's cache: 128 at 32 layers).
    """
    return hash((tensor.shape, tensor.stride()))


class TensorCollector:
    """Gives each tensor met while recording a key, storing a snapshot once per distinct tensor.

    Two references to the same tensor (same object, unchanged version counter, shape and strides)
    get the same key, within a call and across calls, so a tensor passed to many calls is stored
    once. The tensor node of a key is made once too: a tensor met again costs a dictionary look-up.

    Args:
        snapshot: ``tensor -> stored copy``; called once per distinct tensor.
        table: Where the snapshots go, by key (a new dict by default). A table with a method
            ``keep(key, tensor)`` snapshots and stores in one step (the observer's, once per tensor
            of every call); one with ``keep_all(keys, tensors)`` too, for many at once.
    """

    def __init__(
        self, snapshot: Callable[[torch.Tensor], torch.Tensor], table: MutableMapping[str, torch.Tensor] | None = None
    ) -> None:
        self._snapshot = snapshot
        self._seen: dict[int, _Seen] = {}
        self._sweep_at = _SWEEP_MIN
        self.tensors: MutableMapping[str, torch.Tensor] = {} if table is None else table
        self._keep: Callable[[str, torch.Tensor], None] | None = getattr(table, "keep", None)
        self._keep_all: Callable[[list[str], list[torch.Tensor]], None] | None = getattr(table, "keep_all", None)
        self._objects: dict[int, tuple[Any, ...]] = {}  # id -> (ref, node, children, versions, context, discarded)
        self._counter = 0

    def node(self, tensor: torch.Tensor) -> TensorNode:
        """The tensor node of ``tensor`` (its key), snapshotting it if it was not seen unchanged before."""
        seen = self._seen.get(id(tensor))
        if (
            seen is not None
            and seen() is tensor
            and seen.version == tensor._version
            and seen.layout == _layout(tensor)
            and seen.node.key in self.tensors
        ):
            return seen.node
        key = f"t{self._counter}"
        self._counter += 1
        if self._keep is None:
            self.tensors[key] = self._snapshot(tensor)
        else:
            self._keep(key, tensor)
        node = _key_node(key)
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor keeps no version counter: a new key each time met
            return node
        seen = self._seen[id(tensor)] = _Seen(tensor)
        seen.node, seen.version, seen.layout = node, version, _layout(tensor)
        if len(self._seen) > self._sweep_at:
            self._sweep()
        return node

    def nodes(self, tensors: list[torch.Tensor]) -> list[TensorNode]:
        """:meth:`node` of each of ``tensors``; in one pass when none was met before (a cache's new layers).

        A decode step's cache holds a new tensor per layer: this is the collector's cost per layer,
        its checks run over all of them at once.
        """
        seen, n = self._seen, len(tensors)
        keep_all = self._keep_all
        ids = list(map(id, tensors))
        if n >= 2 and not seen.keys().isdisjoint(ids):
            self._forget_gone(ids)  # the ids of tensors freed since, taken by new ones
        if (
            keep_all is None
            or n < 2
            or not seen.keys().isdisjoint(ids)
            or len(set(ids)) != n  # one tensor twice: its second place is the first's node
            or not all(map(operator.is_, map(type, tensors), itertools.repeat(torch.Tensor)))
            or any(map(torch.Tensor.is_inference, tensors))
        ):
            return [self.node(t) for t in tensors]
        first = self._counter
        self._counter += n
        keys = list(map("t{}".format, range(first, first + n)))
        keep_all(keys, tensors)
        nodes = list(map(_key_node, keys))
        for tensor, node, ident in zip(tensors, nodes, ids):
            entry = seen[ident] = _Seen(tensor)
            entry.node, entry.version, entry.layout = node, tensor._version, _layout(tensor)
        if len(seen) > self._sweep_at:
            self._sweep()
        return nodes

    def _forget_gone(self, ids: list[int]) -> None:
        """Forget the entries of ``ids`` whose tensors are gone."""
        seen = self._seen
        for ident in ids:
            entry = seen.get(ident)
            if entry is not None and entry() is None:
                del seen[ident]

    def _sweep(self) -> None:
        """Forget every tensor gone (what the collector remembers stays what is alive, give or take a half)."""
        seen = self._seen
        for ident in [ident for ident, entry in seen.items() if entry() is None]:
            del seen[ident]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(seen))

    def met(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (this object) was recorded before: what the recorded calls carry."""
        seen = self._seen.get(id(tensor))
        return seen is not None and seen() is tensor

    def unchanged(self, value: Any, children: list[Any], context: Any) -> ObjectNode | None:
        """The node recorded for ``value`` last time, if it still holds the same children, unchanged since.

        A cache passed to the next call (the object its previous call returned, its tensors the
        same objects with the same version counters) is then that call's node, at the cost of
        one identity and one counter check per tensor: no node, no key, no look-up.
        """
        last = self._objects.get(id(value))
        if last is None:
            return None
        ref, node, kids, versions, kids_context, discarded = last
        if (
            ref() is not value
            or versions is None
            or len(kids) != len(children)
            or discarded != getattr(self.tensors, "discarded", 0)
            or kids_context != context
        ):
            return None
        if None not in versions:  # tensors only (a cache's layers): the checks run over all at once
            if all(map(operator.is_, map(_deref, kids), children)) and list(map(_VERSION, children)) == versions:
                return node
            return None
        for child, kid, version in zip(children, kids, versions):
            if version is None:  # None or a scalar, kept as it was
                if child is not kid:
                    return None
            elif kid() is not child or child._version != version:  # a tensor, by weak reference
                return None
        return node

    def same_object(self, value: Any, node: ObjectNode, children: list[Any], context: Any) -> ObjectNode:
        """``node`` (the tree of ``value``, a registered class, flattened to ``children`` and ``context``),
        or the equal node made for ``value`` last time; remembered for :meth:`unchanged`.

        A cache passed to every call (the same object, its tensors unchanged since it was returned)
        is then one node shared by the calls that hold it, which its writers serialise once.
        """
        last = self._objects.get(id(value))
        if (
            last is not None
            and last[0]() is value
            and last[1].type == node.type
            and last[1].context == node.context
            and len(last[1].items) == len(node.items)
            and all(a is b for a, b in zip(last[1].items, node.items))
        ):
            node = last[1]
        if len(self._objects) >= 256:  # a model output is a new object every call: keep the recent ones
            self._objects.clear()
        # only tensors and immutable leaves: a child that can change unseen (a list) is walked every time
        # Tensors are held by weak reference (a memo must not keep a call's outputs alive), other children
        # only if immutable: an object holding a list, which can change unseen, is walked every time.
        stamps: list[int | None] = []
        kids: list[Any] = []
        seen = self._seen
        entries = list(map(seen.get, map(id, children)))
        if all(map(operator.is_not, entries, itertools.repeat(None))) and all(
            map(operator.is_, map(_deref, entries), children)
        ):
            # tensors the collector just met (a cache's layers): their weak references serve, checked at once
            kids, stamps = entries, list(map(_VERSION, children))
        for child in children if not kids else ():
            if isinstance(child, torch.Tensor):
                if child.is_inference():  # no version counter: the object is walked every time
                    break
                known = seen.get(id(child))  # its node was just made: the weak reference that made it serves
                if known is not None and known() is child:
                    kids.append(known)
                else:
                    try:
                        kids.append(weakref.ref(child))
                    except TypeError:
                        break
                stamps.append(child._version)
            elif child is None or type(child) in _SCALARS:
                stamps.append(None)
                kids.append(child)
            else:
                break
        memoised = len(stamps) == len(children)
        try:
            ref = weakref.ref(value)
        except TypeError:
            return node
        discarded = getattr(self.tensors, "discarded", 0)
        self._objects[id(value)] = (
            ref,
            node,
            kids if memoised else [],
            stamps if memoised else None,
            context,
            discarded,
        )
        return node


_NORMALISED: dict[str, Any] = {}
"""JSON text of a context -> its JSON value: a cache's context is the same from call to call."""


_NORMALISED_NAMES: dict[tuple[str | None, ...], list[str | None]] = {}
"""A context of names (a cache's layer kinds, an output's fields) -> its JSON value, without a round trip."""


def _json_normalise(context: Any) -> tuple[Any, bool]:
    if type(context) is list:  # most contexts, every call: a list of strings is its own JSON value
        names = tuple(context)
        if all(type(name) is str or name is None for name in names):
            value = _NORMALISED_NAMES.get(names)
            if value is None:
                value = list(names)
                if len(_NORMALISED_NAMES) < 256:
                    _NORMALISED_NAMES[names] = value  # frozen into nodes, never changed in place
            return value, True
    try:
        text = json.dumps(context)
    except (TypeError, ValueError):
        return None, False
    value = _NORMALISED.get(text)
    if value is None:
        value = json.loads(text)
        if len(_NORMALISED) < 256:
            _NORMALISED[text] = value  # contexts are frozen into nodes, never changed in place
    return value, True


def _path(where: Any) -> str:
    """A path from where :func:`_record` stands: a path, or ``(parent, label, index)`` (made a path only for a message)."""
    if isinstance(where, str):
        return where
    parent, label, index = where
    return child_path(_path(parent), label, index)


def record_value(
    value: Any,
    collector: TensorCollector,
    *,
    path: str,
    on_opaque: Callable[[str, str, str], None],
) -> Node:
    """Convert ``value`` to a tree, registering its tensors with ``collector``.

    ``path`` is where ``value`` stands (``calls.tensor_paths`` syntax; ``""`` for an output tree).
    Values that cannot be recorded become :class:`OpaqueNode` and ``on_opaque(path, type, reason)``
    is called; recording never raises for an unsupported value.
    """
    return _record(value, collector, path, on_opaque)


def _record(value: Any, collector: TensorCollector, where: Any, on_opaque: Callable[[str, str, str], None]) -> Node:
    """:func:`record_value` with a lazy path: this runs once per value of every recorded call."""
    cls = type(value)
    if cls is torch.Tensor or isinstance(value, torch.Tensor):
        return collector.node(value)
    if value is None:
        return NONE_NODE
    if isinstance(value, _SCALARS):
        # bool before int: bool is an int subclass; int/str enums are stored as plain values
        plain = next(t for t in _SCALARS if isinstance(value, t))
        return ConstNode(value=plain(value))
    if cls is list or cls is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
        items = [_record(v, collector, (where, None, i), on_opaque) for i, v in enumerate(value)]
        return ListNode.model_construct(items=items) if cls is list else TupleNode.model_construct(items=items)
    if isinstance(value, dict) and (cls is dict or cls.__module__ == "collections"):
        keys = list(value)
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
            items = [
                _record(value[k], collector, (where, k if isinstance(k, str) else None, k), on_opaque) for k in keys
            ]
            return DictNode.model_construct(keys=keys, items=items)
    node_type = find_node_type(value)
    if node_type is not None:
        children, context = node_type.flatten(value)
        last = collector.unchanged(value, children, context)
        if last is not None:
            return last
        normalised = _json_normalise(context)[0]
        # built from checked parts (nodes, a JSON value): validating would walk every item again
        node = ObjectNode.model_construct(
            type=node_type.name,
            version=node_type.version,
            context=normalised,
            items=_record_children(children, normalised, collector, where, on_opaque),
        )
        return collector.same_object(value, node, children, context)
    pytree_node = torch_pytree.SUPPORTED_NODES.get(cls)
    if pytree_node is not None and cls not in _CONTAINER_TYPES:
        children, context = pytree_node.flatten_fn(value)
        context, ok = _json_normalise(context)
        return ObjectNode.model_construct(
            type=PYTREE_PREFIX + qualified_name(cls),
            version=0 if ok else -1,
            context=context,
            items=_record_children(children, context, collector, where, on_opaque),
        )
    reason = "not a tensor, scalar, container or registered class"
    on_opaque(_path(where) or OUTPUT_ROOT, qualified_name(cls), reason)
    return OpaqueNode(type=qualified_name(cls), reason=reason)


def _key_path(path: str, key: Any) -> str:
    return child_path(path, key if isinstance(key, str) else None, key)


def _record_children(
    children: list[Any],
    context: Any,
    collector: TensorCollector,
    where: Any,
    on_opaque: Callable[[str, str, str], None],
) -> list[Node]:
    """The recorded children of a registered class, each at its path (a field's name when the context names it)."""
    node, tensor = collector.node, torch.Tensor
    if all(map(operator.is_, map(type, children), itertools.repeat(tensor))):  # a cache's layers: at once
        return list(collector.nodes(children))  # a list of nodes of any kind, for the type checker
    if isinstance(context, list) and len(context) == len(children):
        return [
            node(c)  # a cache's tensors: no path to make
            if type(c) is tensor
            else _record(c, collector, (where, label if isinstance(label, str) else None, i), on_opaque)
            for i, (label, c) in enumerate(zip(context, children))
        ]
    return [
        node(c) if type(c) is tensor else _record(c, collector, (where, None, i), on_opaque)
        for i, c in enumerate(children)
    ]


def iter_tensor_nodes(node: Node) -> Iterator[TensorNode]:
    """Yield the tensor nodes of ``node`` in flattening order."""
    stack: list[Node] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorNode):
            yield item
        elif isinstance(item, (ListNode, TupleNode, DictNode, ObjectNode)):
            stack.extend(reversed(item.items))


def tensor_keys(node: Node) -> list[str]:
    return collect_tensor_keys(node, [])


def count_tensors(node: Node) -> int:
    return sum(1 for _ in iter_tensor_nodes(node))


def count_leaves(node: Node) -> int:
    """Count the leaves torch's pytree would see: tensors, None, constants and opaque values."""
    if isinstance(node, (ListNode, TupleNode, DictNode, ObjectNode)):
        return sum(count_leaves(n) for n in node.items)
    return 1


def replace_tensors(node: Node, values: Iterator[Node]) -> Node:
    """Return ``node`` with each tensor node replaced by the next node of ``values``."""
    if isinstance(node, TensorNode):
        return next(values)
    if isinstance(node, ListNode):
        return ListNode(items=[replace_tensors(n, values) for n in node.items])
    if isinstance(node, TupleNode):
        return TupleNode(items=[replace_tensors(n, values) for n in node.items])
    if isinstance(node, DictNode):
        return DictNode(keys=node.keys, items=[replace_tensors(n, values) for n in node.items])
    if isinstance(node, ObjectNode):
        return node.model_copy(update={"items": [replace_tensors(n, values) for n in node.items]})
    return node


def map_structure(node: Node, leaf: Callable[[TensorNode], Any]) -> Any:
    """Rebuild ``node`` as plain containers: tensors through ``leaf``, registered classes as lists.

    This is the structure ``torch.export`` expects for ``dynamic_shapes``: a custom class
    appears as the list of its flattened children; None and constants become None.
    """
    if isinstance(node, TensorNode):
        return leaf(node)
    if isinstance(node, ListNode):
        return [map_structure(n, leaf) for n in node.items]
    if isinstance(node, TupleNode):
        return tuple(map_structure(n, leaf) for n in node.items)
    if isinstance(node, DictNode):
        return {k: map_structure(n, leaf) for k, n in zip(node.keys, node.items)}
    if isinstance(node, ObjectNode):
        return [map_structure(n, leaf) for n in node.items]
    return None


def build_value(node: Node, tensor: Callable[[str], torch.Tensor], *, path: str = "") -> Any:
    """Rebuild the Python value of ``node``; tensors come from ``tensor(key)``.

    Registered classes are rebuilt only through iobundle's registry, or through a
    torch pytree registration already present in this process; nothing is imported.

    Raises:
        UnsafeBundleError: The tree names a class that is not registered.
        AlignmentError: The tree holds a value that was not recorded (opaque).
    """
    if isinstance(node, TensorNode):
        return tensor(node.key)
    if isinstance(node, NoneNode):
        return None
    if isinstance(node, ConstNode):
        return node.value
    if isinstance(node, ListNode):
        return [build_value(n, tensor, path=child_path(path, None, i)) for i, n in enumerate(node.items)]
    if isinstance(node, TupleNode):
        return tuple(build_value(n, tensor, path=child_path(path, None, i)) for i, n in enumerate(node.items))
    if isinstance(node, DictNode):
        return {k: build_value(n, tensor, path=_key_path(path, k)) for k, n in zip(node.keys, node.items)}
    if isinstance(node, ObjectNode):
        labels = item_labels(node)
        children = [build_value(n, tensor, path=child_path(path, labels[i], i)) for i, n in enumerate(node.items)]
        return _build_object(node, children, path)
    raise AlignmentError(
        f"{path or 'value'}: a {node.type} was not recorded ({node.reason}), so it cannot be rebuilt. "
        "Register its class as a pytree node before capturing (an input can also be dropped with remove_inputs())."
    )


def _build_object(node: ObjectNode, children: list[Any], path: str) -> Any:
    if node.type.startswith(PYTREE_PREFIX):
        name = node.type[len(PYTREE_PREFIX) :]
        for cls, entry in list(torch_pytree.SUPPORTED_NODES.items()):
            if qualified_name(cls) == name:
                if node.version < 0:
                    raise AlignmentError(
                        f"{path}: the pytree context of {name} was not JSON-serialisable at capture, "
                        "so it cannot be rebuilt."
                    )
                return _unflatten(entry.unflatten_fn, children, node.context, path, name)
        raise UnsafeBundleError(
            f"{path}: class {name!r} is not registered as a pytree node in this process. "
            "Import the module that registers it before loading (iobundle never imports names found in a bundle)."
        )
    node_type = lookup_node_type(node.type)
    if node_type is None:
        raise UnsafeBundleError(
            f"{path}: node type {node.type!r} is not in iobundle's registry; refusing to rebuild it."
        )
    if node.version != node_type.version:
        raise UnsafeBundleError(
            f"{path}: node type {node.type!r} has version {node.version}; this iobundle reads version {node_type.version}."
        )
    return _unflatten(node_type.unflatten, children, node.context, path, node.type)


def _unflatten(fn: Callable[[list[Any], Any], Any], children: list[Any], context: Any, path: str, name: str) -> Any:
    """Call an unflatten function on recorded (untrusted) children and context; its failure is an UnsafeBundleError."""
    try:
        return fn(children, context)
    except Exception as exc:
        raise UnsafeBundleError(
            f"{path}: cannot rebuild a {name} from the recorded children and context "
            f"({type(exc).__name__}: {exc}). The bundle is corrupt, or was written for another version of {name}."
        ) from exc
