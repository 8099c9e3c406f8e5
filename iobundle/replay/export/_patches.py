"""Scoped, reversible patches that let ``torch.export`` trace transformers models captured from ``generate()``.

A patch is a last resort: it changes how the model is traced, not what it computes on the
recorded calls, and every call is checked against its recorded outputs afterwards. Each
patch is a context manager function that puts back exactly what it replaced on exit, even
when the export fails; :func:`export_patches` enters the ones that apply to a model and
lists them by name on the export report (``ExportReport.patches``). Nothing here runs
unless the model holds the modules or settings the patch is about (``complex_as_real``, found
by what the traced code computes, is entered for every trace and listed only when it changed
something), and transformers is only imported when the model comes from it.

The patches (checked against torch 2.13 and transformers 5.24):

``sdpa_without_is_causal``
    transformers' SDPA attention computes ``is_causal = q_length > 1 and mask is None and
    ...``. With a dynamic query length that is a ``SymBool``: tracing a decode call fails
    ("is_causal must be bool, not SymBool"), tracing the prefill guards ``q_length != 1`` and
    the program rejects every decode call. The replacement always passes an explicit boolean
    mask (the model's, or the causal one transformers means, built from the shapes) with
    ``is_causal=False``, and expands grouped key/value heads itself. A query that sees no key
    (padding in a left-padded batch) gets zeros, as in torch, so that onnxruntime, whose
    softmax would average the masked scores, agrees. Models that call
    ``torch.nn.functional.scaled_dot_product_attention`` themselves (Falcon) get the same two
    measures through a wrapper of that function: a symbolic ``is_causal`` becomes its mask,
    and rows that see no key are zeros.

    The output is copied to a contiguous layout rather than made ``.contiguous()``: with a
    query sliced from a fused projection (Phi-3's ``qkv_proj``), whether the transposed output
    is contiguous already depends on the query length, and that check becomes a guard
    ``q_length == 1`` (a program traced from a decode call then rejects the prefill).

``sliding_window_offsets``
    A sliding-window cache layer (``DynamicSlidingWindowLayer``: Mistral, Gemma-2/3's hybrid
    caches, and Llama 4's chunked attention, whose layers are the same class sized by
    ``attention_chunk_size``: there the chunk boundaries are absolute positions, so a wrong key
    offset masks the wrong keys even without padding) keeps only the last ``window - 1`` keys, and counts the tokens seen in a Python
    int, ``cumulative_length``, which a bundle cannot carry (see
    ``iobundle.calls._transformers``). The replay's calls get it back from their mask
    (``iobundle.calls.restore_token_counts``), but the cache torch.export rebuilds from the
    program's inputs while tracing counts its cached keys only. Its
    ``get_mask_sizes`` then gives a key offset of 0 instead of ``tokens_seen - window + 1``
    once the window is full, so the padding part of the mask is read from the wrong
    positions of ``attention_mask`` (a silently wrong program on a left-padded batch), and
    its ``if cumulative_length >= window`` branch makes the trace guard on the relation
    between the mask and the cache lengths (decode calls past the window rejected). While
    tracing, (1) a forward pre-hook on the exported module sets ``cumulative_length`` of each
    sliding layer to ``attention_mask.shape[-1] - query_length`` (``restore_token_counts``,
    which compares no symbolic size; a 2-D mask covers the
    tokens seen plus the new ones, which is what transformers' masks assume and what
    ``generate()`` passes); (2) ``get_mask_sizes`` is computed without a branch as
    ``(cached + query_length, cumulative_length - cached)``, equal to transformers' values
    whenever the layer holds ``min(tokens seen, window - 1)`` keys (a layer that does not
    record past states, checked); (3) transformers' ``_ignore_causal_mask_sdpa``, whose
    answer under ``torch.export`` is always False but which first compares the mask and key
    lengths (a guard), answers False at once while exporting. Without a 2-D mask nothing
    changes: the rebuilt offsets are shifted together and the mask is exact.

``layout_copies``
    ``reshape``, ``flatten``, ``contiguous``, the batched ``matmul`` and ``linear`` decide
    between a view and a copy from the strides, and for a transposed or sliced tensor
    (Falcon's ``transpose(1, 2).reshape(...)`` of its fused qkv, eager attention's
    ``query @ key.T`` and ``attn_output.transpose(1, 2).contiguous()``, ProphetNet's main
    stream cut from its n-gram streams by ``chunk`` and fed to a ``Linear``) that decision
    depends on whether the query length, or the batch, is 1: ``torch.export`` records it as
    a guard, ``q_length == 1`` when traced from a
    decode call (the prefill is rejected) or ``!= 1`` from the prefill (ProphetNet:
    ``batch != 1``, a program that refuses a batch of 1). While tracing, a
    ``TorchFunctionMode`` copies such an input to a contiguous layout first, unless it is
    contiguous for every size (``is_contiguous_or_false``, which never guards); a copy is
    always valid, so the program takes one path for every length. A branch on
    ``is_contiguous()`` (ProphetNet's ``if not logits.is_contiguous(): logits =
    logits.contiguous()``, whose answer for a slice depends on whether the batch is 1) gets
    the same answer: contiguous only when it is so for every size. Same values; the cost is
    a copy where the eager model might have had a view.

``moe_batched_experts``
    transformers' mixture-of-experts layers (Mixtral, Qwen3-MoE, ...) pick their experts
    implementation from ``config._experts_implementation``; the default, ``grouped_mm``, traces
    to a custom operator (``transformers::grouped_mm_fallback``) that ``torch.onnx`` cannot
    convert. While tracing, the configs of the model's experts layers say ``batched_mm``
    instead: the routed tokens gather their experts' weights and go through one batched
    matmul, with no data-dependent shapes, which exports to ONNX. Same computation, in
    another order of summation (differences at float rounding level).

``whisper_cross_attention_recompute``
    Whisper's decoder computes the cross-attention keys and values from the encoder output
    on its first call and stores them in the cache; later calls read them back. Python takes
    one branch or the other from ``cache.is_updated``, so one traced graph serves only the
    calls of its branch, and with an empty cross cache and size-oblivious shapes the trace
    silently takes the wrong one. During export the cross-attention always recomputes them
    from ``encoder_hidden_states`` (which every call passes) and returns them as the new
    cross cache, so one program serves the first call and the later ones. The cost is the
    two cross projections at every step of the exported model; the recorded cross cache
    input is then unused. The alternative (two programs, first step and later steps) needs
    two bundles' worth of checks and is not what a bundle describes.

``latent_keys_concat``
    Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, LongCat-Flash,
    Kimi-Linear, ...: key and value head sizes differ) builds its keys in ``expand_kv`` by
    allocating an empty tensor and ``copy_``-ing the position-free and the rotary parts into
    two slices of it. The memory-overlap check of ``copy_`` on a slice makes ``torch.export``,
    size-obliviously, add the minimum ``batch >= 2`` when it traces a batch of 2 or more: the
    program then rejects batch 1 (``Guard failed: position_ids.size()[0] >= 2``), which the
    check beyond the recorded calls finds. While tracing, ``expand_kv`` concatenates the two
    parts instead (``torch.cat``): the same values, no write into a slice, no minimum on the
    batch. Applied only when the batch is dynamic.
``complex_as_real``
    Complex arithmetic (a rotary embedding written as a complex multiply: ``torch.polar`` or
    ``torch.complex`` frequencies, ``view_as_complex`` queries and keys, ``view_as_real`` of the
    product, as in DeepSeek-V2 and Llama 4) traces to a ``copy_`` inside ``torch.polar`` that adds
    size bounds (the program rejects the prefill or batch 1), and to complex ops ``torch.onnx``
    cannot convert. While tracing, a ``TorchFunctionMode`` carries every complex value as a real
    ``(..., 2)`` pair and translates the ops on it (see
    :mod:`iobundle.replay.export._complex_pairs`): it is found by what the code computes, not by
    the model's class, so it is entered for every trace and listed on the report only when the
    model computed something complex. The same arithmetic on real numbers (differences at
    float rounding level). Entered last, so that it is the innermost mode: the model's ops reach
    it first, and ``layout_copies`` sees real pairs only.

``sizes_through_int``
    ``int()`` of a traced size is a guard that fixes the size: ProphetNet's positional
    embedding computes a decode step's position as ``int(padding_idx + past_length + 1)``,
    and the trace then holds the cache length as a constant ("You marked ... as dynamic but
    your code specialized it to be a constant"): non-strict tracing runs the model's Python as
    is, and ``int()`` asks the size for its value. While tracing, the modules that define the model's classes (not torch's, nor
    iobundle's) see a module-level ``int`` that returns a traced integer (a ``SymInt``)
    unchanged and hands every other value to the builtin (a ``SymFloat`` too: truncating one
    still fixes the size, as before); ``isinstance(x, int)`` and ``issubclass`` answer as for
    the builtin. It is entered only when a trace without it failed on such a specialisation
    (``ExportPatch.on_specialised``), and the export is traced again: no other export changes.

``contiguous_last_token``
    ``logits_to_keep=1`` slices the last position before ``lm_head``; the slice is not
    contiguous, and the matmul on it makes ``torch.export`` guard ``batch == 1``. A forward
    pre-hook on the output embeddings makes the input contiguous, so the batch stays dynamic.
    Applied only when the batch dimension is dynamic.

Remedies are not entered by :func:`export_patches`: the export tries them only when the check
beyond the recorded calls finds a guard (``iobundle.replay.export._dims.GUARD_REMEDIES``), and
keeps their program only when it serves that check and every recorded call:

``layout_copies_every_rank``
    ``layout_copies`` for the reshapes of 2-D tensors too, for any module: see
    :func:`layout_copies_every_rank`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from iobundle.calls import restore_token_counts
from iobundle.replay.export._complex_pairs import ComplexAsPairs

__all__ = [
    "PATCHES",
    "ExportPatch",
    "export_patches",
    "layout_copies_every_rank",
    "patch_complex_as_real",
    "patch_contiguous_last_token",
    "patch_latent_keys_concat",
    "patch_layout_copies",
    "patch_moe_batched_experts",
    "patch_sdpa_without_is_causal",
    "patch_sizes_through_int",
    "patch_sliding_window_offsets",
    "patch_whisper_cross_attention_recompute",
    "specialisation_patches",
]

logger = logging.getLogger(__name__)


def _transformers_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``model`` defined by transformers (empty when transformers is not loaded)."""
    if "transformers" not in sys.modules:
        return []
    return [m for m in model.modules() if type(m).__module__.startswith("transformers.")]


