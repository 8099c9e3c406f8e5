"""transformers' ``DynamicCache``, ``StaticCache`` and ``EncoderDecoderCache``: layer kinds, flattened and rebuilt.

The node types of :mod:`iobundle.calls._transformers` and :mod:`iobundle.calls._torch_pytree` use
these functions (see there for what is refused and why caches are rebuilt the way they are).
Flattened layouts (all version 1):

``transformers.DynamicCache``
    Context: one kind per layer; the layer's children follow each other in layer order, as
    many per layer as its kind says:

    - ``"full"`` (``DynamicLayer``): ``key_i, value_i``;
    - ``{"sliding": window}`` (``DynamicSlidingWindowLayer``, which also serves chunked
      attention; ``"record_past": true`` is added when the layer records past states):
      ``key_i, value_i``;
    - ``"dummy"`` (``DummyLayer``, a KV-sharing or attention-free layer): two children, always None;
    - ``"indexed"`` (``DynamicIndexedLayer``, sparse attention with an indexer):
      ``key_i, value_i, indexer_keys_i, indexer_position_ids_i``;
    - ``{"linear": n}`` (``LinearAttentionLayer``: state-space, short-convolution and
      linear-attention layers, ``n`` states): ``conv_i, recurrent_i`` per state (suffixed
      ``_s`` when ``n > 1``), None where a state holds nothing (a layer before its prefill,
      a convolution layer without recurrent state);
    - ``{"linear": n, "attention": "full"}`` (``LinearAttentionAndFullAttentionLayer``) and
      ``{"linear": n, "attention": {"sliding": window}}``
      (``LinearAttentionAndSlidingWindowAttentionLayer``): ``key_i, value_i`` then the states.

    A linear-attention state with a tensor is rebuilt as a state after a prefill
    (``has_previous_state``), its kernel size the convolution state's last dimension; such
    states do not grow (``child_empty_dims``: a None state is absent, never a zero-length
    tensor). A layer that records its past states (assisted decoding) is refused: its
    convolution state's length is then not the kernel size. Bundles written when only the first
    three kinds existed read the same.

    A layer not initialised yet (the cache generate() passes to the prefill call), or holding
    the 1-D empty placeholders of ``Cache.early_initialization``, tells nothing of batch, heads
    or head size: its key and value children are ``None`` (as many children as an initialised
    layer), and unflatten to an uninitialised layer; zero-length tensors unflatten to an
    initialised, empty one. The node type declares ``empty_dim=-2``: shape inference counts
    such a slot as a sequence length of 0 (so the cache length is dynamic even when every decode
    call has the same one) and fills it with a ``(B, H, 0, D)`` tensor built from the other calls.

    A sliding layer's ``cumulative_length`` (tokens seen, a Python int that changes at every
    call) cannot go in the context; it is rebuilt as the cached length ``keys.shape[-2]``, exact
    until the window is full. :func:`restore_token_counts` then gives the rebuilt layers of a
    call the count its 2-D attention mask implies, on every call the replay rebuilds. It is not
    a tensor child (as in ``StaticCache``): transformers branches on it in Python, which a
    traced program cannot do on a tensor (see the ``sliding_window_offsets`` export patch).

    A ``DynamicCache()`` built without a config and not used yet has no layers at all: it
    flattens to no children and an empty context, and unflattens to such a lazy cache.

``transformers.StaticCache``
    Children: ``[key_0, value_0, cumulative_length_0, key_1, ...]``, three per layer: the
    preallocated ``(B, H, max_cache_len, D)`` tensors and the 0-d int64 tensor counting the
    tokens written (tensors, not context, since they change from call to call). An
    uninitialised layer gives ``None, None, cumulative_length``. Context: ``{"static":
    max_cache_len}`` per layer, or ``"dummy"``; ``{"linear": n}`` (a ``LinearAttentionLayer``,
    which a static cache uses as it is) and ``{"linear": n, "attention": {"static":
    max_cache_len}}`` (``LinearAttentionAndStaticFullAttentionLayer``) add their states as in
    a ``DynamicCache``. Sliding and indexed static layers are refused: their token counts are
    Python ints that the tensors cannot give back once the window is full.
    A static cache is updated in place, so a recorder must copy its tensors at call time.

``transformers.EncoderDecoderCache``
    Children: ``[self_attention_cache, cross_attention_cache]`` (two registered caches).
    Context: None. ``is_updated`` is recomputed from the cross-attention cache on rebuild,
    as the transformers constructor does.

"""

# transformers leaves its cache layer constructors unannotated.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import json
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticCache,
    StaticLayer,
)

