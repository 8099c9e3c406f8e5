"""The model zoo: one entry per transformers family, a tiny model built from a config and how to generate with it.

Nothing is downloaded: every model is built here from a config (2 layers, hidden size 32,
random weights from a fixed seed). An entry of :data:`FAMILIES` says how to build the
model and call ``generate()``; the harness (``tests/zoo/harness.py``) observes the model's
``forward`` during that ``generate()``, saves a self-contained bundle
(``include_model=True``), and exports and validates it from the bundle alone, through the
CLI, in fresh processes.

Adding a family is one entry::

    Family("bert2bert", build_bert2bert, notes="...")

where the builder returns ``(model, generate_kwargs)``. A family whose capture is not "observe
``model.forward`` during ``model.generate(**kwargs)``" (an encoder and a decoder observed
separately, a vision tower) gives ``observe``: a function of the model returning the
modules to observe, by bundle name.

A family that does not pass yet stays in the zoo with ``known_failure`` set to the reason;
the zoo test then asserts that it still fails (so that a fix is noticed) and the support
matrix says why. A known failure is never reported as a pass.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CLASSES", "FAMILIES", "Family", "family", "missing_requirement"]

VOCAB = 100
PAD = 0


@dataclass(frozen=True)
class Family:
    """One zoo entry.

    Attributes:
        name: The family's name in the support matrix and in test ids (``llama``, ``gemma2``).
        build: Returns ``(model, generate_kwargs)``: the model in eval mode, seeded, and the
            keyword arguments of ``model.generate``.
        atol: The tolerance of both checks (``ep.module()`` and onnxruntime) on every call.
        notes: What the entry exercises (sliding window, left padding, MoE, ...), for the matrix.
        observe: Given the model, the modules to observe by bundle name; default: the model itself.
        store_n_calls: How many calls each observer records (at least every call of the generate()).
        known_failure: Why the family does not pass yet; None when it must pass.
        dtype: The dtype the model runs (and is recorded) in: ``float32``, ``bfloat16``, ``float16``.
        autocast: The dtype of ``torch.autocast("cpu", ...)`` the ``generate()`` runs under (weights stay
            in ``dtype``), as a GPU box records under ``torch.autocast("cuda", ...)``; None without autocast.
        requires: A module the capture needs beyond the test dependencies (``optimum.quanto``);
            where it cannot be imported the family's test is skipped.
        remedies: The remedies (``iobundle.replay.export._dims.GUARD_REMEDIES``) whose re-export serves
            the check beyond the recorded calls, as the export must report them; empty: none is needed.
        source: Where the model's code comes from: ``transformers``, ``diffusers`` or ``plain torch``.
        classes: The model behaviours of issue 28 the entry exercises (:data:`CLASSES`), for the matrix.
        run: Makes the observed calls, given the model and what ``build`` returned beside it; default:
            ``model.generate(**kwargs)``.
        factory: ``MODULE:FACTORY`` of :mod:`zoo_models` that the replay builds the model with
            (``iobundle export --model``: the user's code, copied into the replay's working directory),
            for a model the bundle does not store (plain torch, a vision tower); None: ``--from-bundle``.
        export_args: The flags of ``iobundle export`` beyond the bundle, the model and the output.
    """

    name: str
    build: Callable[[], tuple[torch.nn.Module, dict[str, Any]]]
    atol: float = 1e-4
    notes: str = ""
    observe: Callable[[torch.nn.Module], dict[str, torch.nn.Module]] | None = None
    store_n_calls: int = 32
    known_failure: str | None = None
    dtype: str = "float32"
    autocast: str | None = None
    requires: str | None = None
    remedies: tuple[str, ...] = ()
    source: str = "transformers"
    classes: tuple[int, ...] = ()
    run: Callable[[torch.nn.Module, dict[str, Any]], Any] | None = None
    factory: str | None = None
    export_args: tuple[str, ...] = ("--batch-all",)

    @property
    def precision(self) -> str:
        """The matrix's dtype column: ``float32``, or ``float32, autocast bfloat16``."""
        return f"{self.dtype}, autocast {self.autocast}" if self.autocast else self.dtype

    @property
    def class_names(self) -> str:
        """The matrix's classes column: ``2 (sizes read from values)``, or ``-``."""
        return ", ".join(f"{c} ({CLASSES[c]})" for c in self.classes) or "-"


