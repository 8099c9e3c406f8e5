"""Node types for transformers 5.x objects: KV caches and ``ModelOutput`` classes.

This module is imported only once a transformers object has been met, so it imports
transformers at the top. Importing it registers nothing: :func:`register_all` fills the
iobundle registry, and :func:`torch_pytree_nodes` lends the same layouts to
``torch.utils._pytree`` for a ``with`` block. The layouts' plain facts (names, version, layer
kinds' children, ``empty_dim``, ``child_empty_dims``) live in :mod:`iobundle.calls._layouts`,
which reading a bundle's shapes uses without importing this module.

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
    tensor, since the prefill of such a layer takes another code path). A layer that records
    its past states (assisted decoding) is refused: its convolution state's length is then
    not the kernel size. Before this version of iobundle only the first three kinds existed,
    with the same children: bundles written then read the same.

    A layer that is not initialised yet (the cache generate() passes to the prefill call)
    has no tensors, and nothing in it tells batch, heads or head size. Its key and value
    children are ``None``: the number of children is the same as for an initialised layer,
    and code that aligns several calls fills those slots with zero-length ``(B, H, 0, D)``
    tensors built from the other calls. ``None`` children unflatten to an uninitialised
    layer; zero-length tensors unflatten to an initialised, empty one. The 1-D empty
    placeholders that ``Cache.early_initialization`` leaves in a ``DynamicLayer`` say no more
    than nothing, and flatten to ``None`` as well. The node type declares ``empty_dim=-2``:
    shape inference counts such a slot as a sequence length of 0, so the cache length is
    dynamic even when every decode call has the same one (a full sliding window), and the
    slot is filled with a ``(B, H, 0, D)`` tensor.

    A sliding layer also holds a Python int, ``cumulative_length`` (tokens seen so far),
    which changes at every decode call and so cannot go in the context. It is rebuilt as the
    cached length ``keys.shape[-2]``. That is exact until the window is full; afterwards the
    rebuilt cache reports a shorter length, and transformers' ``get_mask_sizes`` a key offset
    of 0, which reads the padding of a left-padded batch from the wrong columns of the mask
    and, for chunked attention (whose chunk boundaries are absolute positions), masks the
    wrong keys even without padding. :func:`restore_token_counts` gives the rebuilt layers of
    a call's arguments the count its 2-D attention mask implies (mask length minus new
    tokens); the replay runs it on every call it rebuilds (``infer_arguments``, the arguments
    of an eager re-run), so the eager model reproduces the recorded outputs, on the recorded
    batch and on a cut of it. It is not made a tensor child (as
    ``StaticCache`` does): transformers branches on it in Python (``get_mask_sizes``:
    ``if cumulative_length >= sliding_window``, ``max(...)``), which a traced program cannot
    do on a tensor; the exported program takes the count from the mask the same way (the
    ``sliding_window_offsets`` patch of ``iobundle.replay.export``).

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

``transformers.QuantizedCache``
    Context: one kind per layer, ``{"quanto": {"nbits", "axis_key", "axis_value",
    "q_group_size", "residual_length"}}`` (a ``QuantoQuantizedLayer``'s settings). Eight
    children per layer: ``key_i, value_i`` (the residual: the latest keys and values in full
    precision, zero-length when empty), then ``key_codes_i, key_scale_i, key_shift_i`` and the same
    for values: the quantized states as plain tensors (:class:`QuantizedStates`: ``uint8``
    codes packed along the head dimension, one scale and shift per group of ``q_group_size``
    channels), read from quanto's tensor through its attributes; all None for a layer not
    initialised yet (the prefill's cache). Every child grows along ``-2``. The token count
    is rebuilt as the quantized plus the residual length, which is what it is. The rebuilt
    layer holds :class:`QuantizedStates` and quantizes with :func:`quantize_states` (the same
    operators as quanto, bit for bit), so replaying and exporting need no quantization
    library, and the program holds only plain torch operators. Refused at capture: the HQQ
    and FP8 backends, quantization along axis -1 (its groups run across positions), groups
    that do not divide the head size, and a pending beam reordering.

``ModelOutput`` subclasses
    Children: the values that are not None, in field order. Context: their keys. Classes
    defined outside ``transformers.models`` (``transformers.modeling_outputs``,
    ``transformers.generation``, ...) are named ``"transformers." + class name``, e.g.
    ``transformers.CausalLMOutputWithPast``. Model-specific classes are named
    ``"transformers.models.<model>." + class name``: a few class names are defined by
    several models (``DetrDecoderOutput``, ``BaseModelOutputWithDeepstackFeatures``), and a
    name must not depend on which models happen to be imported.

Caches are rebuilt by assigning tensors to new layers, never through ``update()``: that
would cut sliding caches again and create tensor constants that break
``torch.onnx.export``. For the same reason no layer is built by a constructor that calls
``torch.tensor`` (see ``_init_sliding``). Subclasses of these caches (``MtpCache``,
``DFlashCache``) are not registered, and layers holding state besides tensors and plain
settings (HQQ's tuples with scales, FP8's per-tensor scale) are refused with
``UnsupportedInputError``; a recorder turns that into one warning at capture.
Contexts read from a bundle are checked before use (kinds, positive sizes, child counts):
nothing named in them is imported or called, only the classes above are built.
"""

