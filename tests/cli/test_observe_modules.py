"""``observe_modules``: several modules of one model observed in one capture, each exported with its own programs.

A VLM's ``generate()`` runs the vision tower itself and passes its features to the prefill; an
encoder-decoder model runs its encoder once, then the decoder steps. One block observes both, one
bundle per module stores the whole model, and ``iobundle export <dir>/<name>.iobundle --from-bundle``
then ``iobundle validate`` (onnxruntime) pass on each.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2_vl, tiny_t5

from iobundle import BundleExistsError, ObserverArgumentError, load_bundle, observe_modules
from iobundle.cli import main

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.xdist_group("observe_modules")


def _cli(*argv: object) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def _export_and_validate(bundle: Path, *options: str) -> str:
    """``export BUNDLE --from-bundle`` then ``validate`` of what it wrote; both must pass."""
    onnx = bundle.with_suffix(".onnx")
    code, out = _cli("export", bundle, "--from-bundle", *options, "-o", onnx)
    assert code == 0 and "PASS" in out, out
    index = bundle.with_suffix(".programs.json")
    code, checked = _cli("validate", bundle, index if index.exists() else onnx)
    assert code == 0 and "PASS" in checked, checked
    return out


def _unpatched(*modules: Any) -> bool:
    return all(not {"forward", "get_image_features"} & vars(m).keys() for m in modules)


def test_a_vlm_exports_its_vision_tower_and_its_decoder_from_one_capture(tmp_path: Path) -> None:
    model = tiny_qwen2_vl()
    ids = torch.tensor([[5, 6, 96, *[97] * 16, 7, 8]])  # 16 image tokens: a grid of 4 x 4 patches
    pixels, grid = torch.randn(16, 12, generator=torch.Generator().manual_seed(1)), torch.tensor([[1, 4, 4]])
    with (
        torch.no_grad(),
        observe_modules(model, {"vision": model.model.get_image_features, "text": model}, store_n_calls=8) as obs,
    ):
        model.generate(
            ids, pixel_values=pixels, image_grid_thw=grid, max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    assert _unpatched(model, model.model)
    assert (obs["vision"].num_obs(), obs["text"].num_obs()) == (1, 4)
    # the prefill takes what get_image_features returned (never pixel_values): the vision program's output
    (features,) = obs["vision"].info.outputs
    prefill = obs["text"].info.inputs[0].kwargs
    assert "pixel_values" not in prefill
    torch.testing.assert_close(prefill["mm_encoder_outputs"]["image"].pooler_output, features.pooler_output)
    obs.save(tmp_path / "vlm")
    vision, text = load_bundle(tmp_path / "vlm" / "vision.iobundle"), load_bundle(tmp_path / "vlm" / "text.iobundle")
    assert (vision.manifest.model.submodule, text.manifest.model.submodule) == ("model", "")
    _export_and_validate(tmp_path / "vlm" / "vision.iobundle")
    assert "2 programs" in _export_and_validate(tmp_path / "vlm" / "text.iobundle")  # prefill and decode


def test_an_encoder_decoder_model_exports_its_encoder_and_its_decoder_from_one_capture(tmp_path: Path) -> None:
    model = tiny_t5()
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(2))
    counts = {"encoder": 2, "decoder": 8}
    with (
        torch.no_grad(),
        observe_modules(model, {"encoder": model.get_encoder(), "decoder": model}, store_n_calls=counts) as obs,
    ):
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert (obs["encoder"].num_obs(), obs["decoder"].num_obs()) == (1, 4)
    obs.save(tmp_path / "t5")
    _export_and_validate(tmp_path / "t5" / "encoder.iobundle", "--batch-all")  # as docs/llm.md's recipe
    assert "2 programs" in _export_and_validate(tmp_path / "t5" / "decoder.iobundle", "--batch-all")


def test_every_method_is_restored_when_the_block_fails() -> None:
    model = tiny_llama(1)
    with (
        pytest.raises(RuntimeError, match="boom"),
        observe_modules(model, {"layer": model.model.layers[0], "model": model}),
    ):
        assert not _unpatched(model, model.model.layers[0])
        raise RuntimeError("boom")
    assert _unpatched(model, model.model.layers[0])


def test_a_module_that_cannot_stream_leaves_the_ones_entered_before_it_restored(tmp_path: Path) -> None:
    model = tiny_llama(1)
    (tmp_path / "model.iobundle").mkdir()
    (tmp_path / "model.iobundle" / "mine.txt").write_text("keep")
    modules = {"layer": model.model.layers[0], "model": model}
    with (
        pytest.raises(BundleExistsError, match=r"model\.iobundle"),
        observe_modules(model, modules, stream_to=tmp_path),
    ):
        pytest.fail("entered")
    assert _unpatched(model, model.model.layers[0])
    assert (tmp_path / "model.iobundle" / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        (lambda m: {"../x": m.model}, r"file name \.\./x\.iobundle"),
        (
            lambda m: {"other": torch.nn.Linear(2, 2)},
            r"modules\['other'\] \(a Linear\) is neither a module of the LlamaForCausalLM",
        ),
        (lambda m: {"a": m.model, "b": m.model}, r"modules\['a'\] and modules\['b'\] are the same forward"),
    ],
    ids=["a path for a name", "a module of another model", "a module twice"],
)
def test_modules_outside_the_model_or_badly_named_are_refused(modules: Any, message: str) -> None:
    model = tiny_llama(1)
    with pytest.raises(ObserverArgumentError, match=message), observe_modules(model, modules(model)):
        pytest.fail("entered")
    assert _unpatched(model, model.model)


def test_saving_refuses_a_model_transformers_cannot_rebuild_before_writing_anything(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    with observe_modules(model, {"first": model[0], "last": model[2]}) as obs:
        model(torch.randn(4, 2))
    with pytest.raises(ObserverArgumentError, match=r"first\.iobundle'.*transformers.*include_model=False"):
        obs.save(tmp_path / "seq")
    assert not (tmp_path / "seq").exists()
    obs.save(tmp_path / "seq", include_model=False)
    assert load_bundle(tmp_path / "seq" / "last.iobundle").manifest.calls[0].status == "ok"
    with pytest.raises(BundleExistsError, match=r"first\.iobundle"):  # before anything is replaced
        obs.save(tmp_path / "seq", include_model=False)