# The model behaviours of issue 28, by number (the zoo's cases of each are in behaviours.py).
CLASSES: dict[int, str] = {
    1: "state kept on modules",
    2: "sizes read from values",
    3: "sizes multiple of a stride",
    4: "ops on constants only",
    5: "wrapped model",
}

# A quanto-quantized cache: 4-bit keys and values in groups of 8 channels (the head size of the
# tiny models), the new tokens kept in full precision beside them until the residual reaches 3:
# the third decode step moves it into the quantized states, another branch of the cache's code
# whose guard splits the recorded decode steps, so they export as two programs selected by the
# residual's length (see docs/llm.md, "A guard between the recorded calls"; residual_length=2
# does not export yet).
QUANTO_CACHE: dict[str, Any] = {
    "cache_implementation": "quantized",
    "cache_config": {"backend": "quanto", "nbits": 4, "q_group_size": 8, "residual_length": 3},
}
QUANTO_NOTES = 'cache_implementation="quantized" (quanto, 4 bits, groups of 8, residual 3: a flush recorded)'


def missing_requirement(entry: Family) -> str | None:
    """Why ``entry`` cannot be captured here (its ``requires`` does not import), or None."""
    if entry.requires is None:
        return None
    try:
        importlib.import_module(entry.requires)
    except ImportError as exc:
        extra = "quanto" if entry.requires.startswith("optimum.quanto") else "test"
        return f"{entry.name} records with {entry.requires}, which does not import ({exc}): pip install 'iobundle[{extra}]'"
    return None


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        return build().eval()
    finally:
        torch.random.set_rng_state(state)