# --------------------------------------------------------------------------- sdpa_without_is_causal


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, KV, L, D) -> (B, KV * groups, L, D)``, each key/value head repeated ``groups`` times."""
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return (
        states[:, :, None, :, :].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)
    )


def _export_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with an explicit mask and ``is_causal=False`` (traceable with dynamic shapes)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("sdpa attention does not support softcap; export this model with attn_implementation='eager'.")
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    key = _repeat_kv(key, groups)
    value = _repeat_kv(value, groups)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal:
        # What transformers does without a mask, without branching on the query length: one
        # query sees every key (is_causal=False); several see keys 0..i (is_causal=True, upper-left).
        q_length, kv_length = query.shape[2], key.shape[2]
        rows = torch.arange(q_length, device=query.device)[:, None]
        single = torch.full((), q_length, dtype=torch.long, device=query.device) == 1
        attention_mask = (torch.arange(kv_length, device=query.device)[None, :] <= rows) | single
    # A query that sees no key at all (a padding position of a left-padded batch) gets zeros from
    # torch's SDPA; a softmax over only masked scores (onnxruntime) gives a uniform average
    # instead. Zeroing such rows makes every runtime agree with torch.
    visible = (
        attention_mask.any(dim=-1, keepdim=True)
        if attention_mask is not None and attention_mask.dtype == torch.bool
        else None
    )
    if position_bias is not None:
        low = torch.finfo(query.dtype).min
        if attention_mask is None:
            attention_mask = position_bias
        elif attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, position_bias, low)
        else:
            attention_mask = position_bias + attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    if visible is not None:
        out = torch.where(visible, out, torch.zeros((), dtype=out.dtype, device=out.device))
    # Not ``.contiguous()``: whether the transposed output already is depends on the strides SDPA
    # gave it, which follow the query's; a query sliced from a fused projection (Phi-3's
    # ``qkv_proj``) makes that check a guard ``q_length == 1``. A copy in contiguous layout has no check.
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format), None


def _uses_sdpa(model: torch.nn.Module) -> bool:
    for module in _transformers_modules(model):
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            return True
    return False


@contextlib.contextmanager
def patch_sdpa_without_is_causal(model: torch.nn.Module) -> Iterator[None]:
    """Replace transformers' ``"sdpa"`` attention function by one that never passes ``is_causal``.

    Why: ``is_causal`` is computed from the query length, a ``SymBool`` under dynamic shapes
    (see the module docstring). The replacement computes the same attention with an explicit
    mask. It is installed in ``AttentionInterface``'s global mapping, which is where every
    model looks ``"sdpa"`` up unless it overrides it locally, and the previous function is
    put back on exit.
    """
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    previous = mapping.get("sdpa")
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention
    mapping["sdpa"] = _export_sdpa_attention
    torch.nn.functional.scaled_dot_product_attention = _torch_sdpa_for_export(torch_sdpa)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = torch_sdpa
        if previous is None:
            mapping.pop("sdpa", None)
        else:
            mapping["sdpa"] = previous


def _torch_sdpa_for_export(torch_sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.nn.functional.scaled_dot_product_attention`` as models that call it directly (Falcon) need it traced.

    A symbolic ``is_causal`` (``query_length > 1``) becomes the explicit mask it stands for,
    and a query that sees no key gets zeros (as torch gives), so that onnxruntime agrees.
    """

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: Any = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(is_causal, bool) and attn_mask is None:
            q_length, kv_length = query.shape[-2], key.shape[-2]
            rows = torch.arange(q_length, device=query.device)[:, None]
            single = torch.full((), q_length, dtype=torch.long, device=query.device) == 1
            attn_mask, is_causal = (torch.arange(kv_length, device=query.device)[None, :] <= rows) | single, False
        out = torch_sdpa(query, key, value, attn_mask, dropout_p, bool(is_causal), *args, **kwargs)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            out = torch.where(attn_mask.any(dim=-1, keepdim=True), out, torch.zeros((), dtype=out.dtype))
        return out

    return sdpa


