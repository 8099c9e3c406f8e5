"""Self-contained bundles: the model's config and weights stored with ``include_model``, rebuilt safely."""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import math
import os
import re
import shutil
import sys
import textwrap
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
    MissingDependencyError,
    UnsafeBundleError,
    load_bundle,
)
from iobundle.errors import ModelLoadError
from iobundle.replay._model_load import describe_bundle_model, load_bundle_model, registered_model_classes

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
    with pytest.raises(CaptureError, match="transformers and diffusers models only"):
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


def rewrite_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the stored weights by ``tensors``, with the manifest's size and hash updated (not tampering)."""
    from safetensors.torch import save_file

    from iobundle.calls import WRITE_HASH, new_hasher

    weights = path / "model" / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    data = weights.read_bytes()
    digest = new_hasher(WRITE_HASH)
    digest.update(data)
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    manifest["model"]["files"]["model/weights.safetensors"] = {
        "size": len(data), "hash": WRITE_HASH, "digest": digest.hexdigest()
    }  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def test_weight_of_another_shape_is_refused_by_name(llama_bundle: tuple[Any, Path]) -> None:
    model, path = llama_bundle
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    tensors["model.norm.weight"] = torch.ones(17)
    rewrite_weights(path, tensors)
    with pytest.raises(ModelLoadError, match=r"weight model\.norm\.weight has shape \[17\].*expects \[16\]"):
        load_bundle_model(path)


def test_missing_and_unexpected_weights_are_refused_by_name(llama_bundle: tuple[Any, Path]) -> None:
    model, path = llama_bundle
    tensors = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
    tensors["extra.weight"] = torch.ones(3)
    rewrite_weights(path, tensors)
    with pytest.raises(ModelLoadError, match=r"missing weights \['model\.norm\.weight'\], unexpected \['extra\.weight'\]"):
        load_bundle_model(path)


def test_a_tied_weight_stored_under_its_other_name_loads(llama_bundle: tuple[Any, Path]) -> None:
    model, path = llama_bundle
    tensors = {k: v for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    rewrite_weights(path, tensors)
    rebuilt = load_bundle_model(path)
    assert rebuilt.model.embed_tokens.weight is rebuilt.lm_head.weight
    torch.testing.assert_close(rebuilt.model.embed_tokens.weight, model.lm_head.weight, rtol=0, atol=0)


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


# --- any class transformers registers, rebuilt in a fresh process ------------------------------

SMALL = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 64}
IMAGE_TOKEN = 63


def _llava() -> Any:
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    text = transformers.LlamaConfig(**SMALL, num_key_value_heads=1)
    config = transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN, projection_dim=16
    )
    return transformers.LlavaForConditionalGeneration(config)


def _bert_to_bert() -> Any:
    encoder = transformers.BertConfig(**SMALL)
    decoder = transformers.BertConfig(**SMALL, is_decoder=True, add_cross_attention=True)
    return transformers.EncoderDecoderModel(
        transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    )


#: Tiny models of several kinds; none but T5 was in the hand-written list the loader used to have.
FAMILIES: dict[str, Any] = {
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SMALL, eos_token_id=0)),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SMALL)),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=64,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            decoder_start_token_id=0,
        )
    ),
    "llava": _llava,
    "bert2bert": _bert_to_bert,
}


def _probe(name: str) -> dict[str, torch.Tensor]:
    """The inputs of one forward call, the same in both processes."""
    ids = torch.tensor([[3, 4, 5, 6]])
    if name == "llava":  # one 16x16 image: 4 patches, 4 image tokens
        generator = torch.Generator().manual_seed(0)
        return {
            "input_ids": torch.tensor([[1] + [IMAGE_TOKEN] * 4 + [3, 4]]),
            "pixel_values": torch.randn(1, 3, 16, 16, generator=generator),
        }
    if name in ("t5", "bert2bert"):
        return {"input_ids": ids, "decoder_input_ids": torch.tensor([[0, 3]])}
    return {"input_ids": ids}


