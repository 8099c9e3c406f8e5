"""A tiny decoder-only language model in plain torch, with a key/value cache passed back in.

It exists so that ``iobundle demo`` runs the whole job with nothing but iobundle installed:
a prefill call (no cache), then decode calls whose cache grows by one position each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyDecoder", "demo_model", "generate"]

Cache = list[tuple[torch.Tensor, torch.Tensor]]


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        # Separate projections keep q, k, v contiguous: reshaping a slice of a fused projection
        # makes torch.export guard on the query length being 1.
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        batch, length, hidden = x.shape
        head_dim = hidden // self.heads
        h = self.norm1(x)
        q, k, v = (
            t.reshape(batch, length, self.heads, head_dim).transpose(1, 2) for t in (self.q(h), self.k(h), self.v(h))
        )
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        total = k.shape[2]
        # query i (at absolute position total - length + i) sees keys 0 .. total - length + i;
        # an explicit mask (never is_causal) keeps one graph valid for prefill and decode
        allowed = torch.ones(length, total, dtype=torch.bool, device=x.device).tril(diagonal=total - length)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, hidden))
        x = x + self.mlp(self.norm2(x))
        return x, (k, v)


class TinyDecoder(nn.Module):
    """A 2-layer decoder: ``forward(input_ids, past_key_values=None) -> {"logits", "past_key_values"}``."""

    def __init__(
        self, vocab: int = 96, hidden: int = 32, heads: int = 4, layers: int = 2, max_positions: int = 128
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_positions, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, past_key_values: Cache | None = None) -> dict[str, object]:
        start = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.positions(positions)
        cache: Cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past_key_values is None else past_key_values[i])
            cache.append(kv)
        return {"logits": self.head(self.norm(x)), "past_key_values": cache}


def demo_model() -> TinyDecoder:
    """The demo's model, with deterministic weights (the same in every process)."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = TinyDecoder()
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


@torch.no_grad()
def generate(model: TinyDecoder, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation: one prefill call, then one decode call per new token."""
    out = model(input_ids)
    tokens = [input_ids]
    for _ in range(max_new_tokens):
        next_token = out["logits"][:, -1:].argmax(-1)
        tokens.append(next_token)
        out = model(next_token, past_key_values=out["past_key_values"])
    return torch.cat(tokens, dim=1)
