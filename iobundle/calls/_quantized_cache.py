"""transformers' ``QuantizedCache`` (quanto backend), flattened to plain tensors and rebuilt without quanto.

``transformers.QuantizedCache``
    Context: one kind per layer, ``{"quanto": {"nbits", "axis_key", "axis_value",
    "q_group_size", "residual_length"}}`` (a ``QuantoQuantizedLayer``'s settings). Eight
    children per layer: ``key_i, value_i`` (the residual: the latest keys and values in full
    precision, zero-length when empty), then ``key_codes_i, key_scale_i, key_shift_i`` and the
    same for values: the quantized states as plain tensors (:class:`QuantizedStates`), read from
    quanto's tensor through its attributes; all None for a layer not initialised yet (the
    prefill's cache). Every child grows along ``-2``. The token count is rebuilt as the quantized
    plus the residual length. The rebuilt layer quantizes with :func:`quantize_states` (quanto's
    operators, bit for bit), so replaying and exporting need no quantization library. Refused at
    capture: the HQQ and FP8 backends, quantization along axis -1 (its groups run across
    positions), groups that do not divide the head size, and a pending beam reordering.
"""

# transformers leaves its cache layer constructors unannotated.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from transformers.cache_utils import Cache, Fp8QuantizedLayer, QuantizedCache, QuantizedLayer, QuantoQuantizedLayer

from iobundle.calls._caches import layer_tensors, refuse_layer, require_pair
from iobundle.calls._layouts import QUANTIZED_LAYER_CHILDREN, quantized_settings
from iobundle.errors import UnsupportedInputError


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
        raise refuse_layer(layer, index, "QuantizedCache", why)
    settings = {
        "nbits": int(layer.nbits),
        "axis_key": int(layer.axis_key),
        "axis_value": int(layer.axis_value),
        "q_group_size": int(layer.q_group_size),
        "residual_length": int(layer.residual_length),
    }
    if settings["axis_key"] != 0 or settings["axis_value"] != 0:
        raise refuse_layer(
            layer,
            index,
            "QuantizedCache",
            "it quantizes along axis -1, whose groups run across cached positions, so a cache of another length "
            "regroups them; axis_key=0 and axis_value=0 (the default) can be recorded.",
        )
    if layer._pending_beam_idx is not None:
        raise refuse_layer(layer, index, "QuantizedCache", "it holds a beam reordering not applied yet (beam search).")
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


def flatten_quantized_cache(cache: Any) -> tuple[list[Any], list[Any]]:
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
    keys, values = layer_tensors(layer)
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
    if require_pair(key, value, index):
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


def unflatten_quantized_cache(children: list[Any], context: Any) -> Any:
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