from iobundle.calls._layouts import MAX_STATES, attention_name, kind_children, positive_int
from iobundle.errors import UnsupportedInputError

# --------------------------------------------------------------------------- layers


def require_pair(key: Any, value: Any, index: int) -> bool:
    """Return whether the layer ``index`` holds tensors; refuse a key without value or back."""
    if (key is None) != (value is None):
        raise ValueError(
            f"Layer {index} of the cache has a {'key' if key is not None else 'value'} tensor but no "
            f"{'value' if key is not None else 'key'} tensor. Give both, or None for both."
        )
    return key is not None


def _is_dummy(kind: Any, key: Any, value: Any, index: int) -> bool:
    """Whether ``kind`` is a dummy layer (refused when it holds tensors); checks the key and value pair."""
    filled = require_pair(key, value, index)
    if kind == "dummy" and filled:
        raise ValueError(f"Layer {index} of the cache is a dummy layer, which holds no tensors.")
    return kind == "dummy"


def refuse_layer(layer: Any, index: int, cache: str, why: str) -> UnsupportedInputError:
    return UnsupportedInputError(
        f"Layer {index} of the {cache} is a {type(layer).__name__}, which iobundle cannot record: {why} "
        "Record this model with a DynamicCache (the generate() default) or a StaticCache without sliding layers."
    )


def _linear_kind(layer: Any, index: int, cache: str) -> int:
    """The number of states of a linear-attention layer, refusing one that records its past."""
    if layer.record_past:
        raise refuse_layer(
            layer,
            index,
            cache,
            "it records past convolution states (assisted decoding), whose length its tensors cannot tell apart "
            "from the kernel size.",
        )
    return int(layer.number_of_states)


def _linear_states(layer: Any) -> list[Any]:
    """A linear-attention layer's ``[conv_0, recurrent_0, conv_1, ...]``, None where a state holds nothing yet."""
    children: list[Any] = []
    for i in range(layer.number_of_states):
        if not layer.has_previous_state[i]:
            children.extend([None, None])
            continue
        conv = layer.conv_states[i] if layer.is_conv_states_initialized[i] else None
        recurrent = layer.recurrent_states[i] if layer.is_recurrent_states_initialized[i] else None
        children.extend([conv, recurrent])
    return children


def _fill_linear_states(layer: Any, children: list[Any]) -> None:
    """Give a built linear-attention layer its ``[conv_0, recurrent_0, ...]`` states (Nones: none yet).

    A state with a tensor has a previous state, as after a real prefill; the kernel size is the
    convolution state's last dimension, which is exact when past states are not recorded.
    """
    for i in range(layer.number_of_states):
        conv, recurrent = children[2 * i], children[2 * i + 1]
        for tensor in (conv, recurrent):
            if tensor is not None and layer.dtype is None:
                layer.dtype, layer.device = tensor.dtype, tensor.device
        if conv is not None:
            layer.conv_states[i] = conv
            layer.conv_kernel_size[i] = conv.shape[-1]
            layer.is_conv_states_initialized[i] = True
        if recurrent is not None:
            layer.recurrent_states[i] = recurrent
            layer.is_recurrent_states_initialized[i] = True
        layer.has_previous_state[i] = conv is not None or recurrent is not None


def _dynamic_layer_kind(layer: Any, index: int) -> Any:
    """Return the JSON kind of one ``DynamicCache`` layer, refusing layers it cannot rebuild."""
    layer_type = type(layer)
    if layer_type is DynamicLayer:
        return "full"
    if layer_type is DynamicSlidingWindowLayer:
        return _sliding_kind(layer)
    if layer_type is DynamicIndexedLayer:
        return "indexed"
    if layer_type is DummyLayer:
        return "dummy"
    if layer_type is LinearAttentionLayer:
        return {"linear": _linear_kind(layer, index, "DynamicCache")}
    if layer_type is LinearAttentionAndFullAttentionLayer:
        return {"linear": _linear_kind(layer, index, "DynamicCache"), "attention": "full"}
    if layer_type is LinearAttentionAndSlidingWindowAttentionLayer:
        return {"linear": _linear_kind(layer, index, "DynamicCache"), "attention": _sliding_kind(layer)}
    raise refuse_layer(layer, index, "DynamicCache", "it holds state that is not plain tensors and plain settings.")


def _sliding_kind(layer: Any) -> dict[str, Any]:
    kind: dict[str, Any] = {"sliding": int(layer.sliding_window)}
    if layer.record_past:
        kind["record_past"] = True
    return kind


