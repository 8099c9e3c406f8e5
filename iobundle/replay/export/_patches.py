"""Scoped, reversible patches that let ``torch.export`` trace transformers models captured from ``generate()``.

A patch is a last resort: it changes how the model is traced, not what it computes on the
recorded calls, and every call is checked against its recorded outputs afterwards. Each patch
is a context manager that puts back exactly what it replaced on exit, even when the export
fails; :func:`export_patches` enters the ones that apply to a model (only when it holds the
modules or settings the patch is about; transformers is imported only for its models) and
lists them on the export report (``ExportReport.patches``). The patches (checked against
torch 2.13 and transformers 5.24):

``sdpa_without_is_causal``, ``sliding_window_offsets``
    transformers' attention: see :mod:`iobundle.replay.export._attention_patches`.

``layout_copies``
    ``reshape``, ``flatten``, ``contiguous``, the batched ``matmul`` and ``linear`` choose a
    view or a copy from the strides; for a transposed or sliced tensor (Falcon's fused qkv,
    eager attention's ``query @ key.T``, ProphetNet's stream cut by ``chunk``) that choice
    depends on whether the query length, or the batch, is 1, and ``torch.export`` records it
    as a guard (``q_length == 1`` from a decode call, ``!= 1`` from the prefill). While
    tracing, a ``TorchFunctionMode`` copies such an input to a contiguous layout first unless
    it is contiguous for every size (``is_contiguous_or_false``, which never guards), and
    ``is_contiguous()`` answers the same way: one path for every length, at the cost of a copy.

``moe_batched_experts``
    The default experts implementation of transformers' mixture-of-experts layers,
    ``grouped_mm``, traces to a custom operator ``torch.onnx`` cannot convert; while tracing,
    the experts configs say ``batched_mm`` (one batched matmul over the gathered weights, no
    data-dependent shapes): the same computation summed in another order.

``whisper_cross_attention_recompute``
    Whisper's decoder computes the cross-attention keys and values on its first call and reads
    them from the cache later, a Python branch on ``cache.is_updated``: one traced graph would
    serve only the calls of its branch (and an empty cross cache silently takes the wrong one).
    During export the cross-attention always recomputes them from ``encoder_hidden_states``
    (which every call passes), so one program serves every call, at the cost of the two cross
    projections per step; the recorded cross cache input is then unused.

``latent_keys_concat``
    Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Kimi-Linear, ...) builds its keys in
    ``expand_kv`` by ``copy_``-ing two parts into slices of an empty tensor; the overlap check
    of ``copy_`` makes ``torch.export`` add ``batch >= 2`` when traced from a batch of 2 or
    more. While tracing, ``expand_kv`` concatenates the parts instead. Only when the batch is dynamic.

``complex_as_real``
    Complex arithmetic (a rotary embedding as a complex multiply, as in DeepSeek-V2 and Llama 4)
    traces to a ``copy_`` in ``torch.polar`` that adds size bounds, and to complex ops
    ``torch.onnx`` cannot convert. While tracing, a ``TorchFunctionMode`` carries every complex
    value as a real ``(..., 2)`` pair (:mod:`iobundle.replay.export._complex_pairs`). Found by
    what the code computes, so entered for every trace and listed only when it translated
    something; entered last (the innermost mode), so ``layout_copies`` sees real pairs only.

``sizes_through_int``
    ``int()`` of a traced size is a guard that fixes it (ProphetNet's position
    ``int(padding_idx + past_length + 1)`` makes the cache length a constant). While tracing,
    the modules defining the model's classes (not torch's, nor iobundle's) see an ``int`` that
    returns a ``SymInt`` unchanged and hands every other value to the builtin. Entered only
    when a trace without it specialised a size (``ExportPatch.on_specialised``), and the export
    is traced again.

``contiguous_last_token``
    ``logits_to_keep=1`` slices the last position before ``lm_head``; the matmul on that
    non-contiguous slice makes ``torch.export`` guard ``batch == 1``. A forward pre-hook makes
    the input contiguous. Only when the batch is dynamic.

Remedies are not entered by :func:`export_patches`: the export tries them when the check beyond
the recorded calls finds a guard (``iobundle.replay.export._dims.GUARD_REMEDIES``) and keeps
their program only when it serves that check and every recorded call:
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

from iobundle.replay.export._attention_patches import (
    patch_sdpa_without_is_causal,
    patch_sliding_window_offsets,
    transformers_modules,
    uses_sdpa,
    uses_sliding_cache,
)
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
    "patch_sizes_through_int",
    "patch_whisper_cross_attention_recompute",
    "specialisation_patches",
]

logger = logging.getLogger(__name__)


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
    """Trace view-or-copy operations on possibly non-contiguous tensors as copies (see the module docstring)."""
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
    for module in transformers_modules(model):
        config = getattr(module, "config", None)
        if not (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")) or config is None:
            continue
        if getattr(config, "_experts_implementation_internal", _TRACEABLE_EXPERTS) != _TRACEABLE_EXPERTS:
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def patch_moe_batched_experts(model: torch.nn.Module) -> Iterator[None]:
    """Make the model's experts layers use transformers' ``batched_mm`` implementation while tracing."""
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

    A forward pre-hook on each decoder ``WhisperAttention`` empties its cross cache layer (a
    zero-length slice) and marks it not updated, so the layer takes the "compute and store" branch.
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
    """Make the input of the output embeddings (``lm_head``) contiguous while tracing (see the module docstring)."""
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
    """Make multi-head latent attention build its keys by concatenation while tracing (see the module docstring)."""
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
    """Trace complex arithmetic on real pairs (see the module docstring); yields the mode (``.used``: what it translated)."""
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
        lambda m, dynamic, _batch: dynamic and uses_sdpa(m),
        patch_sdpa_without_is_causal,
    ),
    ExportPatch(
        "layout_copies",
        lambda m, dynamic, _batch: dynamic and bool(transformers_modules(m)),
        patch_layout_copies,
    ),
    ExportPatch(
        "sliding_window_offsets",
        lambda m, dynamic, _batch: dynamic and uses_sliding_cache(m),
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
