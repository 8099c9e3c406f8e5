"""Self-contained bundles: the model's config and weights stored with ``include_model``, rebuilt safely."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import (
    CaptureError,
    InputObserver,
    IntegrityError,
    IobundleError,
    ManifestError,
    UnsafeBundleError,
    load_bundle,
)
from iobundle.errors import ModelLoadError
from iobundle.replay._model_load import load_bundle_model, registered_model_classes

transformers = pytest.importorskip("transformers")


def tiny_llama(**overrides: Any) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=50,
        tie_word_embeddings=True,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def capture(model: Any, path: Path, *, observed: Any = None, include_model: Any = True) -> Path:
    observer = InputObserver()
    with torch.no_grad(), observer(observed if observed is not None else model, store_n_calls=3):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    observer.save(path, include_model=include_model)
    return path


@pytest.fixture
def llama_bundle(tmp_path: Path) -> tuple[Any, Path]:
    model = tiny_llama()
    return model, capture(model, tmp_path / "llama.iobundle")


def edit_manifest(path: Path, **model_fields: Any) -> None:
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    manifest["model"].update(model_fields)
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def test_model_round_trips_through_the_bundle(llama_bundle: tuple[Any, Path]) -> None:
    model, path = llama_bundle
    entry = load_bundle(path).manifest.model
    assert entry is not None
    assert (entry.class_name, entry.submodule, entry.attn_implementation) == ("LlamaForCausalLM", "", "sdpa")
    assert (path / entry.config_file).is_file() and (path / entry.weights_file).is_file()
    rebuilt = load_bundle_model(path)
    assert type(rebuilt) is type(model) and not rebuilt.training
    expected, got = model.state_dict(), rebuilt.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight  # tied again


def test_observed_submodule_is_handed_back(tmp_path: Path) -> None:
    model = tiny_llama()
    attention = model.model.layers[0].self_attn
    path = capture(model, tmp_path / "attention.iobundle", observed=attention, include_model=model)
    assert load_bundle(path).manifest.model.submodule == "model.layers.0.self_attn"  # type: ignore[union-attr]
    rebuilt = load_bundle_model(path)
    assert type(rebuilt).__name__ == "LlamaAttention"
    torch.testing.assert_close(rebuilt.q_proj.weight, attention.q_proj.weight, rtol=0, atol=0)


def test_bfloat16_weights_stay_bfloat16(tmp_path: Path) -> None:
    model = tiny_llama().to(torch.bfloat16)
    rebuilt = load_bundle_model(capture(model, tmp_path / "bf16.iobundle"))
    assert rebuilt.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(rebuilt.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_include_model_refuses_what_a_config_cannot_rebuild(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(CaptureError, match="include_model=model"):
        capture(model, tmp_path / "a.iobundle", observed=model.model.layers[0].self_attn)
    with pytest.raises(CaptureError, match="not a submodule"):
        capture(model, tmp_path / "b.iobundle", observed=model.model.layers[0].self_attn, include_model=tiny_llama())
    observer = InputObserver()
    linear = torch.nn.Linear(2, 2)
    with observer(linear):
        linear(torch.ones(1, 2))
    with pytest.raises(CaptureError, match="transformers models only"):
        observer.save(tmp_path / "c.iobundle", include_model=True)


def test_bundle_without_model_says_so(tmp_path: Path) -> None:
    path = capture(tiny_llama(), tmp_path / "plain.iobundle", include_model=False)
    assert load_bundle(path).manifest.model is None
    assert not (path / "model").exists()
    with pytest.raises(ModelLoadError, match="stores no model"):
        load_bundle_model(path)


@pytest.mark.parametrize(
    "class_name", ["os.system", "system", "PreTrainedModel", "AutoModelForCausalLM", "LlamaForCausalLM.__init__"]
)
def test_hostile_class_name_is_refused_before_any_import(
    llama_bundle: tuple[Any, Path], class_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = llama_bundle
    edit_manifest(path, class_name=class_name)
    called: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a))
    import importlib

    imported: list[str] = []
    real_import_module = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real_import_module(name))
    with pytest.raises(UnsafeBundleError, match=re.escape(repr(class_name)) + ".*transformers registers") as info:
        load_bundle_model(path)
    assert isinstance(info.value, IobundleError)
    assert "--model MODULE:FACTORY" in str(info.value)
    assert called == [] and imported == []
    assert class_name not in registered_model_classes()


def test_tampered_weights_are_refused(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle
    weights = path / "model" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"weights\.safetensors"):
        load_bundle_model(path)


@pytest.mark.parametrize("field", ["config_file", "weights_file"])
def test_model_files_must_stay_inside_the_bundle(llama_bundle: tuple[Any, Path], field: str) -> None:
    _, path = llama_bundle
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    old = manifest["model"][field]
    manifest["model"][field] = "../outside.json"
    manifest["model"]["files"]["../outside.json"] = manifest["model"]["files"].pop(old)
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")
    with pytest.raises(UnsafeBundleError, match=r"outside\.json"):
        load_bundle_model(path)


def test_config_of_another_model_type_is_refused(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle
    edit_manifest(path, class_name="MistralForCausalLM")
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        load_bundle_model(path)


def test_unknown_manifest_model_field_is_refused(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle
    edit_manifest(path, trust_remote_code=True)
    with pytest.raises(ManifestError):
        load_bundle(path)