def _build_dynamic_layer(kind: Any, children: list[Any], index: int) -> Any:
    """Build one ``DynamicCache`` layer of ``kind`` holding ``children`` (Nones: nothing yet)."""
    if isinstance(kind, dict) and "linear" in kind:
        return _build_linear_layer(kind, children, index)
    key, value = children[:2]
    if _is_dummy(kind, key, value, index):
        return DummyLayer()
    if kind == "full":
        layer: Any = DynamicLayer()
    elif kind == "indexed":
        layer = DynamicIndexedLayer()
        indexer_keys, positions = children[2:]
        if indexer_keys is not None:
            layer.indexer_keys = indexer_keys
            layer.indexer_dtype, layer.indexer_device = indexer_keys.dtype, indexer_keys.device
            layer.is_indexer_initialized = True
        elif positions is not None:
            raise ValueError(f"Layer {index} of the cache has indexer positions but no indexer keys.")
        layer.indexer_position_ids = positions
    elif isinstance(kind, dict) and "sliding" in kind:
        layer = _new_sliding_layer(positive_int(kind["sliding"], "a sliding window", index), key)
    else:
        raise ValueError(f"Layer {index} of the cache has an unknown kind {kind!r}.")
    _fill_dynamic_attention(layer, key, value, kind)
    return layer


def _fill_dynamic_attention(layer: Any, key: Any, value: Any, kind: Any) -> None:
    """Give a built dynamic attention layer its keys and values (None: not initialised yet)."""
    if isinstance(kind, dict) and "sliding" in kind:
        layer.record_past = bool(kind.get("record_past", False))
    if key is None:
        return
    layer.keys = key
    layer.values = value
    layer.device = key.device
    layer.is_initialized = True
    if isinstance(layer, DynamicSlidingWindowLayer):
        # Only the cached length is known here; restore_token_counts gives the count a call implies.
        layer.cumulative_length = key.shape[-2]


# The names of a call's 2-D attention mask and of its new tokens, tried in order; an
# encoder-decoder cache's sliding layers belong to the decoder.
_DECODER_INPUTS = (("decoder_attention_mask", ("decoder_input_ids", "decoder_inputs_embeds")),)
_INPUTS = (("attention_mask", ("input_ids", "inputs_embeds")),)


def restore_token_counts(arguments: dict[str, Any]) -> int:
    """Give each rebuilt sliding-window layer among a call's ``arguments`` (by name) the token count the call implies.

    A rebuilt ``DynamicSlidingWindowLayer`` counts the cached keys only: once its window is full,
    transformers' ``get_mask_sizes`` then gives a key offset of 0 instead of ``tokens_seen -
    window + 1`` (a left-padded batch's mask read from the wrong columns; chunked attention's
    wrong keys masked). A 2-D attention mask covers the tokens seen plus the new ones (what
    ``generate()`` passes), so the count is ``mask length - new tokens``, set where it agrees
    with the cache (``min(count, window - 1)`` keys, no past states recorded); symbolic sizes
    (while tracing) are not compared, so no guard is added. Returns how many layers got a count.
    """
    count = 0
    for value in arguments.values():
        if not isinstance(value, Cache):
            continue
        names: tuple[tuple[str, tuple[str, str]], ...] = _INPUTS
        if isinstance(value, EncoderDecoderCache):
            value, names = value.self_attention_cache, _DECODER_INPUTS + _INPUTS
        tokens = _seen_tokens(arguments, names)
        if tokens is None:
            continue
        for layer in getattr(value, "layers", ()):
            if isinstance(layer, DynamicSlidingWindowLayer) and _agrees(layer, tokens):
                layer.cumulative_length = tokens
                count += 1
    return count


def _seen_tokens(arguments: dict[str, Any], names: tuple[tuple[str, tuple[str, ...]], ...]) -> Any:
    """``mask length - new tokens`` from the first of ``names`` the call has, or None."""
    for mask_name, token_names in names:
        mask = arguments.get(mask_name)
        tokens = next((arguments[n] for n in token_names if isinstance(arguments.get(n), torch.Tensor)), None)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tokens is not None and tokens.dim() >= 2:
            return mask.shape[-1] - tokens.shape[1]
    return None


def _agrees(layer: Any, tokens: Any) -> bool:
    """Whether a sliding layer holding its keys can have seen ``tokens`` tokens (always, for symbolic sizes)."""
    if layer.record_past:
        return False
    cached = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4 else 0
    if not (isinstance(tokens, int) and isinstance(cached, int)):
        return True
    return cached == min(tokens, layer.sliding_window - 1)


