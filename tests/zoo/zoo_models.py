"""The code of the zoo's models that a bundle does not store: plain torch modules and transformers submodules.

The user's code, in the zoo's terms: the capture imports it from here; the replay (``iobundle export
BUNDLE --model zoo_models:FACTORY``) imports it from a copy in its working directory, as a user's
own module would be. Each factory builds its model seeded, so that both sides hold the same
weights. Nothing here imports the rest of the zoo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        return build().eval()
    finally:
        torch.random.set_rng_state(state)


# --------------------------------------------------------------------------- class 2: sizes read from values


class PackedPooling(torch.nn.Module):
    """Documents packed into one sequence, pooled each by its own attention: ``lengths`` says where each ends."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.score = torch.nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pooled = []
        for doc in torch.split(self.proj(tokens), lengths.tolist()):
            pooled.append((self.score(doc).softmax(0) * doc).sum(0))
        return torch.stack(pooled)


class ModalityExperts(torch.nn.Module):
    """One expert per modality: tokens sorted by their modality id, split by the counts ``bincount`` reads."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, modality: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(modality, stable=True)
        counts = torch.bincount(modality, minlength=3).tolist()
        y = torch.cat([e(part) for e, part in zip(self.experts, torch.split(x[order], counts))])
        return torch.empty_like(y).index_copy(0, order, y)


class WindowedPooling(PackedPooling):
    """Packed documents pooled in windows of 4 tokens that never cross a document's end: the bounds built with
    ``torch.arange`` from ``lengths``, sorted, repeated bounds dropped by ``torch.unique_consecutive``."""

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(lengths, 0)
        starts = torch.arange(0, int(ends[-1]), 4)
        bounds = torch.unique_consecutive(torch.cat([starts, ends]).sort().values)
        x = self.proj(tokens)
        parts = torch.split(x, torch.diff(bounds, prepend=bounds.new_zeros(1)).tolist())
        return torch.stack([(self.score(part).softmax(0) * part).sum(0) for part in parts])


def packed_pooling() -> torch.nn.Module:
    return _seeded(PackedPooling)


def modality_experts() -> torch.nn.Module:
    return _seeded(ModalityExperts)


def windowed_pooling() -> torch.nn.Module:
    return _seeded(WindowedPooling)


def qwen2_5_vl_vision() -> torch.nn.Module:
    """Qwen2.5-VL's vision tower: windowed attention whose windows ``grid_thw`` fixes (1 channel, patches of 2)."""
    import transformers
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    vision = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=2, hidden_size=16, out_hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
            temporal_patch_size=1, spatial_merge_size=1, in_channels=1, window_size=4, fullatt_block_indexes=[1],
        )
    ).vision_config  # fmt: skip
    vision._attn_implementation = "sdpa"
    return _seeded(lambda: modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(vision))


def qwen3_vl_vision() -> torch.nn.Module:
    """Qwen3-VL's vision tower: position embeddings interpolated to each image's grid, read from ``grid_thw``."""
    import transformers
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    vision = transformers.Qwen3VLConfig(
        vision_config=dict(
            depth=2, hidden_size=16, out_hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
            temporal_patch_size=1, spatial_merge_size=1, in_channels=1, num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        )
    ).vision_config  # fmt: skip
    vision._attn_implementation = "sdpa"
    return _seeded(lambda: modeling_qwen3_vl.Qwen3VLVisionModel(vision))


# --------------------------------------------------------------------------- class 3: sizes multiple of a stride