# transformers leaves its cache layer constructors unannotated.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
import transformers
import transformers.generation.utils
import transformers.modeling_outputs
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DFlashCache,
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    Fp8QuantizedLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    MtpCache,
    QuantizedCache,
    QuantizedLayer,
    QuantoQuantizedLayer,
    StaticCache,
    StaticLayer,
)
from transformers.utils.generic import ModelOutput

from iobundle.calls._layouts import (
    BUILTIN_LAYOUTS,
    DYNAMIC_CACHE_NAME,
    ENCODER_DECODER_CACHE_NAME,
    MAX_STATES,
    NODE_TYPE_VERSION,
    QUANTIZED_CACHE_NAME,
    QUANTIZED_LAYER_CHILDREN,
    STATIC_CACHE_NAME,
    attention_name,
    kind_children,
    layer_parts,
    positive_int,
    quantized_settings,
)
from iobundle.calls._registry import NodeType, register_node_type
from iobundle.errors import UnsupportedInputError

__all__ = ["register_all", "torch_pytree_nodes"]

logger = logging.getLogger(__name__)

_MODELS_PREFIX = "transformers.models."


# --------------------------------------------------------------------------- layers


def _require_pair(key: Any, value: Any, index: int) -> bool:
    """Return whether the layer ``index`` holds tensors; refuse a key without value or back."""
    if (key is None) != (value is None):
        raise ValueError(
            f"Layer {index} of the cache has a {'key' if key is not None else 'value'} tensor but no "
            f"{'value' if key is not None else 'key'} tensor. Give both, or None for both."
        )
    return key is not None


def _refuse_layer(layer: Any, index: int, cache: str, why: str) -> UnsupportedInputError:
    return UnsupportedInputError(
        f"Layer {index} of the {cache} is a {type(layer).__name__}, which iobundle cannot record: {why} "
        "Record this model with a DynamicCache (the generate() default) or a StaticCache without sliding layers."
    )