def _build_linear_layer(kind: dict[str, Any], children: list[Any], index: int) -> Any:
    """Build a linear-attention layer (alone, or with a full, sliding or static attention part).

    The constructors run in the order of the hybrid classes' own ``__init__`` (attention part,
    then the linear-attention mixin), minus the ones that call ``torch.tensor``.
    """
    states = positive_int(kind["linear"], "a number of states", index, most=MAX_STATES)
    attention = kind.get("attention")
    own, linear = children[: len(children) - 2 * states], children[len(children) - 2 * states :]
    cls = _LINEAR_CLASSES.get(attention_name(attention))
    if cls is None:
        raise ValueError(f"Layer {index} of the cache has an unknown attention kind {attention!r}.")
    layer: Any = object.__new__(cls)
    if attention == "full":
        DynamicLayer.__init__(layer)
    elif attention is not None and "sliding" in attention:
        _init_sliding(layer, positive_int(attention["sliding"], "a sliding window", index), own[0])
    LinearAttentionCacheLayerMixin.__init__(layer, number_of_states=states)
    if attention is not None and "static" in attention:
        key, value, length = own
        _fill_static_attention(layer, attention, key, value, length, index)
    elif attention is not None:
        key, value = own
        require_pair(key, value, index)
        _fill_dynamic_attention(layer, key, value, {})
    _fill_linear_states(layer, linear)
    return layer


_LINEAR_CLASSES: dict[str | None, type[Any]] = {
    None: LinearAttentionLayer,
    "full": LinearAttentionAndFullAttentionLayer,
    "sliding": LinearAttentionAndSlidingWindowAttentionLayer,
    "static": LinearAttentionAndStaticFullAttentionLayer,
}


def _new_sliding_layer(window: int, like: Any) -> Any:
    """Build an empty ``DynamicSlidingWindowLayer`` the way its ``__init__`` does, minus ``torch.tensor``."""
    layer = DynamicSlidingWindowLayer.__new__(DynamicSlidingWindowLayer)
    _init_sliding(layer, window, like)
    return layer


def _init_sliding(layer: Any, window: int, like: Any) -> None:
    """Run ``DynamicSlidingWindowLayer.__init__`` on ``layer``, minus ``torch.tensor``.

    ``__init__`` stores the window in a tensor made by ``torch.tensor(window)``. Made while
    torch.export traces the unflattening, such a tensor becomes a lifted constant of the
    program (``c_lifted_tensor_N``), which ``torch.onnx.export`` may later fail to find.
    ``torch.full`` is an operator instead: traced, and dropped when unused.
    """
    DynamicLayer.__init__(layer)
    layer.sliding_window = window
    layer.cumulative_length = 0
    device = None if like is None else like.device
    layer._sliding_window_tensor = torch.full((), window, dtype=torch.long, device=device)
    layer.record_past = False


def _static_layer_kind(layer: Any, index: int) -> Any:
    """Return the JSON kind of one ``StaticCache`` layer, refusing the ones we cannot rebuild."""
    layer_type = type(layer)
    if layer_type is StaticLayer:
        return {"static": int(layer.max_cache_len)}
    if layer_type is DummyLayer:
        return "dummy"
    if layer_type is LinearAttentionLayer:
        return {"linear": _linear_kind(layer, index, "StaticCache")}
    if layer_type is LinearAttentionAndStaticFullAttentionLayer:
        return {"linear": _linear_kind(layer, index, "StaticCache"), "attention": {"static": int(layer.max_cache_len)}}
    raise refuse_layer(
        layer,
        index,
        "StaticCache",
        "sliding static layers count tokens in a Python int that their tensors cannot give back once the window "
        "is full, and indexed ones hold counters of their own.",
    )


def _build_static_layer(kind: Any, children: list[Any], index: int) -> Any:
    """Build one ``StaticCache`` layer of ``kind`` holding ``children`` (Nones: nothing yet)."""
    if isinstance(kind, dict) and "linear" in kind:
        return _build_linear_layer(kind, children, index)
    key, value, length = children
    if _is_dummy(kind, key, value, index):
        return DummyLayer()
    if not (isinstance(kind, dict) and "static" in kind):
        raise ValueError(f"Layer {index} of the static cache has an unknown kind {kind!r}.")
    layer = StaticLayer.__new__(StaticLayer)
    _fill_static_attention(layer, kind, key, value, length, index)
    return layer