# Runs in the fresh process: argv = jobs.json. Only the bundles are read; results go next to them.
RELOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys

    import torch
    from safetensors.torch import save_file

    from iobundle.replay import load_bundle_model

    for name, job in json.load(open(sys.argv[1])).items():
        model = load_bundle_model(job["bundle"])
        probe = {k: torch.tensor(v) for k, v in job["probe"].items()}
        with torch.no_grad():
            logits = model(**probe).logits
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file({"logits": logits, **{"state." + k: v for k, v in state.items()}}, job["out"])
        meta = {"class": type(model).__qualname__, "module": type(model).__module__, "training": model.training}
        json.dump(meta, open(job["out"] + ".json", "w"))
    """
)


@pytest.fixture(scope="module")
def reloaded_families(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Any, dict[str, Any], dict[str, torch.Tensor]]]:
    """Each family observed during generate() (one image for Llava), saved with its model, reloaded elsewhere."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("families")
    jobs: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        model = models[name] = make().eval()
        probe = _probe(name)
        observer = InputObserver()
        with torch.no_grad(), observer(model, store_n_calls=3):
            if name == "bert2bert":  # no generation config of its own: observe plain forward calls
                model(**probe)
            else:
                inputs = {k: v for k, v in probe.items() if k != "decoder_input_ids"}
                model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
        observer.save(root / f"{name}.iobundle", include_model=True)
        jobs[name] = {
            "bundle": str(root / f"{name}.iobundle"),
            "probe": {k: v.tolist() for k, v in probe.items()},
            "out": str(root / f"{name}.out.safetensors"),
        }
    (root / "jobs.json").write_text(json.dumps(jobs), "utf-8")
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, str(root / "jobs.json")],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    return {
        name: (models[name], json.loads(Path(job["out"] + ".json").read_text("utf-8")), load_file(job["out"]))
        for name, job in jobs.items()
    }


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_round_trips_in_a_fresh_process(reloaded_families: dict[str, Any], name: str) -> None:
    model, meta, tensors = reloaded_families[name]
    assert (meta["class"], meta["module"]) == (type(model).__qualname__, type(model).__module__)
    assert meta["training"] is False
    expected = model.state_dict()
    got = {k.removeprefix("state."): v for k, v in tensors.items() if k.startswith("state.")}
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        logits = model(**_probe(name)).logits
    torch.testing.assert_close(tensors["logits"], logits, rtol=0, atol=0)


def test_registered_classes_come_from_the_auto_mappings() -> None:
    from transformers.models.auto import modeling_auto

    classes = registered_model_classes()
    assert classes["GPTNeoXForCausalLM"] == {"gpt_neox"}
    assert "olmo2" in classes["Olmo2ForCausalLM"]
    assert "t5" in classes["T5ForConditionalGeneration"]
    assert "llava" in classes["LlavaForConditionalGeneration"]
    for model_type, name in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        assert model_type in classes[name]
    assert not {"AutoModel", "PreTrainedModel", "LlamaConfig", "LlamaDecoderLayer"} & classes.keys()


# --- a stored config never selects code -------------------------------------------------------

