"""The zoo's cases of issue 28's classes of model behaviour, on models no fix was debugged on.

Each class (:data:`families.CLASSES`) has at least two cases here, at least one of them outside
transformers. They go through the zoo's path like every family (``harness.py``): the calls are
observed here, the bundle saved, then exported and validated through the CLI in a fresh process
from the bundle and, for a model the bundle does not store (plain torch, a vision tower), the
model's code (``zoo_models.py``, given as ``--model``). The models the fixes were debugged on are
in the tests of each mechanism and are not repeated here: ``Segments`` and Qwen2-VL's vision tower
(``tests/replay/export/test_value_sizes.py``), ``PatchGrid``, Dinov2, ``PatchMask`` and
``ClassToken`` (``test_strided_sizes.py``), ``SparseGate``, ``BetaPrior`` and ``Gated``
(``test_constant_folding.py``), LoRA on Llama and GPT-2, a compiled Llama and quantized Llamas
(``tests/replay/test_wrapped_models.py``). Class 3's size rules with ``expr`` (remainders, two sizes related)
were debugged on ``padded_windows``, ``vit_interpolated`` and ``strided_encoder``; ``framed_audio``,
``swin_padded``, ``dinov2_strips``, ``square_mixer`` and a diffusers UNet in a denoising loop at two latent sizes
(``unet_denoising``) passed as first written. Class 2's factories traced as
constants with the values fixed were debugged on ``qwen2_5_vl_vision``; ``windowed_pooling`` passed as first written.

A case that does not pass is a known failure with the reason it fails, reported to the issue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zoo_models
from families import FAMILIES, Family, decoder_only

__all__ = ["BEHAVIOURS", "ZOO"]

PLAIN = "plain torch"


def _calls(model: torch.nn.Module, recorded: dict[str, Any]) -> None:
    """Call ``model`` once per entry of ``recorded["calls"]`` (positional arguments, or keyword arguments)."""
    for args in recorded["calls"]:
        model(**args) if isinstance(args, dict) else model(*args)


def _plain(factory: str, *calls: tuple[torch.Tensor, ...]) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    """A builder of ``zoo_models.<factory>()`` and the calls it receives."""
    return lambda: (getattr(zoo_models, factory)(), {"calls": list(calls)})


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _packed(lengths: list[list[int]]) -> list[tuple[torch.Tensor, ...]]:
    return [(_randn(sum(n), 8, seed=i), torch.tensor(n)) for i, n in enumerate(lengths)]


def _grids(grids: list[list[list[int]]]) -> list[tuple[torch.Tensor, ...]]:
    """Patches (one channel, 2 x 2 pixels) and the ``grid_thw`` of each call's images."""
    return [(_randn(int(torch.tensor(g).prod(-1).sum()), 4, seed=i), torch.tensor(g)) for i, g in enumerate(grids)]


def _denoise(model: torch.nn.Module, recorded: dict[str, Any]) -> None:
    """A text-to-image sampling loop: DDIM steps, each a UNet call on the latents twice (classifier-free guidance)."""
    from diffusers import DDIMScheduler

    for latents, text in recorded["runs"]:
        scheduler = DDIMScheduler(num_train_timesteps=100)
        scheduler.set_timesteps(recorded["steps"])
        for t in scheduler.timesteps:
            eps = model(torch.cat([latents, latents]), t, encoder_hidden_states=text).sample
            uncond, cond = eps.chunk(2)
            latents = scheduler.step(uncond + 3.0 * (cond - uncond), t, latents).prev_sample


def _unet_runs() -> tuple[torch.nn.Module, dict[str, Any]]:
    """The UNet and two sampling runs: latents of 8 x 8 then 16 x 16 (multiples of its downsampling), one prompt each
    (its text states and the empty prompt's)."""
    import zoo_models

    runs = [(_randn(1, 4, n, n, seed=n), _randn(2, 3, 8, seed=n + 1)) for n in (8, 16)]
    return zoo_models.diffusers_unet(), {"runs": runs, "steps": 2}


