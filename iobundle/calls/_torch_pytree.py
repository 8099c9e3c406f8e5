"""Lend the transformers caches' iobundle layouts to ``torch.utils._pytree`` for a ``with`` block."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch.utils._pytree as torch_pytree

from iobundle.calls._layouts import (
    DYNAMIC_CACHE_NAME,
    ENCODER_DECODER_CACHE_NAME,
    QUANTIZED_CACHE_NAME,
    STATIC_CACHE_NAME,
    layer_parts,
)
from iobundle.calls._transformers import CACHE_NODE_TYPES

__all__ = ["torch_pytree_nodes"]

logger = logging.getLogger(__name__)


def _torch_context(context: Any) -> str:
    """Turn a JSON context into the hashable, dumpable form the torch pytree specs hold."""
    return json.dumps(context, sort_keys=True, separators=(",", ":"))


def _layer_child_names(kind: Any, index: int, cache: str) -> list[str]:
    """The names of one layer's children: ``key_0``, ``value_0``, ``conv_0``, ``recurrent_0`` (``conv_0_1``: a second state)."""
    parts = layer_parts(kind, index, cache)
    one_state = sum(state is not None for _, state in parts) == 2
    return [f"{n}_{index}" if s is None or one_state else f"{n}_{index}_{s}" for n, s in parts]


def _cache_child_keys(cache: str, children: list[Any], context: Any) -> list[Any]:
    """Name a cache's children ``key_0, value_0, ...``: torch.export names its inputs after them."""
    names = [name for i, kind in enumerate(context) for name in _layer_child_names(kind, i, cache)]
    return [torch_pytree.MappingKey(name) for name in names]


_QUANTIZED_CHILD_NAMES = (
    "key",
    "value",
    "key_codes",
    "key_scale",
    "key_shift",
    "value_codes",
    "value_scale",
    "value_shift",
)


def _quantized_child_keys(children: list[Any], context: Any) -> list[Any]:
    """Name a quantized cache's children ``key_0, value_0, key_codes_0, ...`` (residual first)."""
    return [torch_pytree.MappingKey(f"{name}_{i}") for i in range(len(context)) for name in _QUANTIZED_CHILD_NAMES]


def _attribute_keys(*names: str) -> Any:
    def keys(children: list[Any], context: Any) -> list[Any]:
        return [torch_pytree.GetAttrKey(name) for name in names]

    return keys


@dataclasses.dataclass(frozen=True)
class _PytreeNode:
    """One class lent to torch pytree: flatten, unflatten and the key entries of its children."""

    cls: type
    serialized_type_name: str
    flatten: Any
    unflatten: Any
    child_keys: Any

    def torch_flatten(self, obj: Any) -> tuple[list[Any], str]:
        children, context = self.flatten(obj)
        return children, _torch_context(context)

    def torch_unflatten(self, children: Any, context: str) -> Any:
        return self.unflatten(list(children), json.loads(context))

    def torch_flatten_with_keys(self, obj: Any) -> tuple[list[tuple[Any, Any]], str]:
        children, context = self.flatten(obj)
        keyed = list(zip(self.child_keys(children, context), children, strict=True))
        return keyed, _torch_context(context)


def _pytree_nodes() -> tuple[_PytreeNode, ...]:
    """The registered caches' node types, each with the key entries torch.export names its inputs after."""
    child_keys = {
        DYNAMIC_CACHE_NAME: functools.partial(_cache_child_keys, "DynamicCache"),
        STATIC_CACHE_NAME: functools.partial(_cache_child_keys, "StaticCache"),
        ENCODER_DECODER_CACHE_NAME: _attribute_keys("self_attention_cache", "cross_attention_cache"),
        QUANTIZED_CACHE_NAME: _quantized_child_keys,
    }
    return tuple(
        _PytreeNode(node.cls, node.name, node.flatten, node.unflatten, child_keys[node.name])
        for node in CACHE_NODE_TYPES
        if node.name in child_keys
    )


@dataclasses.dataclass
class _SavedRegistration:
    """What torch pytree held for one class before we registered ours."""

    node_def: Any
    serialized_def: Any
    serialized_names: dict[str, Any]
    constant: bool
    ours: Any = None


_PYTREE_LOCK = threading.Lock()
_pytree_depth = 0
_pytree_saved: dict[type, _SavedRegistration] = {}

_MISSING = object()