#: (field, hostile value, the module transformers would have imported for it, or None)
HOSTILE_FIELDS: list[tuple[str, Any, str | None]] = [
    ("auto_map", {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}, "evil_modeling"),
    ("custom_pipelines", {"evil": {"impl": "evil_pipeline.EvilPipeline", "pt": ["EvilModel"]}}, "evil_pipeline"),
    ("trust_remote_code", True, None),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ("use_kernels", True, "kernels"),
    ("kernel_config", {"kernel_mapping": {"RMSNorm": "evil-org/evil-kernels:rmsnorm"}}, "kernels"),
    ("backbone", "evil-org/evil-backbone", "timm"),
    ("use_pretrained_backbone", True, "timm"),
    ("backbone_kwargs", {"out_indices": [1]}, "timm"),
    ("attn_implementation", "kernels-community/flash-attn2", "kernels"),
    ("attn_implementation", "evil-org/evil-attention@v1:attn", "kernels"),
    ("attn_implementation", "paged|sdpa", None),
    ("attn_implementation", "paged|eager", None),
    ("attn_implementation", "flash_attention_2", "flash_attn"),
    ("attn_implementation", "flash_attention_3", "flash_attn_interface"),
    ("attn_implementation", "my_registered_attention", None),
    ("_attn_implementation", "evil-org/evil-attention", "kernels"),
    ("_attn_implementation_internal", "flash_attention_2", "flash_attn"),
    ("experts_implementation", "deepgemm", "kernels"),
    ("experts_implementation", "sonicmoe", "kernels"),
    ("_experts_implementation", "evil-org/evil-experts", "kernels"),
    ("dtype", "load", None),
    ("dtype", {"": "float32"}, None),
    ("torch_dtype", "Tensor", None),
]
HOSTILE_IDS = [f"{field}={value}" for field, value, _ in HOSTILE_FIELDS]

#: Where the value is planted: the top-level config of a Llama, the sub-configs of a Llava
#: (text and vision) and of a BERT-to-BERT encoder-decoder.
SUB_CONFIGS = {
    "": "llama",
    "text_config": "llava",
    "vision_config": "llava",
    "encoder": "bert2bert",
    "decoder": "bert2bert",
}


class _ImportRecorder(importlib.abc.MetaPathFinder):
    """Records every module name Python is asked to import (and finds none itself)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        self.names.append(fullname)


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the modules imported, or looked for, while the test runs."""
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    return recorder.names