# --------------------------------------------------------------------------- class 1: state kept on modules
# The mechanism (state in and out of each call, the program's module_state input) was debugged on the
# cases of tests/replay/test_module_state.py; streaming_gru passed as first written. The training flags
# recorded with the state (and BatchNorm in training mode converted to ONNX) were debugged on
# streaming_norm, the first call's state None where it made it on streaming_gru_lazy; mixed_mode_norm
# and lazy_rnn_cell passed as first written.


# --------------------------------------------------------------------------- class 2: sizes read from values

GRIDS = [[[1, 2, 4], [1, 4, 2]], [[1, 4, 4], [1, 2, 2]], [[1, 2, 4], [1, 4, 2]], [[1, 2, 6], [1, 4, 4]]]
MODALITIES = [[0, 1, 1, 2, 0], [2, 2, 0], [0, 1, 1, 2, 0], [1, 0, 1, 0, 2, 2, 1]]

BEHAVIOURS: list[Family] = [
    Family(
        "modality_experts",
        _plain("modality_experts", *[(_randn(len(m), 8, seed=i), torch.tensor(m)) for i, m in enumerate(MODALITIES)]),
        notes="one expert per modality id: torch.split by torch.bincount(modality).tolist(); 3 value sets",
        source=PLAIN,
        classes=(2,),
        run=_calls,
        factory="zoo_models:modality_experts",
        export_args=(),
    ),
    Family(
        "packed_pooling",
        _plain("packed_pooling", *_packed([[3, 2], [1, 4, 2], [3, 2], [5, 1, 1, 1]])),
        notes="documents packed in one sequence, split by lengths.tolist(): 2 to 4 documents a call "
        "(3 value sets of 3 shapes)",
        source=PLAIN,
        classes=(2,),
        run=_calls,
        factory="zoo_models:packed_pooling",
        export_args=(),
    ),
    Family(
        "windowed_pooling",
        _plain("windowed_pooling", *_packed([[3, 6], [5], [3, 6], [2, 9, 1]])),
        notes="packed documents pooled in windows of 4 tokens within each document: the bounds from torch.arange "
        "and torch.unique_consecutive over lengths (3 value sets)",
        source=PLAIN,
        classes=(2,),
        run=_calls,
        factory="zoo_models:windowed_pooling",
        export_args=(),
    ),
    Family(
        "qwen3_vl_vision",
        _plain("qwen3_vl_vision", *_grids(GRIDS)),
        notes="Qwen3-VL vision tower: position embeddings interpolated per image from grid_thw.tolist(), "
        "2 images a call, 3 value sets",
        classes=(2,),
        run=_calls,
        factory="zoo_models:qwen3_vl_vision",
        export_args=(),
    ),
    Family(
        "qwen2_5_vl_vision",
        _plain("qwen2_5_vl_vision", *_grids(GRIDS)),
        notes="Qwen2.5-VL vision tower: windows from grid_thw.tolist(), 2 images a call, 3 value sets",
        classes=(2,),
        run=_calls,
        factory="zoo_models:qwen2_5_vl_vision",
        export_args=(),
    ),
]


# --------------------------------------------------------------------------- class 3: sizes multiple of a stride

SIDES = [(16, 16), (24, 32), (32, 24), (16, 16)]  # multiples of 8; 16 x 16 is ViT's 2 x 2 patches of 8


def _vit() -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers

    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=8, image_size=16
    )
    model = zoo_models._seeded(lambda: transformers.ViTModel(config))
    calls = [
        {"pixel_values": _randn(1, 3, *side, seed=i), "interpolate_pos_encoding": True} for i, side in enumerate(SIDES)
    ]
    return model, {"calls": calls}


