"""The LLM demo: a tiny Llama captured from ``generate()``, exported and validated from its bundle alone.

Needs transformers. The model is built from a config with random weights (nothing is
downloaded); the bundle stores the config and weights (``include_model=True``), and the
export step rebuilds the model from the bundle, not from this process's copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = ["LLAMA_CONFIG", "capture_llama_demo", "tiny_llama"]

#: The demo model: 2 layers, hidden size 32, grouped-query attention (4 query heads, 2 key/value heads).
LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` built from :data:`LLAMA_CONFIG` with weights drawn from ``seed``, in eval mode."""
    import transformers

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG))
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def capture_llama_demo(
    directory: str | os.PathLike[str], *, prompt_length: int = 5, new_tokens: int = 6
) -> tuple[Path, int]:
    """Record every ``forward`` call of a tiny Llama's greedy ``generate()`` into a self-contained bundle.

    The bundle (``directory/llama.iobundle``, replaced if present) holds the model's config and
    weights (``include_model=True``), so ``iobundle export BUNDLE --from-bundle`` rebuilds the
    model from it, with no code of the user's.

    Returns:
        The bundle's path and the number of calls recorded (one prefill, then one per new token).
    """
    from iobundle.observer import InputObserver

    model = tiny_llama()
    prompt = torch.randint(
        0, LLAMA_CONFIG["vocab_size"], (1, prompt_length), generator=torch.Generator().manual_seed(1)
    )
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=new_tokens + 1):
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    path = Path(directory) / "llama.iobundle"
    observer.save(path, overwrite=True, include_model=True)
    return path, observer.num_obs()