def left_padded_prompt(length: int = 7, *, batch: int = 2, pad: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a batch whose first row is left-padded by ``pad`` tokens."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1 and pad:
        ids[0, :pad], mask[0, :pad] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def greedy(new_tokens: int, **prompt: Any) -> dict[str, Any]:
    """``generate()`` arguments: greedy, exactly ``new_tokens`` tokens."""
    return {**prompt, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}


def decoder_only(
    config_name: str,
    model_name: str,
    *,
    prompt: int = 7,
    new_tokens: int = 5,
    pad: int = 2,
    generate: dict[str, Any] | None = None,
    **config: Any,
) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    """A builder for a tiny decoder-only model ``transformers.<model_name>(transformers.<config_name>(...))``.

    Common settings (2 layers, hidden 32, 4 heads / 2 key-value heads, vocabulary 100, pad
    token 0) are overridden by ``config``; the prompt is a batch of 2, the first row
    left-padded by ``pad`` tokens.
    """

    def build() -> tuple[torch.nn.Module, dict[str, Any]]:
        import transformers

        settings: dict[str, Any] = {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "vocab_size": VOCAB,
            "max_position_embeddings": 128,
            "pad_token_id": PAD,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        settings.update(config)
        settings = {k: v for k, v in settings.items() if v is not None}
        cfg = getattr(transformers, config_name)(**settings)
        model = _seeded(lambda: getattr(transformers, model_name)(cfg))
        return model, greedy(new_tokens, **left_padded_prompt(prompt, pad=pad), **(generate or {}))

    return build


# Settings of decoder_only() that a model without attention does not take.
_NO_ATTENTION: dict[str, Any] = {
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "intermediate_size": None,
    "max_position_embeddings": None,
}


def _gpt2() -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers

    cfg = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        vocab_size=VOCAB,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = _seeded(lambda: transformers.GPT2LMHeadModel(cfg))
    return model, greedy(5, **left_padded_prompt())


FAMILIES: list[Family] = [
    Family(
        "llama",
        decoder_only("LlamaConfig", "LlamaForCausalLM"),
        notes="GQA, left-padded batch of 2",
    ),
    Family(
        "llama_eager",
        decoder_only("LlamaConfig", "LlamaForCausalLM", attn_implementation="eager"),
        notes='attn_implementation="eager": matmul/softmax attention, no SDPA',
    ),
    Family(
        "llama_static_cache",
        decoder_only("LlamaConfig", "LlamaForCausalLM", generate={"cache_implementation": "static"}),
        notes='cache_implementation="static": preallocated cache, token counters as tensors',
    ),
    Family(
        "llama_quantized_cache",
        decoder_only("LlamaConfig", "LlamaForCausalLM", prompt=5, new_tokens=6, generate=QUANTO_CACHE),
        notes=QUANTO_NOTES,
        requires="optimum.quanto",
    ),
    Family(
        "mistral",
        decoder_only("MistralConfig", "MistralForCausalLM", sliding_window=6, prompt=5, new_tokens=9),
        notes="sliding window 6, 14 tokens: past the window",
    ),
    Family(
        "qwen2",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM"),
        notes="attention biases",
    ),
    Family(
        "qwen3",
        decoder_only("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
        notes="q/k norms",
    ),
    Family(
        "phi3",
        decoder_only("Phi3Config", "Phi3ForCausalLM", pad=2),
        notes="fused qkv / gate_up projections",
    ),
    Family(
        "gemma2",
        decoder_only("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8, prompt=7, new_tokens=6),
        notes="sliding window 8 every other layer, soft-capping, 13 tokens: past the window",
    ),
    Family(
        "gemma3_text",
        decoder_only("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=8, prompt=7, new_tokens=6),
        notes="hybrid cache (sliding 8 / full), 13 tokens: past the window",
    ),
    Family("gpt2", _gpt2, notes="learned positions, fused qkv (Conv1D)"),
    Family(
        "gpt_neox",
        decoder_only("GPTNeoXConfig", "GPTNeoXForCausalLM", num_key_value_heads=None, rotary_pct=0.5),
        notes="partial rotary, parallel residual",
    ),
    Family(
        "falcon",
        decoder_only(
            "FalconConfig",
            "FalconForCausalLM",
            num_key_value_heads=None,
            intermediate_size=None,
            max_position_embeddings=None,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
        notes="new decoder architecture (GQA, parallel attention)",
    ),
    Family(
        "olmo2",
        decoder_only("Olmo2Config", "Olmo2ForCausalLM"),
        notes="post-norms, q/k norms",
    ),
    Family(
        "granite",
        decoder_only("GraniteConfig", "GraniteForCausalLM", embedding_multiplier=2.0, logits_scaling=4.0),
        notes="embedding / residual / logits multipliers",
    ),
    Family(
        "mixtral",
        decoder_only(
            "MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        ),
        notes="mixture of experts: 4 experts, top-2 routing (data-dependent)",
    ),
    Family(
        "qwen3_moe",
        decoder_only(
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
        ),
        notes="mixture of experts: 4 experts, top-2, q/k norms",
    ),
    Family(
        "phi",
        decoder_only("PhiConfig", "PhiForCausalLM", num_key_value_heads=None, partial_rotary_factor=0.5),
        notes="partial rotary, parallel attention / MLP, LayerNorm",
    ),
    Family(
        "smollm3",
        decoder_only("SmolLM3Config", "SmolLM3ForCausalLM", no_rope_layer_interval=2),
        notes="no rotary embedding every other layer (NoPE)",
    ),
    # Cache kinds beyond keys and values (issue 19): state-space, hybrid, chunked, sinks, static.
    Family(
        "mamba",
        decoder_only("MambaConfig", "MambaForCausalLM", **_NO_ATTENTION, state_size=8, expand=2, conv_kernel=4),
        notes="state-space: LinearAttentionLayer (convolution + recurrent state), no attention",
    ),
    Family(
        "mamba2",
        decoder_only(
            "Mamba2Config",
            "Mamba2ForCausalLM",
            **_NO_ATTENTION,
            state_size=8,
            expand=2,
            conv_kernel=4,
            num_heads=8,
            head_dim=8,
            n_groups=1,
            chunk_size=16,
        ),
        notes="state-space: multi-head SSM (SSD) LinearAttentionLayer, no attention",
    ),
    Family(
        "falcon_mamba",
        decoder_only(
            "FalconMambaConfig", "FalconMambaForCausalLM", **_NO_ATTENTION, state_size=8, expand=2, conv_kernel=4
        ),
        notes="state-space: LinearAttentionLayer, RMS-normed B/C/dt",
    ),
    Family(
        "lfm2",
        decoder_only("Lfm2Config", "Lfm2ForCausalLM", layer_types=["conv", "full_attention"], conv_L_cache=3),
        notes="hybrid: short convolution layer (LinearAttentionLayer, conv state only) + attention layer",
    ),
    Family(
        "granitemoehybrid",
        decoder_only(
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            layer_types=["mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            num_local_experts=0,
            shared_intermediate_size=64,
        ),
        notes="hybrid: Mamba2 layer (LinearAttentionLayer) + attention layer",
    ),
    Family(
        "jamba",
        decoder_only(
            "JambaConfig",
            "JambaForCausalLM",
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_expand=2,
            mamba_dt_rank=4,
            mamba_d_conv=4,
        ),
        notes="hybrid: Mamba layer (LinearAttentionLayer) + attention layer, MoE",
    ),
    Family(
        "qwen3_next",
        decoder_only(
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        notes="hybrid: gated delta-rule linear attention (LinearAttentionLayer) + gated attention, MoE",
    ),
    Family(
        "llama4_text",
        decoder_only(
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            attention_chunk_size=4,
            layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 0],
            prompt=7,
            new_tokens=6,
        ),
        notes=(
            "chunked attention (chunk 4, 13 tokens: past the chunk) + NoPE full attention, MoE; batch 1 served by "
            "the remedy layout_copies_every_rank (its routing guarded batch * length != 1)"
        ),
        remedies=("layout_copies_every_rank",),
    ),
    Family(
        "gpt_oss",
        decoder_only(
            "GptOssConfig",
            "GptOssForCausalLM",
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            prompt=5,
            new_tokens=6,
        ),
        notes="attention sinks (learned per-head logits), sliding window 6 / full, MoE",
    ),
    Family(
        "granite_swa",
        decoder_only(
            "GraniteSWAConfig",
            "GraniteSWAForCausalLM",
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            prompt=5,
            new_tokens=6,
        ),
        notes="attention sinks, sliding window 6 / full",
    ),
    Family(
        "qwen2_quantized_cache",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM", prompt=6, new_tokens=5, generate=QUANTO_CACHE),
        notes=QUANTO_NOTES + ", attention biases",
        requires="optimum.quanto",
    ),
    Family(
        "qwen2_static_cache",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM", generate={"cache_implementation": "static"}),
        notes='cache_implementation="static" (StaticLayer), attention biases',
    ),
    Family(
        "lfm2_static_cache",
        decoder_only(
            "Lfm2Config",
            "Lfm2ForCausalLM",
            layer_types=["conv", "full_attention"],
            conv_L_cache=3,
            generate={"cache_implementation": "static"},
        ),
        notes='cache_implementation="static": convolution layer (LinearAttentionLayer) + StaticLayer',
    ),
]


# --------------------------------------------------------------------------- batch axes, dtypes (issue 19)


def vision_language_text(
    config_name: str, model_name: str, **vision: Any
) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    """A tiny Qwen2-VL-style model generating from text alone: ``position_ids`` is ``(4, batch, length)``.

    The text decoder takes 3-D rotary positions (text positions plus the temporal, height and
    width sections), so its batch is axis 1 of ``position_ids``: ``--batch-all`` must find it.
    """

    def build() -> tuple[torch.nn.Module, dict[str, Any]]:
        import transformers

        text = {
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 128, "pad_token_id": PAD,
            "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        }  # fmt: skip
        vision_config = {"depth": 1, "hidden_size": 32, "num_heads": 2, "patch_size": 2, "spatial_merge_size": 1,
                         "temporal_patch_size": 1, **vision}  # fmt: skip
        cfg = getattr(transformers, config_name)(
            text_config=text, vision_config=vision_config, image_token_id=97, video_token_id=98,
            vision_start_token_id=96,
        )  # fmt: skip
        model = _seeded(lambda: getattr(transformers, model_name)(cfg))
        return model, greedy(4, **left_padded_prompt(7))

    return build


# Multi-head latent attention: keys of 8 + 4 (rotary), values of 6, over rank-16 latents.
_LATENT: dict[str, Any] = {
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
}
# Grouped routing: 4 experts in 2 groups, the best group's top 2 experts, one shared expert.
_GROUPED_MOE: dict[str, Any] = {
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 16,
}

FAMILIES += [
    Family(
        "qwen2_vl_text",
        vision_language_text("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", embed_dim=32),
        notes="3-D rotary positions (4, batch, length): the batch is axis 1 of position_ids",
    ),
    Family(
        "qwen2_5_vl_text",
        vision_language_text(
            "Qwen2_5_VLConfig",
            "Qwen2_5_VLForConditionalGeneration",
            out_hidden_size=32,
            intermediate_size=64,
            fullatt_block_indexes=[0],
            window_size=4,
        ),
        notes="3-D rotary positions, windowed vision tower unused: the batch is axis 1 of position_ids",
    ),
    Family(
        "llama_bf16",
        decoder_only("LlamaConfig", "LlamaForCausalLM"),
        atol=2e-2,
        dtype="bfloat16",
        notes="bfloat16 weights and activations, default dtype-aware tolerances",
    ),
    Family(
        "llama_fp16",
        decoder_only("LlamaConfig", "LlamaForCausalLM"),
        atol=5e-3,
        dtype="float16",
        notes="float16 weights and activations, default dtype-aware tolerances",
    ),
    Family(
        "qwen2_bf16",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM"),
        atol=2e-2,
        dtype="bfloat16",
        notes="bfloat16, attention biases",
    ),
    Family(
        "qwen2_fp16",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM"),
        atol=5e-3,
        dtype="float16",
        notes="float16, attention biases",
    ),
    Family(
        "qwen2_autocast_bf16",
        decoder_only("Qwen2Config", "Qwen2ForCausalLM"),
        atol=2e-2,
        autocast="bfloat16",
        notes="float32 weights, generate() under torch.autocast bfloat16: replayed and traced under it",
    ),
    Family(
        "phi3_autocast_bf16",
        decoder_only("Phi3Config", "Phi3ForCausalLM", pad=2),
        atol=2e-2,
        autocast="bfloat16",
        notes="autocast bfloat16, fused qkv, left padding",
    ),
    Family(
        "gemma2_autocast_fp16",
        decoder_only("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8, prompt=7, new_tokens=6),
        atol=5e-3,
        autocast="float16",
        notes="autocast float16, sliding window and soft-capping",
    ),
    Family(
        "deepseek_v3",
        decoder_only("DeepseekV3Config", "DeepseekV3ForCausalLM", **_LATENT, **_GROUPED_MOE, first_k_dense_replace=1),
        notes="multi-head latent attention (key 12 / value 6 head sizes), grouped MoE routing (n_group 2, "
        "topk_group 1); batch 1 beyond the recorded calls",
    ),
    Family(
        "deepseek_v2",
        decoder_only(
            "DeepseekV2Config", "DeepseekV2ForCausalLM", **_LATENT, **_GROUPED_MOE, topk_method="group_limited_greedy"
        ),
        notes="multi-head latent attention, group-limited greedy MoE routing, complex-valued rotary (torch.polar)",
    ),
    Family(
        "glm4_moe_lite",
        decoder_only("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **_LATENT, **_GROUPED_MOE, first_k_dense_replace=1),
        notes="multi-head latent attention, grouped MoE routing with a shared expert",
    ),
    Family(
        "minicpm3",
        decoder_only("MiniCPM3Config", "MiniCPM3ForCausalLM", **_LATENT, scale_emb=1, dim_model_base=32),
        notes="multi-head latent attention, dense MLP, scaled embeddings and residuals",
    ),
]


# --------------------------------------------------------------------------- cross-attention to image states (issue 19)


def _open_gates(model: torch.nn.Module) -> torch.nn.Module:
    """Set every ``*gate`` parameter that is all zeros to 0.5; return ``model``.

    Gated cross-attention starts closed (``tanh(0) = 0``): with random weights the image
    would not reach the logits, and a wrong cross-attention would still validate.
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1].endswith("gate") and not parameter.any():
                parameter.fill_(0.5)
    return model


MLLAMA_IMAGE_TOKEN = VOCAB  # Mllama's text embedding has 8 rows past the vocabulary, the image token among them


def _mllama() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny Llama 3.2 Vision: a 2-layer text decoder whose layer 1 cross-attends to the vision states.

    The inputs are the ones the processor gives, built by hand: a batch of 2 prompts, the first
    left-padded by 2, each with the image token first; ``pixel_values`` of one image per prompt cut
    into 2 tiles of 14x14 (aspect ratio 1x2: ``aspect_ratio_ids`` 2), ``aspect_ratio_mask`` and
    the ``cross_attention_mask`` (the image token and the text after it see both tiles). At
    prefill the model runs the vision tower and stores the projected vision keys and values in the
    cross-attention layer of its ``DynamicCache``; the decode calls pass no image and read them there.
    """
    import transformers

    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
        "attention_heads": 2, "image_size": 14, "patch_size": 7, "max_num_tiles": 2,
        "intermediate_layers_indices": [0, 1], "vision_output_dim": 96,
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
    }  # fmt: skip
    text = {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "cross_attention_layers": [1],
        "max_position_embeddings": 128, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    cfg = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=MLLAMA_IMAGE_TOKEN)
    model = _seeded(lambda: _open_gates(transformers.MllamaForConditionalGeneration(cfg)))
    prompt = left_padded_prompt(7, pad=2)
    cross = torch.zeros(2, 7, 1, 2, dtype=torch.long)  # (batch, text, images, tiles)
    for row, image_at in enumerate((2, 0)):
        prompt["input_ids"][row, image_at] = MLLAMA_IMAGE_TOKEN
        cross[row, image_at:] = 1
    pixels = torch.randn(2, 1, 2, 3, 14, 14, generator=torch.Generator().manual_seed(4))
    return model, greedy(
        5, **prompt, pixel_values=pixels, aspect_ratio_ids=torch.full((2, 1), 2),
        aspect_ratio_mask=torch.ones(2, 1, 2, dtype=torch.long), cross_attention_mask=cross,
    )  # fmt: skip


def _idefics() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny Idefics: gated cross-attention before each decoder layer, to a 14x14 image's vision states.

    The prefill gets ``pixel_values`` and runs the vision tower; ``generate()`` then passes the
    states it returned (``image_encoder_embeddings``) to every decode call: computed once,
    reused as an input, never recomputed (not in the cache: Idefics' cross-attention caches nothing).
    """
    import transformers

    cfg = transformers.IdeficsConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, alpha_initializer="ones",
        vision_config={"embed_dim": 32, "image_size": 14, "patch_size": 7, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "intermediate_size": 64},
    )  # fmt: skip
    model = _seeded(lambda: transformers.IdeficsForVisionText2Text(cfg))
    prompt = left_padded_prompt(7, pad=2)
    image_mask = torch.zeros(2, 7, 1, dtype=torch.long)  # (batch, text, images)
    for row, image_at in enumerate((2, 0)):
        image_mask[row, image_at:, 0] = 1
    pixels = torch.randn(2, 1, 3, 14, 14, generator=torch.Generator().manual_seed(4))
    return model, greedy(5, **prompt, pixel_values=pixels, image_attention_mask=image_mask)


def _pix2struct() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny Pix2Struct: an image encoder over flattened patches, a text decoder cross-attending to its states.

    The bundle holds the decoder calls (``generate()`` runs the encoder once, outside ``forward``,
    and passes its states as ``encoder_outputs`` to every call). The first decoder call projects the encoder's states into the cross-attention keys and
    values of its ``EncoderDecoderCache``; the later calls read them from there. The second
    image of the batch has 3 padding patches (zero rows, masked out), as the processor pads.
    """
    import transformers

    cfg = transformers.Pix2StructConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                     "use_cache": True, "decoder_start_token_id": PAD, "pad_token_id": PAD, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "patch_embed_hidden_size": 48, "d_ff": 64, "d_kv": 8,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "seq_len": 16},
    )  # fmt: skip
    model = _seeded(lambda: transformers.Pix2StructForConditionalGeneration(cfg))
    patches = torch.randn(2, 12, 48, generator=torch.Generator().manual_seed(4))
    rows, cols = torch.arange(12) // 4 + 1, torch.arange(12) % 4 + 1  # a 3x4 grid of 4x4 patches, 1-based
    flattened = torch.cat([rows.expand(2, 12)[..., None], cols.expand(2, 12)[..., None], patches], dim=-1)
    flattened[1, 9:] = 0
    mask = (flattened.sum(-1) != 0).long()
    return model, greedy(5, flattened_patches=flattened, attention_mask=mask)


FAMILIES += [
    Family(
        "mllama",
        _mllama,
        notes="Llama 3.2 Vision: cross-attention layer to the vision states (2 tiles), kept in the cache "
        "after prefill; left-padded batch of 2",
    ),
    Family(
        "idefics",
        _idefics,
        notes="gated cross-attention to the image states computed at prefill, passed back to every decode call",
    ),
    Family(
        "pix2struct",
        _pix2struct,
        notes="image encoder-decoder: cross-attention keys/values of the image states in the EncoderDecoderCache",
    ),
]


def family(name: str) -> Family:
    """The zoo entry called ``name`` (a family here, or a case of ``behaviours.BEHAVIOURS``)."""
    from behaviours import BEHAVIOURS

    for entry in [*FAMILIES, *BEHAVIOURS]:
        if entry.name == name:
            return entry
    raise KeyError(f"No zoo family {name!r}; known: {', '.join(f.name for f in [*FAMILIES, *BEHAVIOURS])}")