def _dinov2() -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers

    config = transformers.Dinov2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=4, image_size=8
    )
    model = zoo_models._seeded(lambda: transformers.Dinov2Model(config))
    sides = [(8, 8), (4, 16), (16, 4), (8, 8)]
    return model, {"calls": [{"pixel_values": _randn(1, 3, *side, seed=i)} for i, side in enumerate(sides)]}


def _swin() -> tuple[torch.nn.Module, dict[str, Any]]:
    import transformers

    config = transformers.SwinConfig(
        image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[2], window_size=2, mlp_ratio=2.0
    )
    model = zoo_models._seeded(lambda: transformers.SwinModel(config))
    sides = [(16, 16), (12, 16), (16, 16), (12, 16)]  # patch grids 4 x 4 and 3 x 4 (two programs: make test's time)
    return model, {"calls": [{"pixel_values": _randn(1, 3, *side, seed=i)} for i, side in enumerate(sides)]}


BEHAVIOURS += [
    Family(
        "tiny_unet",
        _plain("tiny_unet", *[(_randn(1, 3, *side, seed=i),) for i, side in enumerate(SIDES)]),
        notes="stride-2 convolutions down and up with skip connections at 3 resolutions, --dim-names: "
        "sides exported as 8 * a dimension of their own",
        source=PLAIN,
        classes=(3,),
        run=_calls,
        factory="zoo_models:tiny_unet",
        export_args=("--dim-names",),
    ),
    Family(
        "padded_windows",
        _plain(
            "padded_windows",
            *[(_randn(2, *side, 8, seed=i),) for i, side in enumerate([(8, 8), (10, 12), (16, 7), (8, 8)])],
        ),
        notes="Swin-style 4 x 4 windows, a side padded to a multiple of 4 when it is not one",
        source=PLAIN,
        classes=(3,),
        run=_calls,
        factory="zoo_models:padded_windows",
        export_args=(),
    ),
    Family(
        "strided_encoder",
        _plain(
            "strided_encoder",
            *[(_randn(1, 2, *side, seed=i),) for i, side in enumerate([(16, 24), (20, 16), (16, 13), (24, 32)])],
        ),
        notes="three stride-2 convolutions, the image reflect-padded to a multiple of 8 when a side is not one",
        source=PLAIN,
        classes=(3,),
        run=_calls,
        factory="zoo_models:strided_encoder",
        export_args=(),
    ),
    Family(
        "vit_interpolated",
        _vit,
        notes="ViT with interpolate_pos_encoding=True at 16 x 16 (its trained grid), 24 x 32, 32 x 24",
        classes=(3,),
        run=_calls,
        export_args=(),
    ),
    Family(
        "framed_audio",
        _plain("framed_audio", *[(_randn(2, n, seed=n),) for n in (16, 22, 12, 13)]),
        notes="a waveform cut into frames of 4 samples, the last frame padded (-length % 4) when it is short; "
        "its GRU specialises the number of frames (one program per number)",
        source=PLAIN,
        classes=(3,),
        run=_calls,
        factory="zoo_models:framed_audio",
        export_args=(),
    ),
    Family(
        "swin_padded",
        _swin,
        notes="Swin with 2 x 2 windows over 4-pixel patches: a patch grid not a multiple of the window is padded",
        classes=(3,),
        run=_calls,
        export_args=(),
    ),
    Family(
        "dinov2_strips",
        _dinov2,
        notes="Dinov2 at its trained 2 x 2 patch grid, then at 1 x 4 and 4 x 1: as many patches, not square",
        classes=(3,),
        run=_calls,
        export_args=(),
    ),
    Family(
        "square_mixer",
        _plain(
            "square_mixer", *[(_randn(2, 4, *side, seed=i),) for i, side in enumerate([(6, 6), (5, 7), (8, 8), (7, 5)])]
        ),
        notes="a square feature map also mixed along its transpose (if x.size(-1) == x.size(-2))",
        source=PLAIN,
        classes=(3,),
        run=_calls,
        factory="zoo_models:square_mixer",
        export_args=(),
    ),
]


