"""Self-contained bundles of diffusers models: a UNet's config and weights stored, rebuilt only as a diffusers class."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver, MissingDependencyError, UnsafeBundleError, load_bundle
from iobundle.errors import ModelLoadError
from iobundle.replay import load_bundle_model

diffusers = pytest.importorskip("diffusers")

from zoo.zoo_models import diffusers_unet as tiny_unet  # noqa: E402  (tests/ is on sys.path: the zoo's UNet)


def denoise(unet: Any, latents: torch.Tensor, text: torch.Tensor) -> list[torch.Tensor]:
    """A DDIM loop with classifier-free guidance; the UNet's output at each step."""
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=100)
    scheduler.set_timesteps(2)
    outputs = []
    for t in scheduler.timesteps:
        eps = unet(torch.cat([latents, latents]), t, encoder_hidden_states=text).sample
        outputs.append(eps)
        uncond, cond = eps.chunk(2)
        latents = scheduler.step(uncond + 3.0 * (cond - uncond), t, latents).prev_sample
    return outputs


@pytest.fixture
def unet_bundle(tmp_path: Path) -> tuple[Any, Path, list[torch.Tensor]]:
    unet, observer = tiny_unet(), InputObserver()
    latents, text = torch.randn(1, 4, 8, 8), torch.randn(2, 3, 8)
    with torch.no_grad(), observer(unet):
        outputs = denoise(unet, latents, text)
    path = tmp_path / "unet.iobundle"
    observer.save(path, include_model=True)
    return (latents, text), path, outputs


def edit(path: Path, file: str, change: Any) -> None:
    data = json.loads((path / file).read_text("utf-8"))
    change(data)
    (path / file).write_text(json.dumps(data), "utf-8")


def test_unet_recorded_in_a_denoising_loop_rebuilds_with_identical_outputs(unet_bundle: Any) -> None:
    (latents, text), path, outputs = unet_bundle
    entry = load_bundle(path).manifest.model
    assert entry is not None and (entry.library, entry.class_name) == ("diffusers", "UNet2DConditionModel")
    assert "_class_name" not in json.loads((path / entry.config_file).read_text("utf-8"))
    rebuilt = load_bundle_model(path)
    assert type(rebuilt) is diffusers.UNet2DConditionModel and not rebuilt.training
    with torch.no_grad():
        again = denoise(rebuilt, latents, text)
    assert len(again) == len(outputs) and all(torch.equal(a, b) for a, b in zip(again, outputs))


@pytest.mark.parametrize(
    "class_name", ["os.system", "DDIMScheduler", "diffusers.utils.something", "ModelMixin", "_LazyModule", "utils"]
)
def test_a_class_that_is_not_a_diffusers_model_is_refused_before_anything_is_built(
    unet_bundle: Any, class_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path, _ = unet_bundle
    edit(path, "manifest.json", lambda m: m["model"].update(class_name=class_name))
    built: list[Any] = []
    monkeypatch.setattr(diffusers.ConfigMixin, "from_config", classmethod(lambda cls, *a, **k: built.append(cls)))
    with pytest.raises(UnsafeBundleError, match=r"model\.class_name: .*not a model class the diffusers package"):
        load_bundle_model(path)
    assert built == []


def rewrite(path: Path, member: str, data: bytes) -> None:
    """Replace a model file and record its new size and sha256, as a hostile author would."""
    (path / member).write_bytes(data)
    file = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    edit(path, "manifest.json", lambda m: m["model"]["files"].update({member: file}))


def test_a_private_config_key_is_refused(unet_bundle: Any) -> None:
    _, path, _ = unet_bundle
    config = json.loads((path / "model/config.json").read_text("utf-8"))
    rewrite(path, "model/config.json", json.dumps({**config, "_class_name": "DDIMScheduler"}).encode())
    with pytest.raises(UnsafeBundleError, match=r"model/config\.json: _class_name = 'DDIMScheduler' is not a public"):
        load_bundle_model(path)


def test_missing_and_unexpected_weights_are_refused_by_name(unet_bundle: Any) -> None:
    from safetensors.torch import load_file, save

    _, path, _ = unet_bundle
    weights = load_file(path / "model/weights.safetensors")
    weights["extra.weight"] = weights.pop("conv_out.bias")
    rewrite(path, "model/weights.safetensors", save(weights))
    with pytest.raises(ModelLoadError, match=r"missing weights \['conv_out\.bias'\], unexpected \['extra\.weight'\]"):
        load_bundle_model(path)


def test_missing_diffusers_is_a_missing_dependency_error(unet_bundle: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, path, _ = unet_bundle
    monkeypatch.setitem(sys.modules, "diffusers", None)  # what a missing package looks like
    with pytest.raises(MissingDependencyError, match="pip install diffusers"):
        load_bundle_model(path)


def test_inspect_names_the_library_of_a_stored_diffusers_model(
    unet_bundle: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from iobundle.cli import main

    _, path, _ = unet_bundle
    assert main(["inspect", str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model "))
    assert "UNet2DConditionModel (diffusers, attention" in line and "model_type" not in line