def _fill_static_attention(layer: Any, kind: dict[str, Any], key: Any, value: Any, length: Any, index: int) -> None:
    """Run ``StaticLayer.__init__`` on ``layer`` minus ``torch.tensor(0)``, and give it its tensors.

    ``torch.tensor(0)`` would be a lifted constant under torch.export (see :func:`_init_sliding`);
    the token count comes as a child.
    """
    filled = require_pair(key, value, index)
    CacheLayerMixin.__init__(layer)
    layer.max_cache_len = positive_int(kind["static"], "a maximum cache length", index)
    if length is None:
        length = torch.zeros((), dtype=torch.long, device=None if key is None else key.device)
    layer.cumulative_length = length
    if filled:
        layer.keys = key
        layer.values = value
        layer.device = key.device
        layer.batch_size, layer.num_heads = key.shape[:2]
        layer.k_head_dim = key.shape[-1]
        layer.v_head_dim = value.shape[-1]
        layer.is_initialized = True


# --------------------------------------------------------------------------- caches


def layer_tensors(layer: Any) -> tuple[Any, Any]:
    """Return a layer's key and value tensors, or two Nones when it holds no shaped tensors (see the module docstring)."""
    keys, values = layer.keys, layer.values
    if not layer.is_initialized or keys is None or values is None:
        return None, None
    if keys.dim() == 1 and keys.numel() == 0:
        return None, None
    return keys, values


def _layered(children: list[Any], context: Any, name: str) -> list[tuple[Any, list[Any]]]:
    """A cache's layer kinds, each with its children; refused unless the counts add up."""
    if not isinstance(context, list):
        raise ValueError(f"A {name} has a context of {type(context).__name__}; expected a list of layer kinds.")
    counts = [kind_children(kind, i, name) for i, kind in enumerate(context)]
    children = list(children)
    if len(children) != sum(counts):
        raise ValueError(
            f"A {name} of {len(context)} layers ({', '.join(map(json.dumps, context))}) flattens to "
            f"{sum(counts)} children, got {len(children)}."
        )
    layers, start = [], 0
    for kind, count in zip(context, counts, strict=True):
        layers.append((kind, children[start : start + count]))
        start += count
    return layers


def flatten_dynamic_cache(cache: Any) -> tuple[list[Any], list[Any]]:
    children: list[Any] = []
    kinds: list[Any] = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:  # most layers of most models, every call: inline
            kinds.append("full")
            children.extend(layer_tensors(layer))
            continue
        kind = _dynamic_layer_kind(layer, index)
        kinds.append(kind)
        if kind == "dummy":
            children.extend([None, None])
            continue
        if not (isinstance(kind, dict) and "linear" in kind and "attention" not in kind):
            children.extend(layer_tensors(layer))
        if kind == "indexed":
            children.extend([layer.indexer_keys if layer.is_indexer_initialized else None, layer.indexer_position_ids])
        if isinstance(kind, dict) and "linear" in kind:
            children.extend(_linear_states(layer))
    return children, kinds


def unflatten_dynamic_cache(children: list[Any], context: Any) -> Any:
    layers = _layered(children, context, "DynamicCache")
    cache = DynamicCache()
    if layers:
        cache.layers = [_build_dynamic_layer(kind, owned, i) for i, (kind, owned) in enumerate(layers)]
        cache.layer_class_to_replicate = None
    return cache


def flatten_static_cache(cache: Any) -> tuple[list[Any], list[Any]]:
    children: list[Any] = []
    kinds: list[Any] = []
    for index, layer in enumerate(cache.layers):
        kind = _static_layer_kind(layer, index)
        kinds.append(kind)
        if kind == "dummy":
            children.extend([None, None, None])
            continue
        if not (isinstance(kind, dict) and "linear" in kind and "attention" not in kind):
            children.extend(layer_tensors(layer))
            children.append(layer.cumulative_length)
        if isinstance(kind, dict) and "linear" in kind:
            children.extend(_linear_states(layer))
    return children, kinds


def unflatten_static_cache(children: list[Any], context: Any) -> Any:
    layers = [
        _build_static_layer(kind, owned, i)
        for i, (kind, owned) in enumerate(_layered(children, context, "StaticCache"))
    ]
    # StaticCache.__init__ wants a config to build its layers; the layers are already built.
    cache = StaticCache.__new__(StaticCache)
    Cache.__init__(cache, layers=layers)
    return cache


def flatten_encoder_decoder_cache(cache: Any) -> tuple[list[Any], None]:
    return [cache.self_attention_cache, cache.cross_attention_cache], None


def unflatten_encoder_decoder_cache(children: list[Any], context: Any) -> Any:
    self_attention_cache, cross_attention_cache = children
    return EncoderDecoderCache(self_attention_cache, cross_attention_cache)