# --------------------------------------------------------------------------- class 4: ops on constants only


def _gemma3n() -> tuple[torch.nn.Module, dict[str, Any]]:
    return decoder_only(
        "Gemma3nTextConfig", "Gemma3nForCausalLM", head_dim=8, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=100, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.95, 0.0], layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, intermediate_size=[64, 64],
    )()  # fmt: skip


BEHAVIOURS += [
    Family(
        "orthogonal_mixer",
        _plain("orthogonal_mixer", *[(_randn(rows, 8, seed=rows),) for rows in (2, 3, 5)]),
        notes="torch.nn.utils.parametrizations.orthogonal (householder): the weight computed from parameters "
        "at every call (linalg_householder_product)",
        source=PLAIN,
        classes=(4,),
        run=_calls,
        factory="zoo_models:orthogonal_mixer",
    ),
    Family(
        "dirichlet_prior",
        _plain("dirichlet_prior", *[(_randn(rows, 6, seed=rows),) for rows in (2, 3, 5)]),
        notes="digamma of a learned Dirichlet's parameters added to log-probabilities",
        source=PLAIN,
        classes=(4,),
        run=_calls,
        factory="zoo_models:dirichlet_prior",
    ),
    Family(
        "kaiser_lowpass",
        _plain("kaiser_lowpass", *[(_randn(2, 1, length, seed=length),) for length in (32, 40, 57)]),
        notes="low-pass taps from torch.kaiser_window and a learned cutoff at every call, signals of 3 lengths",
        source=PLAIN,
        classes=(4,),
        run=_calls,
        factory="zoo_models:kaiser_lowpass",
    ),
    Family(
        "gemma3n_text",
        _gemma3n,
        notes="Gemma 3n text decoder: activation sparsity 0.95 in layer 0 (Normal(0, 1).icdf), AltUp, LAuReL, "
        "per-layer inputs",
        classes=(4,),
    ),
]


# --------------------------------------------------------------------------- class 5: wrapped models


def _qwen2_lora() -> tuple[torch.nn.Module, dict[str, Any]]:
    import peft

    model, kwargs = decoder_only("Qwen2Config", "Qwen2ForCausalLM")()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return zoo_models._seeded(lambda: peft.get_peft_model(model, config)), kwargs


def _phi3_compiled() -> tuple[torch.nn.Module, dict[str, Any]]:
    model, kwargs = decoder_only("Phi3Config", "Phi3ForCausalLM")()
    model.model = torch.compile(model.model)
    return model, kwargs


