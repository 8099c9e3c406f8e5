"""The stored layouts of the built-in node types, as plain data about a bundle's JSON: no library imported.

Reading a bundle (shape inference, ``inspect``, ``shapes``) needs to know which child of a recorded
cache grows along which dimension; that follows from the node type's name, version and context
alone. The node types of :mod:`iobundle.calls._transformers` take these facts from here, so there
is one source of truth, and inference asks here (:func:`node_layout` in the registry) instead of
importing transformers to build the node types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_LAYOUTS",
    "DYNAMIC_CACHE_NAME",
    "ENCODER_DECODER_CACHE_NAME",
    "MAX_STATES",
    "NODE_TYPE_VERSION",
    "QUANTIZED_CACHE_NAME",
    "QUANTIZED_LAYER_CHILDREN",
    "STATIC_CACHE_NAME",
    "Layout",
    "attention_name",
    "cache_child_labels",
    "dynamic_cache_parts",
    "dynamic_empty_dims",
    "kind_children",
    "layer_parts",
    "positive_int",
    "quantized_settings",
]

NODE_TYPE_VERSION = 1
DYNAMIC_CACHE_NAME = "transformers.DynamicCache"
STATIC_CACHE_NAME = "transformers.StaticCache"
ENCODER_DECODER_CACHE_NAME = "transformers.EncoderDecoderCache"
QUANTIZED_CACHE_NAME = "transformers.QuantizedCache"

MAX_STATES = 64
"""A bound on a linear-attention layer's number of states read from a bundle."""


@dataclass(frozen=True)
class Layout:
    """What a node type's stored children mean for shape inference (see :class:`~iobundle.calls.NodeType`).

    Attributes:
        empty_dim: The dimension along which a None child stands for a zero-length tensor, or None.
        child_empty_dims: ``context -> [empty_dim per child]``; when given, it decides per child.
    """

    empty_dim: int | None = None
    child_empty_dims: Callable[[Any], list[int | None]] | None = None


