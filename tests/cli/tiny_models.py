"""Tiny transformers models built from configs (nothing downloaded), for the CLI tests that capture ``generate()``.

A plain module beside the tests (``conftest.py`` puts this folder on ``sys.path``): each factory
seeds torch and returns the float32 model in eval mode; transformers is imported when one is called.
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(layers: int = 2) -> Any:
    """A Llama of ``layers`` layers (hidden 32, 4 heads, 2 key/value heads, vocabulary 100): a DynamicCache in generate()."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_whisper() -> Any:
    """A 1+1-layer Whisper (d_model 32, 8 mel bins, 30 input frames): an EncoderDecoderCache in generate()."""
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=32,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=15, max_target_positions=32, decoder_start_token_id=1, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config).eval()