def _generate_eagerly(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """``generate()`` with torch.compile's wrappers in place but run eagerly (compiling on CPU is slow)."""
    with torch.compiler.set_stance("force_eager"):
        model.generate(**kwargs)  # type: ignore[operator]


def _compiled_calls(model: torch.nn.Module, recorded: dict[str, Any]) -> None:
    with torch.compiler.set_stance("force_eager"):
        _calls(model, recorded)


BEHAVIOURS += [
    Family(
        "qwen2_lora",
        _qwen2_lora,
        notes="peft LoRA (rank 4, every projection) on Qwen2, generate() of the PeftModel, its Qwen2 observed: "
        "stored merged under Qwen2ForCausalLM",
        classes=(5,),
        observe=lambda model: {"qwen2_lora": model.get_base_model()},
        requires="peft",
    ),
    Family(
        "phi3_compiled",
        _phi3_compiled,
        notes="Phi-3 whose decoder is wrapped by torch.compile (run eagerly): stored under its plain names",
        classes=(5,),
        run=_generate_eagerly,
    ),
    Family(
        "lora_mlp",
        _plain("lora_mlp", *[(_randn(rows, 8, seed=rows),) for rows in (2, 3, 5)]),
        notes="peft LoRA on a plain torch MLP, the PeftModel observed; exported merged (merge_and_unload)",
        source=PLAIN,
        classes=(5,),
        run=_calls,
        factory="zoo_models:lora_mlp_merged",
        requires="peft",
    ),
    Family(
        "streaming_norm",
        _plain("streaming_norm", *[(_randn(2, 3, n, seed=n),) for n in (5, 7, 6)]),
        notes="BatchNorm in training mode: its running mean, variance and count change at every call",
        source=PLAIN,
        classes=(1,),
        run=_calls,
        factory="zoo_models:streaming_norm",
    ),
    Family(
        "mixed_mode_norm",
        lambda: (zoo_models.mixed_mode_norm_training(), {"calls": [(_randn(n, 2, 7, seed=n),) for n in (4, 6, 5)]}),
        notes="a frozen backbone (BatchNorm, Dropout in eval mode) under a training BatchNorm head; the factory "
        "builds it in eval mode: replayed in the modes recorded",
        source=PLAIN,
        classes=(1,),
        run=_calls,
        factory="zoo_models:mixed_mode_norm",
    ),
    Family(
        "streaming_gru",
        _plain("streaming_gru", *[(_randn(1, 4, 4, seed=i),) for i in range(3)]),
        notes="a GRU encoding a stream in chunks of 4 frames, its hidden state a buffer updated in place",
        source=PLAIN,
        classes=(1,),
        run=_calls,
        factory="zoo_models:streaming_gru",
    ),
    Family(
        "streaming_gru_lazy",
        _plain("streaming_gru_lazy", *[(_randn(1, 4, 4, seed=i),) for i in range(3)]),
        notes="the same GRU, its hidden state an attribute holding None until the first call binds it",
        source=PLAIN,
        classes=(1,),
        run=_calls,
        factory="zoo_models:streaming_gru_lazy",
    ),
    Family(
        "lazy_rnn_cell",
        _plain("lazy_rnn_cell", *[(_randn(2, 3, seed=i),) for i in range(4)]),
        notes="an RNN cell whose hidden state is a buffer registered as None, made by the first call from a learned "
        "initial state (not zeros)",
        source=PLAIN,
        classes=(1,),
        run=_calls,
        factory="zoo_models:lazy_rnn_cell",
    ),
    Family(
        "wrapped_conv_stack",
        _plain("wrapped_conv_stack", *[(_randn(rows, 2, 6, seed=rows),) for rows in (2, 3, 5)]),
        notes="a plain torch model behind a forward(*args, **kwargs) wrapper, observed there, exported unwrapped",
        source=PLAIN,
        classes=(5,),
        run=_calls,
        factory="zoo_models:conv_stack",
    ),
    Family(
        "lora_mlp_wrapped",
        _plain("lora_mlp", *[(_randn(rows, 8, seed=rows),) for rows in (2, 3, 5)]),
        notes="peft LoRA on a plain torch MLP, the PeftModel observed and exported as it is (adapter unmerged)",
        source=PLAIN,
        classes=(5,),
        run=_calls,
        factory="zoo_models:lora_mlp",
        requires="peft",
    ),
    Family(
        "compiled_conv_stack",
        _plain("compiled_conv_stack", *[(_randn(2, 2, length, seed=length),) for length in (6, 9, 12)]),
        notes="a plain torch model wrapped by torch.compile (run eagerly), observed and exported as the wrapper",
        source=PLAIN,
        classes=(5,),
        run=_compiled_calls,
        factory="zoo_models:compiled_conv_stack",
    ),
    Family(
        "unet_denoising",
        _unet_runs,
        notes="a diffusers UNet in a DDIM loop with classifier-free guidance (the latents twice per call), "
        "at latents of 8 x 8 then 16 x 16; the timestep a 0-d tensor",
        source="diffusers",
        classes=(3,),
        run=_denoise,
        export_args=(),
        requires="diffusers",
    ),
]


ZOO: list[Family] = [*FAMILIES, *BEHAVIOURS]
"""Every entry of the zoo: the transformers families of ``families.py``, then the cases above."""