def positive_int(value: Any, what: str, index: int, *, most: int | None = None) -> int:
    """``value`` if it is a positive int (at most ``most``); a bundle's context is checked before use."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
        bound = f" up to {most}" if most is not None else ""
        raise ValueError(f"Layer {index} of the cache has {what} {value!r}; expected a positive integer{bound}.")
    return value


def attention_name(attention: Any) -> str | None:
    """``None``, ``full``, ``sliding`` or ``static``: the attention part of a linear-attention kind (else ``?``)."""
    if attention is None or attention == "full":
        return attention
    if isinstance(attention, dict) and len(attention) == 1 and next(iter(attention)) in ("sliding", "static"):
        return next(iter(attention))
    return "?"


def kind_children(kind: Any, index: int, cache: str) -> int:
    """How many children a layer of ``kind`` flattens to in ``cache`` (checking the kind read from a bundle).

    Raises:
        ValueError: ``kind`` is not a layer kind of ``cache``.
    """
    attention = 3 if cache == "StaticCache" else 2
    if kind in ("full", "dummy") or (isinstance(kind, dict) and ("sliding" in kind or "static" in kind)):
        return attention
    if kind == "indexed":
        return 4
    if isinstance(kind, dict) and "linear" in kind:
        states = positive_int(kind["linear"], "a number of states", index, most=MAX_STATES)
        part = attention_name(kind.get("attention"))
        if part not in (("static", None) if cache == "StaticCache" else ("full", "sliding", None)):
            raise ValueError(f"Layer {index} of the {cache} has an unknown attention kind {kind.get('attention')!r}.")
        return 2 * states + (0 if part is None else attention)
    raise ValueError(f"Layer {index} of the {cache} has an unknown kind {kind!r}.")


def layer_parts(kind: Any, index: int, cache: str) -> list[tuple[str, int | None]]:
    """What each child of one layer of ``kind`` in ``cache`` is, in flattening order, and for a state which one.

    Parts: ``key``, ``value``, ``cumulative_length`` (a ``StaticCache``'s token count),
    ``indexer_keys``, ``indexer_position_ids`` (an indexed layer), then ``conv`` and ``recurrent``
    for each state of a linear-attention layer (after its attention part), with the state's number.

    Raises:
        ValueError: ``kind`` is not a layer kind of ``cache`` (see :func:`kind_children`).

    Example:
        >>> layer_parts({"linear": 1, "attention": "full"}, 0, "DynamicCache")
        [('key', None), ('value', None), ('conv', 0), ('recurrent', 0)]
    """
    count = kind_children(kind, index, cache)
    if kind == "indexed":
        return [("key", None), ("value", None), ("indexer_keys", None), ("indexer_position_ids", None)]
    states = kind["linear"] if isinstance(kind, dict) and "linear" in kind else 0
    attention: list[tuple[str, int | None]] = [
        (name, None) for name in ("key", "value", "cumulative_length")[: count - 2 * states]
    ]
    return attention + [(name, s) for s in range(states) for name in ("conv", "recurrent")]


_LABELS = {
    "key": "k",
    "value": "v",
    "cumulative_length": "len",
    "indexer_keys": "idx_k",
    "indexer_position_ids": "idx_pos",
    "conv": "conv",
    "recurrent": "rec",
}
_CACHES = {DYNAMIC_CACHE_NAME: "DynamicCache", STATIC_CACHE_NAME: "StaticCache"}


def cache_child_labels(name: str, context: Any) -> list[tuple[str, ...]] | None:
    """Short labels of the children of a built-in cache node ``name``, one group per layer (what ``inspect`` shows).

    An ``EncoderDecoderCache`` is one group, ``("self", "cross")``. None for another node type, or
    a context that is not a cache's (the tree is then shown as any other).

    Example:
        >>> cache_child_labels("transformers.StaticCache", [{"static": 8}, {"static": 8}])
        [('k', 'v', 'len'), ('k', 'v', 'len')]
    """
    if name == ENCODER_DECODER_CACHE_NAME:
        return [("self", "cross")]
    cache = _CACHES.get(name)
    if cache is None or not isinstance(context, list):
        return None
    try:
        return [tuple(_LABELS[part] for part, _ in layer_parts(kind, i, cache)) for i, kind in enumerate(context)]
    except ValueError:
        return None


_PARTS = {
    "indexer_keys": "indexer_key",
    "indexer_position_ids": "indexer_position",
    "conv": "state",
    "recurrent": "state",
}


def dynamic_cache_parts(context: Any) -> list[tuple[Any, str]]:
    """Per child of a ``DynamicCache``, its layer's kind and what the child is (:func:`layer_parts`, with
    ``"indexer_key"``, ``"indexer_position"`` and ``"state"`` for the indexer and linear-attention parts).

    A malformed context gives ``[]``.

    Example:
        >>> dynamic_cache_parts(["full", {"linear": 1}])
        [('full', 'key'), ('full', 'value'), ({'linear': 1}, 'state'), ({'linear': 1}, 'state')]
    """
    parts: list[tuple[Any, str]] = []
    if not isinstance(context, list):
        return parts
    for i, kind in enumerate(context):
        try:
            parts.extend((kind, _PARTS.get(part, part)) for part, _ in layer_parts(kind, i, "DynamicCache"))
        except ValueError:
            return []
    return parts


_GROWS_ALONG = {"key": -2, "value": -2, "indexer_key": -2, "indexer_position": -1, "state": None}


def dynamic_empty_dims(context: Any) -> list[int | None]:
    """Per child of a ``DynamicCache``, the dimension along which a None child stands for an empty tensor.

    Keys, values and indexer keys grow along the sequence (``-2``), indexer positions along their
    last dimension; states do not grow (a None state is absent). A malformed context gives ``[]``
    (it is refused when the cache is rebuilt).

    Example:
        >>> dynamic_empty_dims(["full", {"linear": 1}])
        [-2, -2, None, None]
    """
    return [_GROWS_ALONG[part] for _, part in dynamic_cache_parts(context)]


QUANTIZED_LAYER_CHILDREN = 8
"""Children of one quantized layer: residual key and value, then packed codes, scales and shifts of keys and values."""

_QUANTIZED_SETTINGS = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")


def quantized_settings(kind: Any, index: int) -> dict[str, int]:
    """The settings of a ``{"quanto": {...}}`` layer kind read from a bundle, checked.

    Only what iobundle rebuilds is accepted: 2 or 4 bits, quantization along axis 0 (per group of
    ``q_group_size`` channels of the head dimension), positive group size and residual length.

    Raises:
        ValueError: ``kind`` is not such a kind.

    Example:
        >>> quantized_settings({"quanto": {"nbits": 4, "axis_key": 0, "axis_value": 0,
        ...     "q_group_size": 16, "residual_length": 8}}, 0)["nbits"]
        4
    """
    settings = kind.get("quanto") if isinstance(kind, dict) and len(kind) == 1 else None
    if not isinstance(settings, dict) or sorted(settings) != sorted(_QUANTIZED_SETTINGS):
        raise ValueError(
            f"Layer {index} of the QuantizedCache has kind {kind!r}; expected {{'quanto': {{...}}}} with the settings "
            f"{', '.join(_QUANTIZED_SETTINGS)}."
        )
    if settings["nbits"] not in (2, 4) or isinstance(settings["nbits"], bool):
        raise ValueError(f"Layer {index} of the QuantizedCache has nbits {settings['nbits']!r}; expected 2 or 4.")
    for axis in ("axis_key", "axis_value"):
        if settings[axis] != 0 or isinstance(settings[axis], bool):
            raise ValueError(f"Layer {index} of the QuantizedCache has {axis} {settings[axis]!r}; expected 0.")
    positive_int(settings["q_group_size"], "a quantization group size", index)
    positive_int(settings["residual_length"], "a residual length", index)
    return {name: int(settings[name]) for name in _QUANTIZED_SETTINGS}


def quantized_empty_dims(context: Any) -> list[int | None]:
    """Per child of a ``QuantizedCache``: every child grows along the sequence (``-2``).

    A None residual is an empty one (the residual was just moved into the quantized states); a
    layer whose quantized states are None (or zero-length) is not initialised yet. A malformed
    context gives ``[]``.
    """
    if not isinstance(context, list):
        return []
    return [-2] * (QUANTIZED_LAYER_CHILDREN * len(context))


BUILTIN_LAYOUTS: dict[tuple[str, int], Layout] = {
    # a layer not filled yet is (B, H, 0, D)
    (DYNAMIC_CACHE_NAME, NODE_TYPE_VERSION): Layout(empty_dim=-2, child_empty_dims=dynamic_empty_dims),
    (STATIC_CACHE_NAME, NODE_TYPE_VERSION): Layout(),
    (ENCODER_DECODER_CACHE_NAME, NODE_TYPE_VERSION): Layout(),
    (QUANTIZED_CACHE_NAME, NODE_TYPE_VERSION): Layout(empty_dim=-2, child_empty_dims=quantized_empty_dims),
}
"""The layouts of the built-in node types, by name and version (a node type not listed has the default layout)."""