@pytest.fixture(scope="module")
def base_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama, a Llava and a BERT-to-BERT bundle with their models, each rebuilt once (which warms the imports)."""
    root = tmp_path_factory.mktemp("base")
    makers = {"llama": tiny_llama, "llava": FAMILIES["llava"], "bert2bert": FAMILIES["bert2bert"]}
    paths = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        model = make().eval()
        observer = InputObserver()
        with torch.no_grad(), observer(model):
            model(**_probe(name))
        observer.save(root / name, include_model=True)
        paths[name] = root / name
        load_bundle_model(paths[name])
    return paths


def copy_bundle(base_bundles: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base_bundles[name], tmp_path / name))


def write_config(path: Path, data: bytes) -> None:
    """Replace the stored config and record its new size and sha256, as a hostile author would."""
    (path / "model" / "config.json").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    manifest["model"]["files"]["model/config.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def edit_config(path: Path, edit: Any) -> None:
    config = json.loads((path / "model" / "config.json").read_text("utf-8"))
    edit(config)
    write_config(path, json.dumps(config).encode())


def assert_refused(path: Path, field: str, module: str | None, imports: list[str]) -> UnsafeBundleError:
    modules = set(sys.modules)
    with pytest.raises(UnsafeBundleError, match=re.escape(field)) as info:
        load_bundle_model(path)
    assert "--model MODULE:FACTORY" in str(info.value)
    assert set(sys.modules) - modules == set()  # nothing at all was imported
    assert imports == []  # nor looked for
    if module is not None:
        assert module not in sys.modules
    return info.value


@pytest.mark.parametrize("where", list(SUB_CONFIGS))
@pytest.mark.parametrize(("field", "value", "module"), HOSTILE_FIELDS, ids=HOSTILE_IDS)
def test_config_value_that_selects_code_is_refused(
    base_bundles: dict[str, Path],
    tmp_path: Path,
    imports: list[str],
    where: str,
    field: str,
    value: Any,
    module: str | None,
) -> None:
    path = copy_bundle(base_bundles, SUB_CONFIGS[where], tmp_path)
    edit_config(path, lambda config: (config[where] if where else config).__setitem__(field, value))
    imports.clear()
    assert_refused(path, f"{where}.{field}" if where else field, module, imports)


@pytest.mark.parametrize(
    "value", ["kernels-community/flash-attn2", "evil-org/evil-attention", "paged|sdpa", "flash_attention_2", "x"]
)
def test_manifest_attn_implementation_that_selects_code_is_refused(
    base_bundles: dict[str, Path], tmp_path: Path, imports: list[str], value: str
) -> None:
    path = copy_bundle(base_bundles, "llama", tmp_path)
    edit_manifest(path, attn_implementation=value)
    imports.clear()
    error = assert_refused(path, "model.attn_implementation", "kernels" if "/" in value else None, imports)
    assert repr(value) in str(error)


def test_attn_implementation_per_sub_config_is_checked(
    base_bundles: dict[str, Path], tmp_path: Path, imports: list[str]
) -> None:
    path = copy_bundle(base_bundles, "llava", tmp_path)
    attn = {"": "sdpa", "text_config": "eager", "vision_config": "evil-org/evil-attention"}
    edit_config(path, lambda config: config.__setitem__("attn_implementation", attn))
    imports.clear()
    assert_refused(path, "attn_implementation['vision_config']", "kernels", imports)


def test_per_layer_overrides_are_checked(base_bundles: dict[str, Path], tmp_path: Path, imports: list[str]) -> None:
    path = copy_bundle(base_bundles, "llama", tmp_path)
    overrides = {"0": {"attn_implementation": "kernels-community/flash-attn2"}}
    edit_config(path, lambda config: config.__setitem__("per_layer_config", overrides))
    imports.clear()
    assert_refused(path, "per_layer_config['0'].attn_implementation", "kernels", imports)


def test_sub_config_of_a_model_type_that_loads_code_is_refused(
    base_bundles: dict[str, Path], tmp_path: Path, imports: list[str]
) -> None:
    path = copy_bundle(base_bundles, "llava", tmp_path)
    vision = {"model_type": "timm_wrapper", "architecture": "hf-hub:evil-org/evil-model"}
    edit_config(path, lambda config: config.__setitem__("vision_config", vision))
    imports.clear()
    error = assert_refused(path, "vision_config.model_type", "timm", imports)
    assert "timm" in str(error)


@pytest.mark.parametrize(
    ("class_name", "model_type", "module"),
    [
        ("TimmWrapperModel", "timm_wrapper", "transformers.models.timm_wrapper.modeling_timm_wrapper"),
        ("TimmBackbone", "timm_backbone", "transformers.models.timm_backbone.modeling_timm_backbone"),
        ("RwkvForCausalLM", "rwkv", "transformers.models.rwkv.modeling_rwkv"),
    ],
)
def test_registered_class_that_loads_code_is_refused(
    base_bundles: dict[str, Path], tmp_path: Path, imports: list[str], class_name: str, model_type: str, module: str
) -> None:
    assert model_type in registered_model_classes()[class_name]
    path = copy_bundle(base_bundles, "llama", tmp_path)
    edit_config(path, lambda config: config.__setitem__("model_type", model_type))
    edit_manifest(path, class_name=class_name)
    imports.clear()
    error = assert_refused(path, "model.class_name", module, imports)
    assert f"{class_name} (model_type " in str(error)


def test_default_sub_config_that_loads_code_is_refused(tmp_path: Path, imports: list[str]) -> None:
    # A DETR config without backbone_config gets transformers' default, a timm backbone (timm.create_model
    # by name); the check of the built config sees it before the model is constructed.
    path = capture(tiny_llama(), tmp_path / "detr.iobundle")
    edit_config(path, lambda config: (config.clear(), config.update(model_type="conditional_detr")))
    edit_manifest(path, class_name="ConditionalDetrModel")
    imports.clear()
    with pytest.raises(UnsafeBundleError, match=r"backbone_config\.model_type = 'timm_backbone'.*timm"):
        load_bundle_model(path)
    assert "timm" not in sys.modules and "timm" not in imports


def test_whisper_encoder_of_an_old_bundle_still_rebuilds(tmp_path: Path) -> None:
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    encoder = transformers.WhisperForConditionalGeneration(config).eval().model.encoder
    observer = InputObserver()
    with torch.no_grad(), observer(encoder):
        encoder(torch.randn(1, 8, 16))
    observer.save(tmp_path / "encoder.iobundle", include_model=True)
    assert load_bundle(tmp_path / "encoder.iobundle").manifest.model.class_name == "WhisperEncoder"  # type: ignore[union-attr]
    rebuilt = load_bundle_model(tmp_path / "encoder.iobundle")
    assert type(rebuilt) is type(encoder)
    torch.testing.assert_close(rebuilt.conv1.weight, encoder.conv1.weight, rtol=0, atol=0)


def test_describe_bundle_model_reads_without_building(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle
    info = describe_bundle_model(path)
    assert info is not None
    weights = (path / "model" / "weights.safetensors").stat().st_size
    assert (info.class_name, info.model_type, info.attn_implementation) == ("LlamaForCausalLM", "llama", "sdpa")
    assert (info.weights_bytes, info.submodule, info.refused) == (weights, "", None)


def test_describe_bundle_model_reports_a_refusal(llama_bundle: tuple[Any, Path], imports: list[str]) -> None:
    _, path = llama_bundle
    edit_config(path, lambda config: config.__setitem__("quantization_config", {"quant_method": "bitsandbytes"}))
    imports.clear()
    info = describe_bundle_model(path)
    assert info is not None and info.refused is not None
    assert info.refused.startswith("model/config.json: quantization_config = ")
    assert "bitsandbytes" not in imports and imports == []


def test_describe_bundle_model_of_a_bundle_without_model(tmp_path: Path) -> None:
    assert describe_bundle_model(capture(tiny_llama(), tmp_path / "plain.iobundle", include_model=False)) is None


def test_deeply_nested_sub_configs_are_refused(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle

    def nest(config: dict[str, Any]) -> None:
        inner = config
        for _ in range(40):
            inner["text_config"] = {}
            inner = inner["text_config"]

    edit_config(path, nest)
    with pytest.raises(UnsafeBundleError, match=r"text_config(\.text_config)+: sub-configs nested deeper than 16"):
        load_bundle_model(path)


def test_config_json_nested_past_the_parser_is_refused(llama_bundle: tuple[Any, Path]) -> None:
    _, path = llama_bundle
    write_config(path, b'{"a":' * 200_000 + b"1" + b"}" * 200_000)
    with pytest.raises(UnsafeBundleError, match=r"config\.json: JSON nested too deeply"):
        load_bundle_model(path)


def test_sub_config_known_only_to_its_config_class_is_checked(
    base_bundles: dict[str, Path], tmp_path: Path, imports: list[str]
) -> None:
    # Musicgen's "text_encoder" has neither a *_config name nor (here) a model_type: only
    # MusicgenConfig.sub_configs says it is a config, which the check learns once the class is resolved.
    config = transformers.MusicgenConfig().to_dict()
    del config["text_encoder"]["model_type"]
    config["text_encoder"]["backbone"] = "evil-org/evil-backbone"
    path = copy_bundle(base_bundles, "llama", tmp_path)
    write_config(path, json.dumps(config).encode())
    edit_manifest(path, class_name="MusicgenForConditionalGeneration")
    imports.clear()
    with pytest.raises(UnsafeBundleError, match=r"text_encoder\.backbone = 'evil-org/evil-backbone'"):
        load_bundle_model(path)
    assert "timm" not in imports and "huggingface_hub.hf_api" not in imports


def test_missing_transformers_is_a_missing_dependency_error(
    llama_bundle: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = llama_bundle
    registered_model_classes.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers.models.auto", None)  # what a missing package looks like
    try:
        with pytest.raises(MissingDependencyError, match="pip install transformers"):
            load_bundle_model(path)
        info = describe_bundle_model(path)
        assert info is not None and "pip install transformers" in (info.refused or "")
    finally:
        monkeypatch.undo()
        registered_model_classes.cache_clear()
    assert "LlamaForCausalLM" in registered_model_classes()


# --------------------------------------------------------------------------- attention at save time


@pytest.fixture(scope="module")
def registered_attention() -> str:
    """An attention implementation registered the public way (AttentionInterface), as a user's own would be.

    transformers has no way to unregister one; the name is this test's own.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("iobundle_test_sdpa", sdpa_attention_forward)
    return "iobundle_test_sdpa"


