"""include_model of wrapped and modified models (issue 28, class 5): what the loader can rebuild, or a refusal.

A peft LoRA is merged into the weights, stored under the base class and its names; torch.compile's
wrapper is looked through; quantized weights are refused before anything is written.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import CaptureError, load_bundle
from iobundle.cli import main
from iobundle.replay import load_bundle_model

transformers = pytest.importorskip("transformers")


def tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2() -> Any:
    """GPT-2: Conv1D projections (peft merges them transposed) and tied embeddings."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def import_peft() -> Any:
    """peft, from the test extra: its tests skip without it, except under CI (``CI`` set), which must run them."""
    return importlib.import_module("peft") if os.environ.get("CI") else pytest.importorskip("peft")


def with_lora(model: Any, targets: list[str], r: int) -> Any:
    """``model`` with a LoRA adapter of rank ``r`` whose weights are random (not the zero update peft starts from)."""
    peft = import_peft()
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


def record(observed: Any, call: Any, path: Path, include_model: Any = True) -> Path:
    from iobundle import InputObserver

    observer = InputObserver()
    with torch.no_grad(), observer(observed):
        call()
    observer.save(path, include_model=include_model)
    return path


def replays_from_the_bundle(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``iobundle run --from-bundle``: the rebuilt model gives the recorded outputs on every recorded call."""
    code = main(["run", str(path), "--from-bundle", "--atol", "1e-5", "--rtol", "0"])
    assert code == 0, capsys.readouterr()


@pytest.mark.parametrize("case", ["llama", "gpt2"])
def test_a_lora_model_is_stored_merged_under_its_base_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    if case == "llama":  # observed where generate() runs: the LoRA-injected Llama inside the PeftModel
        model = with_lora(tiny_llama(), ["q_proj", "v_proj", "down_proj"], r=4)
        observed, include_model, base_class = model.get_base_model(), True, "LlamaForCausalLM"
    else:  # the PeftModel itself observed and given as include_model
        model = with_lora(tiny_gpt2(), ["c_attn", "c_fc"], r=2)
        observed, include_model, base_class = model, model, "GPT2LMHeadModel"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6]])
    if case == "llama":
        call = lambda: model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)  # noqa: E731
    else:
        call = lambda: model(input_ids=ids)  # noqa: E731
    path = record(observed, call, tmp_path / f"{case}.iobundle", include_model)

    entry = load_bundle(path).manifest.model
    assert entry is not None and entry.class_name == base_class and entry.submodule == ""
    assert [(a.name, a.method, a.ranks) for a in entry.merged_adapters or []] == [
        ("default", "lora", [4 if case == "llama" else 2])
    ]
    rebuilt = load_bundle_model(path)
    assert type(rebuilt).__name__ == base_class
    assert not any("lora" in k for k in rebuilt.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    replays_from_the_bundle(path, capsys)
    # the user's model is left as it was: adapters unmerged, weights unchanged
    assert not any(getattr(m, "merged", False) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_the_lora_update_is_what_the_stored_weights_hold(tmp_path: Path) -> None:
    """The merged weights differ from the base model's exactly where the adapter acts."""
    base = tiny_llama()
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    model = with_lora(base, ["q_proj"], r=4)
    ids = torch.tensor([[3, 4, 5]])
    path = record(model.get_base_model(), lambda: model(input_ids=ids), tmp_path / "q.iobundle")
    stored = load_bundle_model(path).state_dict()
    assert stored.keys() == plain.keys()
    changed = {k for k in plain if not torch.equal(stored[k], plain[k])}
    assert changed == {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)}


def test_a_prompt_tuned_model_observed_itself_is_refused(tmp_path: Path) -> None:
    peft = import_peft()
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    model = peft.get_peft_model(tiny_llama(), config).eval()
    path = tmp_path / "prompt.iobundle"
    with pytest.raises(CaptureError, match=r"PeftModelForCausalLM of (PeftType\.)?PROMPT_TUNING.*get_base_model"):
        record(model, lambda: model(input_ids=torch.tensor([[3, 4, 5]])), path)
    assert not path.exists()


def test_a_compiled_submodule_is_stored_under_its_plain_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_llama()
    model.model = torch.compile(model.model)  # an OptimizedModule: its weights are named model._orig_mod.*
    assert any(k.startswith("model._orig_mod.") for k in model.state_dict())
    ids = torch.tensor([[3, 4, 5]])
    with torch.compiler.set_stance("force_eager"):  # compiling on CPU is slow; the wrapper is what matters
        path = record(model, lambda: model(input_ids=ids), tmp_path / "compiled.iobundle")
        expected = model(input_ids=ids).logits
    rebuilt = load_bundle_model(path)
    assert type(rebuilt).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, expected, rtol=0, atol=0)
    replays_from_the_bundle(path, capsys)