class TinyUNet(torch.nn.Module):
    """Two stride-2 convolutions down, two transposed ones up, skip connections: sides must be multiples of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.down2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.up2 = torch.nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.up1 = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = torch.nn.Conv2d(11, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = F.silu(self.down1(x))
        u = F.silu(self.up2(F.silu(self.down2(h1))))
        u = F.silu(self.up1(torch.cat([u, h1], 1)))
        return self.out(torch.cat([u, x], 1))


class PaddedWindows(torch.nn.Module):
    """Swin-style attention in 4 x 4 windows; a side that is not a multiple of 4 is padded to one first."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, height, width, c = x.shape
        if height % 4 or width % 4:
            x = F.pad(x, (0, 0, 0, -width % 4, 0, -height % 4))
        h, w = x.shape[1] // 4, x.shape[2] // 4
        windows = x.view(b, h, 4, w, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
        q, k, v = self.qkv(windows).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        y = y.view(b, h, w, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, 4 * h, 4 * w, c)
        return self.out(y[:, :height, :width])


class StridedEncoder(torch.nn.Module):
    """Three stride-2 convolutions down and back up, its input zero-padded to a multiple of 8 when it is not one
    (``pad = (8 - h % 8) % 8``, as U-Net and diffusion pipelines do), the output cropped back."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Sequential(*[torch.nn.Conv2d(c, 6, 3, stride=2, padding=1) for c in (2, 6, 6)])
        self.up = torch.nn.Sequential(*[torch.nn.ConvTranspose2d(6, c, 2, stride=2) for c in (6, 6, 2)])

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        pad_h, pad_w = (8 - height % 8) % 8, (8 - width % 8) % 8
        x = F.pad(image, (0, pad_w, 0, pad_h), mode="reflect") if pad_h or pad_w else image
        return self.up(torch.tanh(self.down(x)))[..., :height, :width] + image


class FramedAudio(torch.nn.Module):
    """A waveform cut into frames of 4 samples, the last frame zero-padded when the length is not a multiple of 4
    (the padding computed as ``-length % 4``), each frame embedded and the frames mixed by a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.gru = torch.nn.GRU(8, 8, batch_first=True)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        missing = -wave.shape[-1] % 4
        if missing:
            wave = F.pad(wave, (0, missing))
        frames = self.embed(wave.unflatten(-1, (-1, 4)))
        return self.gru(frames)[0]


class SquareMixer(torch.nn.Module):
    """Token mixing along rows and columns of a feature map; a square map also mixes along its transpose,
    ``if x.size(-1) == x.size(-2)`` (as models sharing one axial weight do)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mix(x)
        if x.size(-1) == x.size(-2):
            y = y + self.mix(x.transpose(-1, -2)).transpose(-1, -2)
        return torch.relu(y).mean((-1, -2))


def tiny_unet() -> torch.nn.Module:
    return _seeded(TinyUNet)


def padded_windows() -> torch.nn.Module:
    return _seeded(PaddedWindows)


def strided_encoder() -> torch.nn.Module:
    return _seeded(StridedEncoder)


def framed_audio() -> torch.nn.Module:
    return _seeded(FramedAudio)


def square_mixer() -> torch.nn.Module:
    return _seeded(SquareMixer)


# --------------------------------------------------------------------------- class 4: ops on constants only


class OrthogonalMixer(torch.nn.Module):
    """A mixing layer kept orthogonal by a parametrization: its weight is computed from parameters at each call."""

    def __init__(self) -> None:
        super().__init__()
        mix = torch.nn.Linear(8, 8)
        self.mix = torch.nn.utils.parametrizations.orthogonal(mix, orthogonal_map="householder")
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(x)))


class KaiserLowpass(torch.nn.Module):
    """A windowed-sinc low-pass filter whose taps are computed at each call from a Kaiser window and its cutoff."""

    def __init__(self) -> None:
        super().__init__()
        self.cutoff = torch.nn.Parameter(torch.tensor(0.25))
        self.gain = torch.nn.Conv1d(1, 1, 1)

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        n = torch.arange(-6, 7, dtype=signal.dtype)
        taps = torch.kaiser_window(13, periodic=False, beta=8.0) * torch.sinc(2 * self.cutoff * n)
        return self.gain(F.conv1d(signal, (taps / taps.sum()).view(1, 1, -1), padding=6))


class DirichletPrior(torch.nn.Module):
    """Log-probabilities plus the expected log of a learned Dirichlet (``digamma`` of its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_alpha = torch.nn.Parameter(torch.randn(6))
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.log_alpha.exp()
        return self.lin(x).log_softmax(-1) + torch.digamma(alpha) - torch.digamma(alpha.sum())


def orthogonal_mixer() -> torch.nn.Module:
    return _seeded(OrthogonalMixer)


def kaiser_lowpass() -> torch.nn.Module:
    return _seeded(KaiserLowpass)


def dirichlet_prior() -> torch.nn.Module:
    return _seeded(DirichletPrior)


# --------------------------------------------------------------------------- class 5: wrapped models


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def lora_mlp() -> Any:
    """A plain torch MLP with a peft LoRA adapter of rank 2 on both layers, random (not peft's zero update)."""
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["up", "down"], init_lora_weights=False)
    return _seeded(lambda: peft.get_peft_model(Mlp(), config))


def lora_mlp_merged() -> torch.nn.Module:
    """What a user exports of :func:`lora_mlp`: the adapter merged into the MLP's weights."""
    return lora_mlp().merge_and_unload().eval()


class StreamingNorm(torch.nn.Module):
    """A conv block whose BatchNorm runs in training mode: its running statistics change with every call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


def streaming_norm() -> torch.nn.Module:
    return _seeded(StreamingNorm).train()


class StreamingGru(torch.nn.Module):
    """Encodes a stream chunk by chunk, carrying the GRU's hidden state between calls in a buffer
    (``lazy``: an attribute holding None until the first call)."""

    def __init__(self, lazy: bool = False) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(4, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 2)
        self.state: torch.Tensor | None
        if lazy:
            self.state = None
        else:
            self.register_buffer("state", torch.zeros(1, 1, 6), persistent=False)

    def forward(self, chunk: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = torch.zeros(1, chunk.shape[0], 6)
        out, state = self.gru(chunk, self.state)
        if "state" in self._buffers:
            self.state.copy_(state)
        else:
            self.state = state
        return self.head(out)


def streaming_gru() -> torch.nn.Module:
    return _seeded(StreamingGru).eval()


def streaming_gru_lazy() -> torch.nn.Module:
    return _seeded(lambda: StreamingGru(lazy=True)).eval()


class MixedModeNorm(torch.nn.Module):
    """A frozen backbone (BatchNorm and Dropout in eval mode) under a head whose BatchNorm trains: modes mixed."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv1d(2, 6, 3, padding=1)
        self.backbone = torch.nn.Sequential(conv, torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Dropout(0.5))
        self.head = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
        with torch.no_grad():  # running statistics of a backbone trained before: not those of a fresh BatchNorm
            self.backbone[1].running_mean.uniform_(-1, 1)
            self.backbone[1].running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean(-1))