def _linear_kind(layer: Any, index: int, cache: str) -> int:
    """The number of states of a linear-attention layer, refusing one that records its past."""
    if layer.record_past:
        raise _refuse_layer(
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
    raise _refuse_layer(layer, index, "DynamicCache", "it holds state that is not plain tensors and plain settings.")


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
    filled = _require_pair(key, value, index)
    if kind == "dummy":
        if filled:
            raise ValueError(f"Layer {index} of the cache is a dummy layer, which holds no tensors.")
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

    A rebuilt ``DynamicSlidingWindowLayer`` counts the cached keys only (see the module
    docstring): once its window is full, that is fewer than the tokens seen, and transformers'
    ``get_mask_sizes`` gives a key offset of 0 instead of ``tokens_seen - window + 1``. A 2-D
    attention mask covers the tokens seen plus the new ones (what transformers' masks assume,
    and what ``generate()`` passes), so the count is ``mask length - new tokens``. It is set
    where it agrees with the cache (the layer holds ``min(count, window - 1)`` keys and does not
    record past states); sizes that are symbolic (while tracing) are not compared, so that no
    guard is added. Returns how many layers were given a count; without such a mask, none.
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
        _require_pair(key, value, index)
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
    raise _refuse_layer(
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
    filled = _require_pair(key, value, index)
    if kind == "dummy":
        if filled:
            raise ValueError(f"Layer {index} of the cache is a dummy layer, which holds no tensors.")
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
    filled = _require_pair(key, value, index)
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


# --------------------------------------------------------------------------- quantized layers


@dataclasses.dataclass
class QuantizedStates:
    """The quantized keys or values of a quantized cache layer, as plain tensors (no quantization library).

    ``codes`` are the ``nbits``-bit codes of a ``(B, H, L, D)`` tensor packed along the head
    dimension, ``8 // nbits`` per byte, the lowest bits first: ``(B, H, L, D * nbits // 8)``
    ``uint8``. ``scale`` and ``shift`` are ``(B, H, L, D // q_group_size)``, one per group of
    ``q_group_size`` channels, in the states' dtype. The value of a code ``c`` is
    ``scale * c - shift``: optimum-quanto's affine ``qint2``/``qint4`` quantization of axis 0,
    done with the same torch operators in the same order, so the values are the same bits.
    A rebuilt quantized layer holds its states in this form and :meth:`dequantize` is what the
    layer calls, so eager runs and traced programs need no quantization library.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor
    nbits: int

    def dequantize(self) -> torch.Tensor:
        """The ``(B, H, L, D)`` states these codes stand for."""
        codes = self.codes.to(torch.int32)
        levels = 1 << self.nbits
        # integer division and remainder rather than shifts and masks: onnxruntime's BitShift takes unsigned types only
        unpacked = torch.stack([(codes // levels**j) % levels for j in range(8 // self.nbits)], dim=-1)
        data = unpacked.reshape(*codes.shape[:-1], -1)
        grouped = data.reshape(*data.shape[:-1], self.scale.shape[-1], -1)
        dequantized = self.scale.unsqueeze(-1) * grouped
        dequantized -= self.shift.unsqueeze(-1)
        return dequantized.reshape(data.shape)


def quantize_states(tensor: torch.Tensor, nbits: int, group_size: int) -> QuantizedStates:
    """Quantize ``(B, H, L, D)`` states per group of ``group_size`` channels, as optimum-quanto does on axis 0.

    The scale and shift come from each group's minimum and maximum (quanto's ``MaxOptimizer``),
    the codes are ``round((x + shift) / scale)`` clamped to ``[0, 2**nbits - 1]``.
    """
    grouped = tensor.reshape(*tensor.shape[:-1], tensor.shape[-1] // group_size, group_size)
    rmin = torch.amin(grouped, dim=-1, keepdim=True)
    rmax = torch.amax(grouped, dim=-1, keepdim=True)
    scale = (rmax - rmin) / (2**nbits - 1)
    shift = -rmin
    data = torch.clamp(torch.round((grouped + shift) / scale), min=0, max=2**nbits - 1).to(torch.uint8)
    return QuantizedStates(_pack_codes(data.reshape(tensor.shape), nbits), scale.squeeze(-1), shift.squeeze(-1), nbits)


def _pack_codes(data: torch.Tensor, nbits: int) -> torch.Tensor:
    """Pack ``uint8`` codes of ``nbits`` along the last dimension, ``8 // nbits`` per byte, lowest bits first."""
    per_byte = 8 // nbits
    grouped = data.to(torch.int32).reshape(*data.shape[:-1], data.shape[-1] // per_byte, per_byte)
    packed = grouped[..., 0]
    for j in range(1, per_byte):
        packed = packed + grouped[..., j] * (1 << (nbits * j))
    return packed.to(torch.uint8)


def _quantize_rebuilt(self: Any, tensor: torch.Tensor, axis: int) -> QuantizedStates:
    """``_quantize`` of a rebuilt quantized layer (axis 0, checked when it was rebuilt)."""
    return quantize_states(tensor, self.nbits, self.q_group_size)


def _quanto_settings(layer: Any, index: int) -> dict[str, int]:
    """The settings of a quantized layer iobundle can rebuild (quanto, axis 0), refusing the others."""
    if type(layer) is not QuantoQuantizedLayer:
        why = (
            "its keys and values are 8-bit floats scaled by a per-tensor factor that iobundle does not record."
            if isinstance(layer, Fp8QuantizedLayer)
            else "iobundle rebuilds the quantized layers of the quanto backend only "
            "(cache_config={'backend': 'quanto', ...})."
        )
        raise _refuse_layer(layer, index, "QuantizedCache", why)
    settings = {
        "nbits": int(layer.nbits),
        "axis_key": int(layer.axis_key),
        "axis_value": int(layer.axis_value),
        "q_group_size": int(layer.q_group_size),
        "residual_length": int(layer.residual_length),
    }
    if settings["axis_key"] != 0 or settings["axis_value"] != 0:
        raise _refuse_layer(
            layer,
            index,
            "QuantizedCache",
            "it quantizes along axis -1, whose groups run across cached positions, so a cache of another length "
            "regroups them; axis_key=0 and axis_value=0 (the default) can be recorded.",
        )
    if layer._pending_beam_idx is not None:
        raise _refuse_layer(
            layer, index, "QuantizedCache", "it holds a beam reordering not applied yet (beam search)."
        )
    return settings


def _plain_states(states: Any, settings: dict[str, int], index: int) -> list[torch.Tensor]:
    """``[codes, scale, shift]`` of a layer's quantized keys or values (see :class:`QuantizedStates`).

    The quanto tensor is read through its attributes (``_data``, ``_scale``, ``_shift``, its
    size, axis and group size); nothing of quanto is imported or called.
    """
    if isinstance(states, QuantizedStates):
        return [states.codes, states.scale, states.shift]
    nbits, group_size = settings["nbits"], settings["q_group_size"]
    size = tuple(states.shape)
    if (
        len(size) != 4
        or getattr(states, "axis", None) != 0
        or getattr(states, "_group_size", None) != group_size
        or size[-1] % group_size
        or size[-1] % (8 // nbits)
    ):
        raise UnsupportedInputError(
            f"Layer {index} of the QuantizedCache holds quantized states of size {list(size)} quantized along axis "
            f"{getattr(states, 'axis', None)!r} in groups of {getattr(states, '_group_size', None)!r}, which iobundle "
            f"cannot rebuild: it needs (batch, heads, length, head_dim) states grouped along axis 0 in groups that "
            f"divide head_dim ({size[-1] if size else '?'}). Use a q_group_size that divides the head dimension."
        )
    packed = states._data
    if getattr(packed, "_bits", None) == nbits:
        raw = packed._data
        per_byte = 8 // nbits
        rows = packed.shape[0]
        codes = torch.cat([(raw >> (nbits * j)) & ((1 << nbits) - 1) for j in range(per_byte)])[:rows]
    else:
        codes = packed
    groups = (*size[:-1], size[-1] // group_size)
    scale = states._scale.reshape(groups)
    shift = states._shift.reshape(groups)
    return [_pack_codes(codes.reshape(size).to(torch.uint8), nbits), scale, shift]


def _flatten_quantized_cache(cache: Any) -> tuple[list[Any], list[Any]]:
    children: list[Any] = []
    kinds: list[Any] = []
    for index, layer in enumerate(cache.layers):
        settings = _quanto_settings(layer, index)
        kinds.append({"quanto": settings})
        if not layer.is_initialized or layer._quantized_keys is None:
            children.extend([None] * QUANTIZED_LAYER_CHILDREN)
            continue
        keys_states = _plain_states(layer._quantized_keys, settings, index)
        values_states = _plain_states(layer._quantized_values, settings, index)
        children.extend(_residual_tensors(layer, keys_states[1], values_states[1], settings["q_group_size"]))
        children.extend(keys_states + values_states)
    return children, kinds


def _residual_tensors(layer: Any, key_scale: torch.Tensor, value_scale: torch.Tensor, group_size: int) -> list[Any]:
    """A quantized layer's residual keys and values; an empty one as ``(B, H, 0, D)`` tensors.

    transformers leaves 1-D placeholders when it moves the residual into the quantized states;
    the quantized states' shapes say what the empty residual's batch, heads and head size are.
    A zero-length residual rather than None keeps the step after such a move of the same
    structure as the other decode steps, so one program serves them all.
    """
    keys, values = _layer_tensors(layer)
    if keys is not None:
        return [keys, values]
    shape = (*key_scale.shape[:2], 0, key_scale.shape[-1] * group_size)
    return [key_scale.new_zeros(shape), value_scale.new_zeros(shape)]


def _build_quantized_layer(kind: Any, children: list[Any], index: int) -> Any:
    """Build a ``QuantoQuantizedLayer`` holding ``children`` without its constructor (which imports quanto).

    Its quantized states are :class:`QuantizedStates`, and its ``_quantize`` is
    :func:`quantize_states`, bound to the rebuilt layer only: the class is left alone.
    Quantized states that are None or zero-length make a layer not initialised yet (a real
    layer always holds the prefill's states); a None residual is an empty one.
    """
    settings = quantized_settings(kind, index)
    layer = QuantoQuantizedLayer.__new__(QuantoQuantizedLayer)
    QuantizedLayer.__init__(layer, **settings)
    layer._quantize = types.MethodType(_quantize_rebuilt, layer)  # type: ignore[method-assign]  # this layer's only
    key, value, *states = children
    if any(t is None for t in states):
        if any(t is not None for t in [key, value, *states]):
            raise ValueError(
                f"Layer {index} of the QuantizedCache holds some of its tensors but not all; give all eight, or a "
                "None residual key and value with the six quantized ones, or none."
            )
        return layer
    nbits, group_size = settings["nbits"], settings["q_group_size"]
    keys_states = _rebuilt_states(states[:3], nbits, group_size, index, "keys")
    values_states = _rebuilt_states(states[3:], nbits, group_size, index, "values")
    if keys_states.codes.shape[-2] == 0:
        return layer
    if _require_pair(key, value, index):
        residual = key.shape[-2]
    else:
        # (B, H, 0, D), not the 1-D placeholder transformers leaves: ONNX's Concat does not skip it as torch.cat does
        shape = (*keys_states.scale.shape[:2], 0, keys_states.scale.shape[-1] * group_size)
        key = torch.zeros(shape, dtype=keys_states.scale.dtype, device=keys_states.scale.device)
        value = torch.zeros(shape, dtype=values_states.scale.dtype, device=values_states.scale.device)
        residual = 0
    layer.keys, layer.values = key, value
    layer.device = key.device
    layer.is_initialized = True
    layer._quantized_keys, layer._quantized_values = keys_states, values_states
    layer.cumulative_length = keys_states.codes.shape[-2] + residual
    return layer


def _rebuilt_states(tensors: list[Any], nbits: int, group_size: int, index: int, what: str) -> QuantizedStates:
    """The quantized ``what`` of layer ``index`` from its codes, scales and shifts, their shapes checked."""
    codes, scale, shift = tensors
    if (
        codes.dtype != torch.uint8
        or codes.dim() != 4
        or scale.shape != shift.shape
        or scale.dim() != 4
        or codes.shape[-1] * (8 // nbits) != scale.shape[-1] * group_size
        or not scale.dtype.is_floating_point
    ):
        raise ValueError(
            f"Layer {index} of the QuantizedCache has quantized {what} of codes {codes.dtype} {list(codes.shape)}, "
            f"scales {list(scale.shape)} and shifts {list(shift.shape)}; expected uint8 (B, H, L, D * {nbits} // 8) "
            f"codes and floating (B, H, L, D // {group_size}) scales and shifts."
        )
    return QuantizedStates(codes, scale, shift, nbits)


def _unflatten_quantized_cache(children: list[Any], context: Any) -> Any:
    if not isinstance(context, list):
        raise ValueError(f"A QuantizedCache has a context of {type(context).__name__}; expected a list of layer kinds.")
    children = list(children)
    if len(children) != QUANTIZED_LAYER_CHILDREN * len(context):
        raise ValueError(
            f"A QuantizedCache of {len(context)} layers flattens to {QUANTIZED_LAYER_CHILDREN * len(context)} "
            f"children, got {len(children)}."
        )
    count = QUANTIZED_LAYER_CHILDREN
    layers = [_build_quantized_layer(kind, children[i * count : (i + 1) * count], i) for i, kind in enumerate(context)]
    # QuantizedCache.__init__ wants a config and builds layers that import quanto; the layers are built.
    cache = QuantizedCache.__new__(QuantizedCache)
    Cache.__init__(cache, layers=layers)
    return cache


# --------------------------------------------------------------------------- caches


def _layer_tensors(layer: Any) -> tuple[Any, Any]:
    """Return a layer's key and value tensors, or two Nones when it holds no shaped tensors.

    ``DynamicLayer.lazy_initialization`` (hence ``Cache.early_initialization``) leaves 1-D
    empty placeholders that say nothing of batch, heads or head size; they count as absent,
    and an uninitialised layer behaves the same.
    """
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


def _flatten_dynamic_cache(cache: Any) -> tuple[list[Any], list[Any]]:
    children: list[Any] = []
    kinds: list[Any] = []
    for index, layer in enumerate(cache.layers):
        kind = _dynamic_layer_kind(layer, index)
        kinds.append(kind)
        if kind == "dummy":
            children.extend([None, None])
            continue
        if not (isinstance(kind, dict) and "linear" in kind and "attention" not in kind):
            children.extend(_layer_tensors(layer))
        if kind == "indexed":
            children.extend([layer.indexer_keys if layer.is_indexer_initialized else None, layer.indexer_position_ids])
        if isinstance(kind, dict) and "linear" in kind:
            children.extend(_linear_states(layer))
    return children, kinds


def _unflatten_dynamic_cache(children: list[Any], context: Any) -> Any:
    layers = _layered(children, context, "DynamicCache")
    cache = DynamicCache()
    if layers:
        cache.layers = [_build_dynamic_layer(kind, owned, i) for i, (kind, owned) in enumerate(layers)]
        cache.layer_class_to_replicate = None
    return cache


def _flatten_static_cache(cache: Any) -> tuple[list[Any], list[Any]]:
    children: list[Any] = []
    kinds: list[Any] = []
    for index, layer in enumerate(cache.layers):
        kind = _static_layer_kind(layer, index)
        kinds.append(kind)
        if kind == "dummy":
            children.extend([None, None, None])
            continue
        if not (isinstance(kind, dict) and "linear" in kind and "attention" not in kind):
            children.extend(_layer_tensors(layer))
            children.append(layer.cumulative_length)
        if isinstance(kind, dict) and "linear" in kind:
            children.extend(_linear_states(layer))
    return children, kinds


def _unflatten_static_cache(children: list[Any], context: Any) -> Any:
    layers = [
        _build_static_layer(kind, owned, i)
        for i, (kind, owned) in enumerate(_layered(children, context, "StaticCache"))
    ]
    # StaticCache.__init__ wants a config to build its layers; the layers are already built.
    cache = StaticCache.__new__(StaticCache)
    Cache.__init__(cache, layers=layers)
    return cache


def _flatten_encoder_decoder_cache(cache: Any) -> tuple[list[Any], None]:
    return [cache.self_attention_cache, cache.cross_attention_cache], None


def _unflatten_encoder_decoder_cache(children: list[Any], context: Any) -> Any:
    self_attention_cache, cross_attention_cache = children
    return EncoderDecoderCache(self_attention_cache, cross_attention_cache)


# --------------------------------------------------------------------------- model outputs


def _flatten_model_output(output: Any) -> tuple[list[Any], list[str]]:
    return list(output.values()), list(output.keys())


def _model_output_unflattener(cls: type) -> Any:
    def unflatten(children: list[Any], context: Any) -> Any:
        return cls(**dict(zip(context, children, strict=True)))

    return unflatten


def _model_output_name(cls: type) -> str | None:
    """Return the stable node type name of a ModelOutput class, or None if not from transformers."""
    module = cls.__module__
    if module.startswith(_MODELS_PREFIX):
        model = module[len(_MODELS_PREFIX) :].split(".", 1)[0]
        return f"{_MODELS_PREFIX}{model}.{cls.__name__}"
    if module == "transformers" or module.startswith("transformers."):
        return f"transformers.{cls.__name__}"
    return None


def _model_output_classes() -> list[type]:
    """Return every concrete (dataclass) ModelOutput subclass loaded now, parents first."""
    seen: set[type] = set()
    found: list[type] = []
    stack = list(reversed(ModelOutput.__subclasses__()))
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if dataclasses.is_dataclass(cls):
            found.append(cls)
        stack.extend(reversed(cls.__subclasses__()))
    return found


# --------------------------------------------------------------------------- registration


# Caches iobundle cannot record, and why: a recorder warns once and marks their calls incomplete
# (rather than recording an opaque cache that no export can use).
_REFUSED_CACHES: dict[type, str] = {
    MtpCache: "it shifts its queries by a per-layer offset that iobundle does not record yet. Record the main model.",
    DFlashCache: (
        "it counts accepted draft tokens in a Python int that changes at every call. Record the target model "
        "without speculative decoding."
    ),
}


def _refuse_cache(cache: Any) -> tuple[list[Any], Any]:
    raise UnsupportedInputError(
        f"The cache is a {type(cache).__name__}, which iobundle cannot record: {_REFUSED_CACHES[type(cache)]}"
    )


def _never_rebuilt(children: list[Any], context: Any) -> Any:
    raise ValueError("iobundle never writes this cache to a bundle, so it does not rebuild one.")


def _cache_node_type(name: str, cls: type, flatten: Any, unflatten: Any) -> NodeType:
    """A cache's node type, its layout (``empty_dim``, ``child_empty_dims``) from the torch-free table."""
    layout = BUILTIN_LAYOUTS[(name, NODE_TYPE_VERSION)]
    return NodeType(name, NODE_TYPE_VERSION, cls, flatten, unflatten, layout.empty_dim, layout.child_empty_dims)


_CACHE_NODE_TYPES: tuple[NodeType, ...] = (
    _cache_node_type(DYNAMIC_CACHE_NAME, DynamicCache, _flatten_dynamic_cache, _unflatten_dynamic_cache),
    _cache_node_type(STATIC_CACHE_NAME, StaticCache, _flatten_static_cache, _unflatten_static_cache),
    _cache_node_type(
        ENCODER_DECODER_CACHE_NAME,
        EncoderDecoderCache,
        _flatten_encoder_decoder_cache,
        _unflatten_encoder_decoder_cache,
    ),
    _cache_node_type(QUANTIZED_CACHE_NAME, QuantizedCache, _flatten_quantized_cache, _unflatten_quantized_cache),
    *(
        NodeType(f"transformers.{cls.__name__}", NODE_TYPE_VERSION, cls, _refuse_cache, _never_rebuilt)
        for cls in _REFUSED_CACHES
    ),
)


def register_all() -> None:
    """Register the node types of the transformers caches and of every loaded ``ModelOutput`` class.

    ``ModelOutput`` classes are found by walking ``ModelOutput.__subclasses__()``, so only
    classes whose module has been imported are registered (``transformers.modeling_outputs``
    and ``transformers.generation.utils`` always are). Calling it again registers the classes
    loaded since, which is how a model-specific output met later becomes known. Classes
    defined outside transformers (remote code) are left out.

    Example:
        >>> register_all()
        >>> find_node_type(DynamicCache()).name
        'transformers.DynamicCache'
    """
    for node_type in _CACHE_NODE_TYPES:
        register_node_type(node_type)
    for cls in _model_output_classes():
        name = _model_output_name(cls)
        if name is None:
            logger.debug("Not registering %s.%s: not defined by transformers", cls.__module__, cls.__qualname__)
            continue
        register_node_type(
            NodeType(name, NODE_TYPE_VERSION, cls, _flatten_model_output, _model_output_unflattener(cls))
        )
    logger.debug("Registered transformers node types (transformers %s)", transformers.__version__)


# --------------------------------------------------------------------------- torch pytree


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
    return (
        _PytreeNode(
            DynamicCache,
            DYNAMIC_CACHE_NAME,
            _flatten_dynamic_cache,
            _unflatten_dynamic_cache,
            functools.partial(_cache_child_keys, "DynamicCache"),
        ),
        _PytreeNode(
            StaticCache,
            STATIC_CACHE_NAME,
            _flatten_static_cache,
            _unflatten_static_cache,
            functools.partial(_cache_child_keys, "StaticCache"),
        ),
        _PytreeNode(
            EncoderDecoderCache,
            ENCODER_DECODER_CACHE_NAME,
            _flatten_encoder_decoder_cache,
            _unflatten_encoder_decoder_cache,
            _attribute_keys("self_attention_cache", "cross_attention_cache"),
        ),
        _PytreeNode(
            QuantizedCache,
            QUANTIZED_CACHE_NAME,
            _flatten_quantized_cache,
            _unflatten_quantized_cache,
            _quantized_child_keys,
        ),
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

    Inside the block ``DynamicCache``, ``StaticCache`` and ``EncoderDecoderCache`` flatten
    the way the iobundle node types do (see the module docstring), with the context held as
    a JSON string, so ``torch.export.export`` accepts them as inputs. ``dynamic_shapes`` for
    a cache is then the list of its children's shapes (``[key_0, value_0, key_1, ...]``).
    On leaving, whatever torch pytree held for these classes before is put back exactly,
    or removed if there was nothing. Nested and concurrent blocks are fine: the last block
    to leave restores. ``ModelOutput`` classes are left alone: transformers registers each
    of them itself, at class creation, with the same layout (non-None values, keys as
    context).

    An uninitialised cache layer flattens to ``None`` children here too, and None is an
    empty subtree for torch pytree, so a prefill cache and a decode cache are different
    structures. Give ``torch.export`` caches whose layers all hold tensors, zero-length
    ``(B, H, 0, D)`` ones for an empty cache: unflatten the cache from such tensors.
    (``Cache.early_initialization`` does not do it: ``DynamicLayer`` gets 1-D placeholders.)

    This relies on torch's private registration tables (checked against torch 2.13) and
    only touches the Python pytree, not the optional C++ one.

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