def _install(node: _PytreeNode) -> _SavedRegistration:
    """Replace torch pytree's registration of ``node.cls`` by ours; return what was there."""
    with torch_pytree._NODE_REGISTRY_LOCK:
        old_serialized = torch_pytree.SUPPORTED_SERIALIZED_TYPES.get(node.cls)
        names = {node.serialized_type_name}
        if old_serialized is not None:
            names.add(old_serialized.serialized_type_name)
        saved = _SavedRegistration(
            node_def=torch_pytree.SUPPORTED_NODES.get(node.cls),
            serialized_def=old_serialized,
            serialized_names={name: torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name, _MISSING) for name in names},
            constant=node.cls in torch_pytree.CONSTANT_NODES,
        )
        _remove(node.cls)
        # The private registration skips the C++ pytree (optree), which torch.export does not use
        # and from which nothing could be removed again.
        torch_pytree._private_register_pytree_node(
            node.cls,
            node.torch_flatten,
            node.torch_unflatten,
            serialized_type_name=node.serialized_type_name,
            to_dumpable_context=_identity,
            from_dumpable_context=_identity,
            flatten_with_keys_fn=node.torch_flatten_with_keys,
        )
        saved.ours = torch_pytree.SUPPORTED_NODES[node.cls]
    return saved


def _restore(cls: type, saved: _SavedRegistration) -> None:
    """Remove our registration of ``cls`` and put back exactly what ``saved`` holds."""
    with torch_pytree._NODE_REGISTRY_LOCK:
        if torch_pytree.SUPPORTED_NODES.get(cls) is not saved.ours:
            logger.warning(
                "torch pytree registration of %s was changed inside torch_pytree_nodes(); leaving it as it is",
                cls.__name__,
            )
            return
        _remove(cls)
        if saved.node_def is not None:
            torch_pytree.SUPPORTED_NODES[cls] = saved.node_def
        if saved.serialized_def is not None:
            torch_pytree.SUPPORTED_SERIALIZED_TYPES[cls] = saved.serialized_def
        for name, value in saved.serialized_names.items():
            if value is _MISSING:
                torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.pop(name, None)
            else:
                torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[name] = value
        if saved.constant:
            torch_pytree.CONSTANT_NODES.add(cls)


def _remove(cls: type) -> None:
    """Remove ``cls`` from the Python pytree tables (``_deregister_pytree_node``, tolerating gaps)."""
    torch_pytree.SUPPORTED_NODES.pop(cls, None)
    serialized = torch_pytree.SUPPORTED_SERIALIZED_TYPES.pop(cls, None)
    if (
        serialized is not None
        and torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(serialized.serialized_type_name) is cls
    ):
        del torch_pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[serialized.serialized_type_name]
    torch_pytree.CONSTANT_NODES.discard(cls)


def _identity(value: Any) -> Any:
    return value


@contextlib.contextmanager
def torch_pytree_nodes() -> Iterator[None]:
    """Register the transformers caches with ``torch.utils._pytree`` for the ``with`` block.

    Inside the block the caches flatten the way the iobundle node types do (see the module
    docstring), the context as a JSON string; ``dynamic_shapes`` for a cache is the list of its
    children's shapes. On leaving, whatever torch pytree held for these classes before is put
    back exactly; nested and concurrent blocks are fine (the last to leave restores).
    ``ModelOutput`` classes are left alone: transformers registers them itself, the same way.

    An uninitialised layer flattens to ``None`` children, an empty subtree for torch pytree, so a
    prefill cache and a decode cache are different structures: give ``torch.export`` layers that
    all hold tensors (zero-length ``(B, H, 0, D)`` ones for an empty cache). This relies on
    torch's private registration tables (checked against torch 2.13), Python pytree only.

    Example:
        >>> with torch_pytree_nodes():
        ...     ep = torch.export.export(model, (input_ids,), {"cache": cache})
    """
    global _pytree_depth
    with _PYTREE_LOCK:
        if _pytree_depth == 0:
            for node in _pytree_nodes():
                _pytree_saved[node.cls] = _install(node)
        _pytree_depth += 1
    try:
        yield
    finally:
        with _PYTREE_LOCK:
            _pytree_depth -= 1
            if _pytree_depth == 0:
                for cls, saved in _pytree_saved.items():
                    _restore(cls, saved)
                _pytree_saved.clear()