# --------------------------------------------------------------------------- sliding_window_offsets


def _uses_sliding_cache(model: torch.nn.Module) -> bool:
    for module in _transformers_modules(model):
        config = getattr(module, "config", None)
        if config is None:
            continue
        if callable(getattr(config, "get_text_config", None)):
            config = config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "sliding_window", None) and (
            not layer_types or any(t in ("sliding_attention", "chunked_attention") for t in layer_types)
        ):
            return True
        # Chunked attention (Llama 4) keeps its cache in the same layers, sized by the chunk.
        if getattr(config, "attention_chunk_size", None) and (not layer_types or "chunked_attention" in layer_types):
            return True
    return False


def _sliding_mask_sizes(self: Any, query_length: int) -> tuple[int, int]:
    """``DynamicSlidingWindowLayer.get_mask_sizes`` without a Python branch on the token count."""
    if self.record_past:
        raise ValueError(
            "A sliding-window cache layer that records past states cannot be exported from a bundle: "
            "it may hold more than window - 1 keys."
        )
    cached = self.keys.shape[-2] if self.is_initialized and self.keys is not None and self.keys.dim() == 4 else 0
    return cached + query_length, self.cumulative_length - cached


@contextlib.contextmanager
def patch_sliding_window_offsets(model: torch.nn.Module) -> Iterator[None]:
    """Give rebuilt sliding-window cache layers their true token count while tracing (see the module docstring).

    Installs a forward pre-hook on ``model`` (the module being exported), replaces
    ``DynamicSlidingWindowLayer.get_mask_sizes`` and ``masking_utils._ignore_causal_mask_sdpa``;
    all three are put back on exit.
    """
    import transformers.masking_utils as masking_utils
    from transformers.cache_utils import DynamicSlidingWindowLayer

    def set_token_counts(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The cache torch.export rebuilds from the program's inputs counts its cached keys only.
        restore_token_counts({**{f"\x00{i}": a for i, a in enumerate(args)}, **kwargs})

    ignore_causal_mask = masking_utils._ignore_causal_mask_sdpa

    def never_while_exporting(*args: Any, **kwargs: Any) -> bool:
        if torch.compiler.is_exporting():
            return False  # what the original answers under torch.export, after a guarding comparison
        return bool(ignore_causal_mask(*args, **kwargs))

    get_mask_sizes = DynamicSlidingWindowLayer.__dict__["get_mask_sizes"]
    handle = model.register_forward_pre_hook(set_token_counts, with_kwargs=True)
    DynamicSlidingWindowLayer.get_mask_sizes = _sliding_mask_sizes  # type: ignore[method-assign]  # undone below
    masking_utils._ignore_causal_mask_sdpa = never_while_exporting
    try:
        yield
    finally:
        handle.remove()
        DynamicSlidingWindowLayer.get_mask_sizes = get_mask_sizes  # type: ignore[method-assign]
        masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask


# --------------------------------------------------------------------------- layout_copies


class _LayoutCopies(torch.overrides.TorchFunctionMode):
    """Copies a possibly non-contiguous input of a view-or-copy operation to a contiguous layout first.

    Reshapes (``reshape``, ``flatten``, ``contiguous``) of tensors of rank ``reshape_rank`` or more
    are copied, and ``is_contiguous()`` of them answers without a guard; the input of a
    ``linear`` and matmuls only of tensors of rank 3 or more (a 2-D matmul input is often a
    transposed weight, which a copy would duplicate in every call).
    """

    def __init__(self, reshape_rank: int = 3) -> None:
        super().__init__()
        from torch._prims_common import is_contiguous_or_false

        self._definitely_contiguous = is_contiguous_or_false
        self._reshape_rank = reshape_rank
        self._reshapes = {torch.reshape, torch.Tensor.reshape, torch.flatten, torch.Tensor.flatten}
        self._matmuls = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
        self._linear = torch.nn.functional.linear

    def _copied(self, value: Any, rank: int = 3) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= rank and not self._definitely_contiguous(value):
            return value.clone(memory_format=torch.contiguous_format)
        return value

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous and not kwargs and len(args) == 1:
            copied = args[0].dim() >= self._reshape_rank
            return self._copied(args[0], self._reshape_rank) if copied else func(*args)
        if func is torch.Tensor.is_contiguous and not kwargs and len(args) == 1:
            if args[0].dim() >= self._reshape_rank:  # "not for every size" takes the copying branch
                return self._definitely_contiguous(args[0])
            return func(*args)
        if func in self._reshapes and args:
            args = (self._copied(args[0], self._reshape_rank), *args[1:])
        elif func is self._linear and args:
            args = (self._copied(args[0]), *args[1:])
        elif func in self._matmuls:
            args = tuple(self._copied(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def patch_layout_copies(model: torch.nn.Module) -> Iterator[None]:
    """Trace view-or-copy operations on possibly non-contiguous tensors as copies (see the module docstring).

    A ``TorchFunctionMode`` for the ``with`` block; ``model`` is not touched.
    """
    with _LayoutCopies():
        yield


@contextlib.contextmanager
def layout_copies_every_rank() -> Iterator[None]:
    """Trace the reshapes of every possibly non-contiguous tensor of rank 2 or more as copies.

    Not a patch of :data:`PATCHES`: a remedy the export tries when the check beyond the recorded
    calls finds a guard (see ``iobundle.replay.export._dims.GUARD_REMEDIES``). A 2-D tensor of
    tokens transposed and reshaped (Llama 4's mixture-of-experts routing,
    ``router_scores.transpose(0, 1).reshape(-1, 1)``) is a view when there is one token and a
    copy otherwise; traced from a decode call of a batch of 2 (two tokens), the decision
    becomes the guard ``batch * length != 1`` and the program refuses batch 1. A copy is valid
    for every size. Works for any module, transformers or not.
    """
    with _LayoutCopies(reshape_rank=2):
        yield


# --------------------------------------------------------------------------- moe_batched_experts

_TRACEABLE_EXPERTS = "batched_mm"


def _experts_configs(model: torch.nn.Module) -> list[Any]:
    """The configs of the transformers experts layers (``use_experts_implementation``) that use another implementation."""
    configs: dict[int, Any] = {}
    for module in _transformers_modules(model):
        config = getattr(module, "config", None)
        if not (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")) or config is None:
            continue
        if getattr(config, "_experts_implementation_internal", _TRACEABLE_EXPERTS) != _TRACEABLE_EXPERTS:
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def patch_moe_batched_experts(model: torch.nn.Module) -> Iterator[None]:
    """Make the model's experts layers use transformers' ``batched_mm`` implementation while tracing.

    Why: see the module docstring. The configs' previous implementations are put back on exit.
    """
    configs = _experts_configs(model)
    previous = [config._experts_implementation_internal for config in configs]
    for config in configs:
        config._experts_implementation_internal = _TRACEABLE_EXPERTS
    try:
        yield
    finally:
        for config, value in zip(configs, previous):
            config._experts_implementation_internal = value


# --------------------------------------------------------------------------- whisper_cross_attention_recompute


def _whisper_cross_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    if "transformers.models.whisper.modeling_whisper" not in sys.modules:
        return []
    from transformers.models.whisper.modeling_whisper import WhisperAttention

    return [m for m in model.modules() if isinstance(m, WhisperAttention) and m.is_decoder]


@contextlib.contextmanager
def patch_whisper_cross_attention_recompute(model: torch.nn.Module) -> Iterator[None]:
    """Make Whisper's decoder cross-attention recompute its keys and values at every call while tracing.

    Why: the first decoder call and the later ones take different Python branches (see the
    module docstring). Before each cross-attention call the cross cache layer is emptied
    (a zero-length slice of its tensors) and marked not updated, so the layer takes the
    "compute and store" branch whatever the cache held; its keys and values are then
    exactly those computed from ``encoder_hidden_states``, as the recorded outputs hold.
    The hook is a forward pre-hook on each decoder ``WhisperAttention``, removed on exit.
    """
    from transformers.cache_utils import CacheLayerMixin, EncoderDecoderCache

    def empty_cross_cache(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        key_value_states = kwargs.get("key_value_states", args[1] if len(args) > 1 else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[2] if len(args) > 2 else None))
        index = getattr(module, "layer_idx", None)
        if key_value_states is None or index is None or not isinstance(cache, EncoderDecoderCache):
            return
        cross = cache.cross_attention_cache
        if index < len(cross.layers):
            layer = cross.layers[index]
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if (
                isinstance(layer, CacheLayerMixin)
                and layer.is_initialized
                and keys is not None
                and values is not None
                and keys.dim() == 4
            ):
                layer.keys = keys[:, :, :0, :]
                layer.values = values[:, :, :0, :]
        cache.is_updated[index] = False

    handles = [
        m.register_forward_pre_hook(empty_cross_cache, with_kwargs=True) for m in _whisper_cross_attentions(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- contiguous_last_token


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get) and type(module).__module__.startswith("transformers."):
            try:
                head = get()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(head, torch.nn.Module):
                return head
    return None


@contextlib.contextmanager
def patch_contiguous_last_token(model: torch.nn.Module) -> Iterator[None]:
    """Make the input of the output embeddings (``lm_head``) contiguous while tracing.

    Why: the non-contiguous last-token slice before ``lm_head`` makes ``torch.export`` add a
    ``batch == 1`` guard (see the module docstring). A contiguous copy is the same values.
    """
    head = _output_embeddings(model)

    def contiguous(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a for a in args)

    handle = head.register_forward_pre_hook(contiguous) if head is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


# --------------------------------------------------------------------------- latent_keys_concat


def _latent_attentions(model: torch.nn.Module) -> list[Any]:
    """The multi-head latent attention modules of ``model``: an ``expand_kv`` over a ``kv_b_proj``."""
    needed = ("kv_b_proj", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return [
        m
        for m in model.modules()
        if callable(getattr(type(m), "expand_kv", None)) and all(hasattr(m, a) for a in needed)
    ]


def _concat_expand_kv(module: Any) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    nope, value = int(module.qk_nope_head_dim), int(module.v_head_dim)
    projection = module.kv_b_proj

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (batch, 1, length, rank) latents -> (batch, heads, length, nope + value) -> keys and values
        batch, _, length, _ = kv_nope.shape
        states = projection(kv_nope).view(batch, length, -1, nope + value).transpose(1, 2)
        keys, values = torch.split(states, [nope, value], dim=-1)
        rotary = k_rot.expand(-1, keys.shape[1], -1, -1)  # the rotary part is shared by every head
        return torch.cat([keys, rotary], dim=-1), values

    return expand_kv


@contextlib.contextmanager
def patch_latent_keys_concat(model: torch.nn.Module) -> Iterator[None]:
    """Make multi-head latent attention build its keys by concatenation while tracing (see the module docstring).

    Why: writing the two key parts into slices of an empty tensor makes ``torch.export`` add the
    minimum ``batch >= 2``; ``torch.cat`` of the same parts is the same values without it.
    """
    modules = _latent_attentions(model)
    for module in modules:
        module.expand_kv = _concat_expand_kv(module)
    try:
        yield
    finally:
        for module in modules:
            del module.expand_kv


# --------------------------------------------------------------------------- sizes_through_int


class _IntMeta(type):
    """The metaclass of :class:`_SizeInt`: ``isinstance`` and ``issubclass`` answer as for the builtin ``int``."""

    def __instancecheck__(cls, value: Any) -> bool:
        return isinstance(value, int)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, int)


class _SizeInt(int, metaclass=_IntMeta):
    """``int`` as the patched modules see it while tracing: a traced integer stays symbolic."""

    def __new__(cls, value: Any = 0, *args: Any) -> Any:
        if not args and isinstance(value, torch.SymInt):
            return value
        return int(value, *args)


def _model_code_modules(model: torch.nn.Module) -> list[Any]:
    """The Python modules that define the classes of ``model``'s submodules, torch's and iobundle's left out."""
    names = dict.fromkeys(type(m).__module__ for m in model.modules())
    return [
        sys.modules[n]
        for n in names
        if n in sys.modules and n.split(".")[0] not in ("torch", "iobundle") and "int" not in vars(sys.modules[n])
    ]


@contextlib.contextmanager
def patch_sizes_through_int(model: torch.nn.Module) -> Iterator[None]:
    """``int()`` of a traced size kept symbolic in the model's own code while tracing (see the module docstring)."""
    modules = _model_code_modules(model)
    for module in modules:
        module.int = _SizeInt
    try:
        yield
    finally:
        for module in modules:
            del module.int


# --------------------------------------------------------------------------- complex_as_real


@contextlib.contextmanager
def patch_complex_as_real(model: torch.nn.Module) -> Iterator[ComplexAsPairs]:
    """Trace complex arithmetic on real pairs (see the module docstring); yields the mode (``.used``: what it translated).

    A ``TorchFunctionMode`` for the ``with`` block; ``model`` is not touched.
    """
    with ComplexAsPairs() as mode:
        yield mode


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class ExportPatch:
    """One patch: its name (as the report lists it), when it applies, and the context manager.

    ``applies(model, dynamic, dynamic_batch)`` says whether the export needs it: ``dynamic``
    is whether any dimension is dynamic, ``dynamic_batch`` whether some input's batch axis is.
    A patch found by what the model computes while it is traced (``listed_if_used``) is entered
    for every trace; its context manager yields an object whose ``used`` says whether it changed
    anything, and only then is it listed.
    """

    name: str
    applies: Callable[[torch.nn.Module, bool, bool], bool]
    patch: Callable[[torch.nn.Module], contextlib.AbstractContextManager[Any]]
    listed_if_used: bool = False
    on_specialised: bool = False
    """Entered only when a trace without it specialised a dynamic dimension (``export_patches(specialised=True)``)."""


PATCHES: tuple[ExportPatch, ...] = (
    ExportPatch(
        "sdpa_without_is_causal",
        lambda m, dynamic, _batch: dynamic and _uses_sdpa(m),
        patch_sdpa_without_is_causal,
    ),
    ExportPatch(
        "layout_copies",
        lambda m, dynamic, _batch: dynamic and bool(_transformers_modules(m)),
        patch_layout_copies,
    ),
    ExportPatch(
        "sliding_window_offsets",
        lambda m, dynamic, _batch: dynamic and _uses_sliding_cache(m),
        patch_sliding_window_offsets,
    ),
    ExportPatch(
        "moe_batched_experts",
        lambda m, _dynamic, _batch: bool(_experts_configs(m)),
        patch_moe_batched_experts,
    ),
    ExportPatch(
        "whisper_cross_attention_recompute",
        lambda m, _dynamic, _batch: bool(_whisper_cross_attentions(m)),
        patch_whisper_cross_attention_recompute,
    ),
    ExportPatch(
        "latent_keys_concat",
        lambda m, _dynamic, batch: batch and bool(_latent_attentions(m)),
        patch_latent_keys_concat,
    ),
    ExportPatch(
        "sizes_through_int",
        lambda m, dynamic, _batch: dynamic and bool(_model_code_modules(m)),
        patch_sizes_through_int,
        on_specialised=True,
    ),
    ExportPatch(
        "contiguous_last_token",
        lambda m, _dynamic, batch: batch and _output_embeddings(m) is not None,
        patch_contiguous_last_token,
    ),
    ExportPatch(
        "complex_as_real",
        lambda _m, _dynamic, _batch: True,
        patch_complex_as_real,
        listed_if_used=True,
    ),
)


def specialisation_patches(model: torch.nn.Module, *, dynamic: bool, dynamic_batch: bool) -> list[str]:
    """The names of the ``on_specialised`` patches that apply to ``model`` (what a second trace would add)."""
    return [p.name for p in PATCHES if p.on_specialised and p.applies(model, dynamic, dynamic_batch)]


@contextlib.contextmanager
def export_patches(
    model: torch.nn.Module,
    *,
    dynamic: bool = True,
    dynamic_batch: bool,
    applied: list[str],
    specialised: bool = False,
) -> Iterator[None]:
    """Enter every patch of :data:`PATCHES` that applies to ``model``; append their names to ``applied``.

    Args:
        model: The module about to be exported (a wrapper around the model is fine).
        dynamic: Whether any dimension is dynamic (``sdpa_without_is_causal`` is needed only then).
        dynamic_batch: Whether some input's batch axis is dynamic (``contiguous_last_token``,
            ``latent_keys_concat``).
        applied: Receives the names of the patches entered, in order; a patch listed only if
            used (``complex_as_real``) is appended when the block ends, if it changed something.
        specialised: A trace without the ``on_specialised`` patches specialised a dynamic
            dimension: enter those too (``sizes_through_int``).

    Example:
        >>> names = []
        >>> with export_patches(model, dynamic_batch=False, applied=names):
        ...     ep = torch.export.export(model, args, kwargs, dynamic_shapes=ds)
        >>> names
        ['sdpa_without_is_causal']
    """
    found: list[tuple[str, Any]] = []
    with contextlib.ExitStack() as stack:
        for entry in PATCHES:
            if (specialised or not entry.on_specialised) and entry.applies(model, dynamic, dynamic_batch):
                state = stack.enter_context(entry.patch(model))
                if entry.listed_if_used:
                    found.append((entry.name, state))
                    continue
                applied.append(entry.name)
                logger.info("export patch %s applied", entry.name)
        try:
            yield
        finally:
            for name, state in found:
                if state.used:
                    applied.append(name)
                    logger.info("export patch %s applied (%s)", name, ", ".join(state.used))