def mixed_mode_norm() -> torch.nn.Module:
    """In eval mode, as a factory that builds a model for inference gives it."""
    return _seeded(MixedModeNorm)


def mixed_mode_norm_training() -> torch.nn.Module:
    """As it was recorded: training, its backbone frozen (``eval()``)."""
    model = mixed_mode_norm().train()
    model.backbone.eval()
    return model


class LazyRnnCell(torch.nn.Module):
    """An RNN cell without normalisation whose hidden state is a buffer registered as None, made by the first
    call from a learned initial state."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.RNNCell(3, 5)
        self.h0 = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("hidden", None, persistent=False)

    def forward(self, frame: torch.Tensor) -> torch.Tensor:
        hidden = self.h0.expand(frame.shape[0], 5) if self.hidden is None else self.hidden
        self.hidden = self.cell(frame, hidden)
        return self.hidden * 2


def lazy_rnn_cell() -> torch.nn.Module:
    return _seeded(LazyRnnCell)


class PassThrough(torch.nn.Module):
    """A wrapper that forwards everything to the module it holds, as a parallel or hook wrapper does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def wrapped_conv_stack() -> torch.nn.Module:
    """:class:`ConvStack` behind :class:`PassThrough`: what is observed; the stack alone is what is exported."""
    return PassThrough(conv_stack())


def conv_stack() -> torch.nn.Module:
    return _seeded(ConvStack).eval()


class ConvStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).mean(-1))


def compiled_conv_stack() -> torch.nn.Module:
    """:func:`conv_stack` wrapped by ``torch.compile`` (an ``OptimizedModule``), as a user holds it."""
    return torch.compile(conv_stack())


def diffusers_unet() -> torch.nn.Module:
    """A diffusers UNet (two blocks, cross-attention on text states), as a denoising pipeline calls it."""
    from diffusers import UNet2DConditionModel

    return _seeded(
        lambda: UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=8,
            attention_head_dim=2,
            norm_num_groups=4,
        )
    )
