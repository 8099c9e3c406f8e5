"""The export patches of transformers' attention: ``sdpa_without_is_causal`` and ``sliding_window_offsets``.

Scoped and reversible, entered by :func:`iobundle.replay.export._patches.export_patches` (see there
for what a patch may change). Checked against torch 2.13 and transformers 5.24:

``sdpa_without_is_causal``
    transformers' SDPA attention computes ``is_causal = q_length > 1 and mask is None and
    ...``. With a dynamic query length that is a ``SymBool``: tracing a decode call fails
    ("is_causal must be bool, not SymBool"), tracing the prefill guards ``q_length != 1`` and
    the program rejects every decode call. The replacement always passes an explicit boolean
    mask (the model's, or the causal one built from the shapes) with ``is_causal=False``, and
    expands grouped key/value heads itself. A query that sees no key (padding in a left-padded
    batch) gets zeros, as in torch, so that onnxruntime, whose softmax would average the masked
    scores, agrees. Models that call ``scaled_dot_product_attention`` themselves (Falcon) get
    the same two measures through a wrapper of that function.

``sliding_window_offsets``
    A sliding-window cache layer (``DynamicSlidingWindowLayer``: Mistral, Gemma-2/3, and Llama
    4's chunked attention, whose chunk boundaries are absolute positions) keeps the last
    ``window - 1`` keys and counts the tokens seen in a Python int, ``cumulative_length``,
    which a bundle cannot carry (see ``iobundle.calls._caches``). The cache torch.export
    rebuilds from the program's inputs counts its cached keys only, so once the window is full
    ``get_mask_sizes`` gives a key offset of 0 (the mask's padding read from the wrong
    positions: a silently wrong program on a left-padded batch), and its ``if
    cumulative_length >= window`` branch guards on the mask and cache lengths. While tracing,
    (1) a forward pre-hook on the exported module sets each sliding layer's
    ``cumulative_length`` from the 2-D mask (``restore_token_counts``: mask length minus new
    tokens, what ``generate()`` passes); (2) ``get_mask_sizes`` is computed without a branch
    as ``(cached + query_length, cumulative_length - cached)``, transformers' values whenever
    the layer holds ``min(tokens seen, window - 1)`` keys; (3) ``_ignore_causal_mask_sdpa``,
    always False under ``torch.export`` but only after a guarding comparison, answers False at
    once. Without a 2-D mask nothing changes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from iobundle.calls import restore_token_counts

__all__ = [
    "patch_sdpa_without_is_causal",
    "patch_sliding_window_offsets",
    "transformers_modules",
    "uses_sdpa",
    "uses_sliding_cache",
]


def transformers_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
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
        attention_mask = _causal_mask(query, key)
    visible = _visible(attention_mask)
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


def _causal_mask(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """What transformers does without a mask, without branching on the query length: one query
    sees every key (``is_causal=False``); several see keys 0..i (``is_causal=True``, upper-left)."""
    q_length, kv_length = query.shape[-2], key.shape[-2]
    rows = torch.arange(q_length, device=query.device)[:, None]
    single = torch.full((), q_length, dtype=torch.long, device=query.device) == 1
    return (torch.arange(kv_length, device=query.device)[None, :] <= rows) | single


def _visible(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Which queries see some key (None without a boolean mask): torch's SDPA gives zeros for one that
    sees none (a padding position), onnxruntime's softmax a uniform average; zeroing them makes all agree."""
    return mask.any(dim=-1, keepdim=True) if mask is not None and mask.dtype == torch.bool else None


def uses_sdpa(model: torch.nn.Module) -> bool:
    for module in transformers_modules(model):
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            return True
    return False


@contextlib.contextmanager
def patch_sdpa_without_is_causal(model: torch.nn.Module) -> Iterator[None]:
    """Replace transformers' ``"sdpa"`` attention function by one that never passes ``is_causal``.

    Installed in ``AttentionInterface``'s global mapping, where every model looks ``"sdpa"`` up
    unless it overrides it locally.
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
    """``scaled_dot_product_attention`` as models that call it directly (Falcon) need it traced: a symbolic
    ``is_causal`` becomes the mask it stands for, and a query that sees no key gets zeros."""

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
            attn_mask, is_causal = _causal_mask(query, key), False
        out = torch_sdpa(query, key, value, attn_mask, dropout_p, bool(is_causal), *args, **kwargs)
        visible = _visible(attn_mask)
        return out if visible is None else torch.where(visible, out, torch.zeros((), dtype=out.dtype))

    return sdpa


# --------------------------------------------------------------------------- sliding_window_offsets


def uses_sliding_cache(model: torch.nn.Module) -> bool:
    for module in transformers_modules(model):
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
    """Give rebuilt sliding-window cache layers their true token count while tracing (see the module docstring)."""
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
