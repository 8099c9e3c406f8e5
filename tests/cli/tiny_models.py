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


def tiny_qwen2_vl() -> Any:
    """A Qwen2-VL (text: 2 layers, hidden 32; vision: 1 block, patches of 2): image tokens 97 after 96."""
    import transformers

    text = {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 128, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "embed_dim": 32, "num_heads": 2, "patch_size": 2,
              "spatial_merge_size": 1, "temporal_patch_size": 1}  # fmt: skip
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=97, video_token_id=98, vision_start_token_id=96
    )
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def tiny_t5() -> Any:
    """A 2+2-layer T5 (d_model 32, 4 heads, vocabulary 100): the encoder runs once, then the decoder steps."""
    import transformers

    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()
