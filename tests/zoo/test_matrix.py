"""The support matrix: one row per bundle with the family's dtype and the cache kind read from its bundle."""

from __future__ import annotations

import torch
import transformers
from families import Family, decoder_only
from harness import BundleResult, FamilyResult, bundle_cache_kinds
from matrix import format_matrix

from iobundle import InputObserver
from iobundle.schema import load_manifest


def test_cache_kind_is_read_from_the_bundle(tmp_path):
    config = transformers.MistralConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
        vocab_size=50, sliding_window=4, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model.generate(input_ids=torch.randint(3, 50, (1, 5)), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    observer.save(tmp_path / "m.iobundle")
    assert bundle_cache_kinds(load_manifest(tmp_path / "m.iobundle")) == "DynamicCache: sliding"


def test_matrix_rows_name_the_dtype_and_the_cache():
    entry = Family("tiny_fp16", decoder_only("LlamaConfig", "LlamaForCausalLM"), dtype="float16")
    result = FamilyResult("tiny_fp16", bundles=[BundleResult("tiny_fp16", cache="DynamicCache: full")])
    table = format_matrix([entry], {"tiny_fp16": result}, seconds=1.0)
    header, _, row = table.splitlines()[:3]
    assert header.startswith("| family | source | classes | dtype | cache | result |")
    assert row.startswith("| tiny_fp16 | transformers | - | float16 | DynamicCache: full | FAIL |")


def test_matrix_rows_name_the_source_and_the_classes():
    entry = Family("mlp", decoder_only("LlamaConfig", "LlamaForCausalLM"), source="plain torch", classes=(2, 4))
    table = format_matrix([entry], {"mlp": FamilyResult("mlp", bundles=[BundleResult("mlp")])}, seconds=1.0)
    row = table.splitlines()[2]
    assert row.startswith("| mlp | plain torch | 2 (sizes read from values), 4 (ops on constants only) | float32 |")