def test_a_compiled_model_given_as_include_model_is_stored_as_the_model_it_wraps(tmp_path: Path) -> None:
    model = tiny_llama()
    compiled = torch.compile(model)
    attention = model.model.layers[0].self_attn
    path = record(attention, lambda: model(input_ids=torch.tensor([[3, 4, 5]])), tmp_path / "c.iobundle", compiled)
    assert load_bundle(path).manifest.model.submodule == "model.layers.0.self_attn"  # type: ignore[union-attr]
    rebuilt = load_bundle_model(path)
    torch.testing.assert_close(rebuilt.q_proj.weight, attention.q_proj.weight, rtol=0, atol=0)


def quantized_llama(library: str) -> Any:
    model = tiny_llama()
    if library == "torch.ao":  # dynamic quantization: Linear layers become torch.ao.nn.quantized.dynamic.Linear
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    quanto = pytest.importorskip("optimum.quanto")  # weights become quanto tensor subclasses
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    return model


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize(
    ("library", "named"),
    [
        ("torch.ao", r"model\.layers\.0\.self_attn\.q_proj \(torch\.ao\.nn\.quantized"),
        ("quanto", r"q_proj\.weight \(WeightQ"),
    ],
    ids=["torch.ao", "quanto"],
)
def test_a_quantized_model_is_refused_before_anything_is_written(tmp_path: Path, library: str, named: str) -> None:
    model = quantized_llama(library)
    path = tmp_path / "quantized.iobundle"
    with pytest.raises(CaptureError, match=rf"quantized weights of LlamaForCausalLM.*{named}.*dequantized"):
        record(model, lambda: model(input_ids=torch.tensor([[3, 4, 5]])), path)
    assert not path.exists()


def test_an_adapter_that_cannot_be_merged_faithfully_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    tied = with_lora(tiny_gpt2(), ["lm_head"], r=2)  # lm_head's weight is the input embedding's too
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(CaptureError, match=r"peft Linear at lm_head.*tied to transformer\.wte\.weight"):
        record(tied, lambda: tied(input_ids=ids), tmp_path / "tied.iobundle")
    model = with_lora(tiny_llama(), ["q_proj"], r=4)
    inside = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer  # runs without the adapter
    with pytest.raises(CaptureError, match=r"at model\.layers\.0\.self_attn\.q_proj .*observed module is part"):
        record(inside, lambda: model(input_ids=ids), tmp_path / "inside.iobundle", model)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("method", ["dora", "embedding_and_modules_to_save", "ia3", "loha"])
def test_other_peft_methods_are_merged_too(tmp_path: Path, method: str) -> None:
    peft = import_peft()
    config = {
        "dora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
        "embedding_and_modules_to_save": lambda: peft.LoraConfig(
            r=4, target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"]
        ),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj"], init_weights=False),
    }[method]()
    model = peft.get_peft_model(tiny_llama(), config).eval()
    torch.manual_seed(1)
    for name, parameter in model.named_parameters():  # updates that change the outputs
        if any(part in name for part in ("lora_B", "lora_embedding_B", "ia3_l", "modules_to_save")):
            torch.nn.init.normal_(parameter, std=0.1)
    ids = torch.tensor([[3, 4, 5, 6]])
    path = record(model.get_base_model(), lambda: model(input_ids=ids), tmp_path / f"{method}.iobundle")
    rebuilt = load_bundle_model(path)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(model.get_base_model()(ids).logits, tiny_llama()(ids).logits)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_a_model_built_with_arguments_its_config_does_not_hold_is_refused_before_anything_is_written(
    tmp_path: Path, family: str
) -> None:
    """``ViTModel(config, add_pooling_layer=False)``: its config rebuilds a model with a pooler the bundle lacks."""
    from transformers import BertConfig, BertModel, ViTConfig, ViTModel

    if family == "vit":
        config = ViTConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=28,
            patch_size=14,
        )
        model, call = ViTModel(config, add_pooling_layer=False).eval(), {"pixel_values": torch.randn(1, 3, 28, 28)}
    else:
        config = BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
        model, call = BertModel(config, add_pooling_layer=False).eval(), {"input_ids": torch.tensor([[3, 4, 5]])}
    path = tmp_path / f"{family}.iobundle"
    with pytest.raises(
        CaptureError, match=r"its config builds differs \(it has pooler\.dense\.bias, pooler\.dense\.weight"
    ):
        record(model, lambda: model(**call), path)
    assert not path.exists()
    kept = ViTModel(config) if family == "vit" else BertModel(config)  # built from its config alone: stored
    record(kept.eval(), lambda: kept(**call), path)
    with torch.no_grad():
        assert torch.equal(load_bundle_model(path)(**call).last_hidden_state, kept(**call).last_hidden_state)