def test_save_warns_when_the_loader_will_refuse_the_models_attention(tmp_path: Path, registered_attention) -> None:
    from iobundle.observer import ObservationWarning

    model = tiny_llama()
    model.set_attn_implementation(registered_attention)
    with pytest.warns(ObservationWarning, match="iobundle_test_sdpa") as caught:
        path = capture(model, tmp_path / "custom.iobundle")
    message = str(caught[0].message)
    assert "--from-bundle" in message and "model.set_attn_implementation('sdpa') before saving" in message
    assert caught[0].filename == __file__  # points at the caller's save()
    # The warning says what the loader does: it refuses the stored model, for the same reason.
    with pytest.raises(UnsafeBundleError, match="iobundle_test_sdpa"):
        load_bundle_model(path)


def test_following_the_advice_gives_a_bundle_the_loader_accepts(tmp_path: Path, registered_attention) -> None:
    model = tiny_llama()
    model.set_attn_implementation(registered_attention)
    model.set_attn_implementation("sdpa")  # what the warning says to do; the ObservationWarning filter is an error
    path = capture(model, tmp_path / "sdpa.iobundle")
    assert load_bundle(path).manifest.model.attn_implementation == "sdpa"
    load_bundle_model(path)


def tiny_mamba2() -> Any:
    config = transformers.Mamba2Config(
        hidden_size=32, num_hidden_layers=1, vocab_size=50, state_size=8, expand=2, conv_kernel=4,
        num_heads=8, head_dim=8, n_groups=1, chunk_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(config).eval()


def test_a_default_config_holding_inf_round_trips_and_gives_the_same_logits(tmp_path: Path) -> None:
    model = tiny_mamba2()
    assert model.config.time_step_limit == (0.0, float("inf"))  # Mamba2's default, kept
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.tensor([[3, 4, 5, 6]]), use_cache=False)
    path = tmp_path / "mamba2.iobundle"
    observer.save(path, include_model=True)
    assert '"time_step_limit": [\n  0.0,\n  Infinity\n ]' in (path / "model" / "config.json").read_text("utf-8")
    rebuilt = load_bundle_model(path)
    assert list(rebuilt.config.time_step_limit) == [0.0, float("inf")]
    assert rebuilt.config.to_dict() == {**model.config.to_dict(), "time_step_limit": [0.0, float("inf")]}
    bundle = load_bundle(path)
    with torch.no_grad():
        got = rebuilt(**bundle.infer_arguments(0)).logits
    torch.testing.assert_close(got, bundle.outputs(0)["logits"], rtol=0, atol=0)


def test_nan_and_negative_infinity_in_a_config_round_trip(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.iobundle_low, model.config.iobundle_unset = float("-inf"), float("nan")
    rebuilt = load_bundle_model(capture(model, tmp_path / "nan.iobundle"))
    assert rebuilt.config.iobundle_low == float("-inf")
    assert isinstance(rebuilt.config.iobundle_unset, float) and math.isnan(rebuilt.config.iobundle_unset)


def test_a_config_value_json_cannot_hold_is_refused_by_its_field_path(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.iobundle_extra = {"scales": [1.0, torch.float16]}
    with pytest.raises(CaptureError, match=r"config\.iobundle_extra\.scales\[1\] is a torch\.dtype") as info:
        capture(model, tmp_path / "dtype.iobundle")
    assert "without include_model" in str(info.value)
    assert not (tmp_path / "dtype.iobundle" / "model").exists()
