"""A recorded call as the manifest's JSON, assembled from the remembered JSON of the nodes calls share."""

from __future__ import annotations

import itertools
import json
import math
import operator
from typing import Any

from iobundle.schema import CallEntry, ListNode, Node, ObjectNode, TensorNode, TupleNode, collect_tensor_keys

__all__ = ["CallJson"]

_MEMO_NODES = 8192

_KEY = operator.attrgetter("key")

_TREES = {"args", "kwargs", "outputs", "state"}
_NOT_MIDDLE = _TREES | {"index", "latency"}
_REMEMBERED = [name for name in CallEntry.model_fields if name not in _NOT_MIDDLE] == [
    "status",
    "error",
    "cst_kwargs",
    "filled",
    "autocast",
]
"""Whether a head's other fields are the ones :meth:`CallJson._head` remembers heads by (a field added to
:class:`CallEntry` turns the memo off until it is keyed by that field too)."""

_STRINGS: dict[str, bytes] = {}
"""A string's JSON (an argument's name, a registered type's): the same few from call to call."""


def _string(text: str) -> bytes:
    """``json.dumps(text)``, remembered (a kilobyte of names at most)."""
    found = _STRINGS.get(text)
    if found is None:
        found = json.dumps(text).encode()
        if len(_STRINGS) < 1024 and len(text) <= 256:
            _STRINGS[text] = found
    return found


class CallJson:
    """Recorded calls as the manifest's JSON, for the child, at a cost that does not grow with what repeats.

    The child validates what it receives, so any JSON of the entry will do; this one is put together
    from the JSON of each container node, remembered for the nodes calls share: a cache passed to
    the next call is the node its previous call returned
    (:meth:`iobundle.calls.TensorCollector.same_object`). A decode step thus serialises only
    what it adds. The rest of the entry goes through pydantic (its None fields left out).

    Serialising a call also lists the keys of the tensor nodes it wrote out: a remembered node's
    were listed with the call that first held it, so only these can be new to the child.
    """

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Node, bytes]] = {}
        self._contexts: dict[int, tuple[Any, bytes]] = {}
        self._heads: dict[tuple[Any, ...], bytes] = {}
        self._keys: list[str] = []

    def __call__(self, call: CallEntry) -> tuple[bytes, list[str]]:
        """The JSON of ``call`` and the keys of the tensor nodes serialised for it (not met before)."""
        keys: list[str]
        self._keys = keys = []
        parts = [self._head(call), b',"args":[', b",".join(map(self._node, call.args)), b'],"kwargs":{']
        parts.append(b",".join(_string(k) + b":" + self._node(v) for k, v in call.kwargs.items()))
        parts.append(b"}")
        if call.outputs is not None:
            parts += [b',"outputs":', self._node(call.outputs)]
        if call.state is not None:
            parts += [b',"state":', self._node(call.state)]
        parts.append(b"}")
        return b"".join(parts), keys

    def _head(self, call: CallEntry) -> bytes:
        """The entry's fields but its trees, as JSON without the closing brace.

        A decode step's differ from the last call's in the index and the latency only: the rest (status,
        error, constants, filled arguments) is remembered by value, the constants' types included, where
        pydantic takes 9 µs a call.
        """
        cst, latency = call.cst_kwargs, call.latency
        if (
            _REMEMBERED
            and call.autocast is None
            and type(latency) is float
            and math.isfinite(latency)
            and float not in map(type, cst.values())  # -0.0 == 0.0: a float could be remembered with the wrong sign
        ):
            key = (call.status, call.error, tuple(zip(cst, map(type, cst.values()), cst.values())), tuple(call.filled))
            middle = self._heads.get(key)
            if middle is None:
                middle = call.model_dump_json(exclude=_NOT_MIDDLE).encode()[1:-1]
                if len(self._heads) >= 256:
                    self._heads.clear()
                self._heads[key] = middle
            return b'{"index":%d,%s,"latency":%s' % (call.index, middle, repr(latency).encode())
        return call.model_dump_json(exclude=_TREES).encode()[:-1]

    def _items(self, items: list[Node]) -> bytes:
        memo, parts, keys = self._memo, [], self._keys
        if all(map(operator.is_, map(type, items), itertools.repeat(TensorNode))):  # a cache's layers: at once
            names = list(map(_KEY, items))
            if all(map(str.isalnum, names)) and all(map(str.isascii, names)):  # a collector's keys (t123)
                keys += names
                return (
                    b'{"kind":"tensor","key":"%s"}' % '"},{"kind":"tensor","key":"'.join(names).encode()
                    if names
                    else b""
                )
        for item in items:  # a tensor, or a node met before, without a call: most items of a decode step
            if type(item) is TensorNode:  # not remembered: cheap to write again (sent filters its key)
                key = item.key
                keys.append(key)
                # a collector's key (t123) needs no escaping; any other is escaped
                parts.append(
                    b'{"kind":"tensor","key":"%s"}' % key.encode()
                    if key.isalnum() and key.isascii()
                    else _tensor_json(key)
                )
                continue
            hit = memo.get(id(item))
            parts.append(hit[1] if hit is not None and hit[0] is item else self._node(item))
        return b",".join(parts)

    def _context(self, context: Any) -> bytes:
        """A node's context as JSON: the same object from call to call (a cache's layer kinds), written once."""
        hit = self._contexts.get(id(context))
        if hit is not None and hit[0] is context:
            return hit[1]
        text = json.dumps(context).encode()
        if len(self._contexts) >= 256:
            self._contexts.clear()
        self._contexts[id(context)] = (context, text)
        return text

    def _remember(self, node: Node, text: bytes) -> bytes:
        if len(self._memo) >= _MEMO_NODES:
            self._memo.clear()
        self._memo[id(node)] = (node, text)
        return text

    def _node(self, node: Node) -> bytes:
        if isinstance(node, TensorNode):
            self._keys.append(node.key)
            return _tensor_json(node.key)
        hit = self._memo.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1]
        if isinstance(node, ObjectNode):
            text = b"".join(
                (
                    b'{"kind":"node","type":',
                    _string(node.type),
                    b',"version":%d,"context":' % node.version,
                    self._context(node.context),
                    b',"items":[',
                    self._items(node.items),
                    b"]}",
                )
            )
        elif isinstance(node, (ListNode, TupleNode)):
            kind = b"list" if isinstance(node, ListNode) else b"tuple"
            return b'{"kind":"' + kind + b'","items":[' + self._items(node.items) + b"]}"
        else:  # None, a constant, a dict, an opaque value: small, rare
            collect_tensor_keys(node, self._keys)
            # the node's own serialiser: a TypeAdapter of the union wrote a float constant's inf and nan as null
            return node.model_dump_json().encode()
        return self._remember(node, text)


def _tensor_json(key: str) -> bytes:
    """A tensor node's JSON (a collector's key, ``t123``, needs no escaping; any other is escaped)."""
    quoted = b'"%s"' % key.encode() if key.isalnum() and key.isascii() else json.dumps(key).encode()
    return b'{"kind":"tensor","key":' + quoted + b"}"
