"""Sizes that are multiples of a stride: a ViT called at several resolutions, split by a rule on its number of patches."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from iobundle import InputObserver, load_bundle
from iobundle.errors import ManifestError
from iobundle.replay.export._dims import split_rule
from iobundle.replay.infer import derive_dims
from iobundle.schema import SizeCondition, conditions_met, load_program_index

SIDES = ((28, 28), (42, 42), (56, 42), (28, 28))  # multiples of the patch size 14; 2 x 2 patches at 28


class PatchGrid(torch.nn.Module):
    """Learned position embeddings for a 2 x 2 grid of 14-pixel patches, interpolated for any other grid."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, 14, stride=14)
        self.pos = torch.nn.Parameter(torch.randn(1, 4, 8))
        self.out = torch.nn.Linear(8, 4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h, w = pixel_values.shape[2] // 14, pixel_values.shape[3] // 14
        x = self.proj(pixel_values).flatten(2).transpose(1, 2)
        if h * w == 4:
            pos = self.pos
        else:
            pos = F.interpolate(self.pos.reshape(1, 2, 2, 8).permute(0, 3, 1, 2), size=(h, w), mode="bilinear")
            pos = pos.permute(0, 2, 3, 1).reshape(1, h * w, 8)
        return self.out(x + pos).mean(1)


def dinov2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=14, image_size=28
    )
    return transformers.Dinov2Model(config).eval()


def test_a_guard_on_a_number_of_patches_is_a_size_rule_with_floor_division():
    message = "Guard failed: pixel_values.size()[3] // 14 * (pixel_values.size()[2] // 14) == 4"
    holds, negation = split_rule(message, {"pixel_values": ("pixel_values", None)})
    assert holds.model_dump(mode="json") == {
        "of": [["pixel_values", 3], ["pixel_values", 2]], "op": "==", "value": 4, "div": [14, 14]
    }  # fmt: skip
    assert negation.describe() == "axis 3 of pixel_values // 14 * axis 2 of pixel_values // 14 != 4"
    sizes = {2: 29, 3: 41}  # 2 x 2 patches, the rest of each side dropped as the convolution drops it
    assert conditions_met([holds], lambda name, axis, item: sizes[axis])
    assert not conditions_met([negation], lambda name, axis, item: sizes[axis])
    # A rule without division reads as before (no ``div``).
    assert "div" not in SizeCondition(of=[("x", 1)], op="<=", value=3).model_dump(mode="json")


@pytest.mark.parametrize("build", [PatchGrid, dinov2], ids=["patch_grid", "dinov2"])
def test_a_vit_at_several_resolutions_gets_one_program_per_side_of_its_patch_count(build, tmp_path):
    torch.manual_seed(0)
    model = build().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(SIDES)):
        for side in SIDES:
            model(torch.randn(1, 3, *side))
    observer.save(tmp_path / "vit.iobundle")
    bundle = load_bundle(tmp_path / "vit.iobundle")
    result = bundle.export_programs(model)
    assert [(p.phase.calls, [c.describe() for c in p.sizes]) for p in result.programs] == [
        ((0, 3), ["axis 3 of pixel_values // 14 * axis 2 of pixel_values // 14 == 4"]),
        ((1, 2), ["axis 3 of pixel_values // 14 * axis 2 of pixel_values // 14 != 4"]),
    ]
    assert result.ok
    index = result.to_onnx(tmp_path / "vit.onnx")
    rows = bundle.check_discrepancies(index)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True), (1, "p1", True), (2, "p1", True), (3, "p0", True)
    ]  # fmt: skip
    other = InputObserver()  # resolutions no call had: a 2 x 2 grid of 29 pixels, a 5 x 3 grid
    with torch.no_grad(), other(model):
        for side in ((29, 29), (70, 42)):
            model(torch.randn(1, 3, *side))
    rows = other.check_discrepancies(index)
    assert [(r["program"], r["SUCCESS"]) for r in rows] == [("p0", True), ("p1", True)]


class PatchMask(torch.nn.Module):
    """Patches of 14 pixels weighted by a mask of one value per patch: the mask's sides are the image's // 14."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, 14, stride=14)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        y = self.proj(pixel_values).flatten(2).transpose(1, 2)
        return (y * patch_mask.flatten(1).unsqueeze(-1)).sum(1)


class ClassToken(torch.nn.Module):
    """Tokens and a mask one longer (a class token in front): lengths L and L + 1."""

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.cat([tokens.new_zeros(tokens.shape[0], 1, tokens.shape[2]), tokens], 1)
        return (x * mask.unsqueeze(-1)).sum(1)


def test_derived_dimensions_are_inferred_from_the_recorded_sizes():
    sizes = {"height": [28, 42, 56], "patches": [2, 3, 4], "mask": [3, 4, 5], "length": [4, 8, None], "free": [3, 9]}
    derived = derive_dims(sizes, {"height", "mask", "length"})
    assert derived == {"height": ("patches", 14, 0), "mask": ("patches", 1, 1), "length": (None, 4, 0)}
    assert derive_dims(sizes, set()) == {}  # only the names torch.export found constraints on


CASES = {
    "patch_mask": (PatchMask, [(torch.randn(1, 3, h, w), torch.ones(1, h // 14, w // 14)) for h, w in SIDES[:3]]),
    "class_token": (ClassToken, [(torch.randn(2, n, 4), torch.ones(2, n + 1)) for n in (3, 5, 8)]),
    "patch_grid": (PatchGrid, [(torch.randn(1, 3, *side),) for side in SIDES]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_named_dimensions_tied_by_the_model_become_derived_dimensions(case, tmp_path):
    torch.manual_seed(0)
    build, calls = CASES[case]
    model = build().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(calls)):
        for args in calls:
            model(*args)
    observer.save(tmp_path / "m.iobundle")
    bundle = load_bundle(tmp_path / "m.iobundle")
    # Without derived dimensions: "Constraints violated (height, width)!" (a mask's side is the image's // 14).
    result = bundle.export_programs(model, dim_names=True)
    assert any(o.startswith("derived dimensions inferred") for p in result.programs for o in p.report.options)
    rows = bundle.check_discrepancies(result.to_onnx(tmp_path / "m.onnx"))
    assert [r["SUCCESS"] for r in rows] == [True] * len(calls)


def test_an_arithmetic_size_rule_is_data_walked_never_run(tmp_path):
    padded = SizeCondition(of=[("x", 2), ("x", 3)], op="==", value=0, expr="(8 + -1 * (s0 % 8)) % 8 + s1 % 8")
    assert padded.describe() == "(8 + -1 * (axis 2 of x % 8)) % 8 + axis 3 of x % 8 == 0"
    sizes = {2: 16, 3: 24}
    assert conditions_met([padded], lambda name, axis, item: sizes[axis])
    sizes[3] = 13
    assert not conditions_met([padded], lambda name, axis, item: sizes[axis])
    # A division by 0, or a size the rule does not list, meets no rule.
    for expr in ("s0 // (s0 - 16)", "s1"):
        assert not conditions_met([SizeCondition(of=[("x", 2)], op=">=", value=0, expr=expr)], lambda *_: 16)
    index = {
        "format": "iobundle.programs",
        "programs": [{"name": "p0", "file": "m.onnx", "calls": [0], "traced_call": 0}],
    }
    for bad in (
        "__import__('os').getcwd()",
        "s0 ** 2",
        "max(s0, 2)",
        "s0 if s0 else 1",
        "1.5 * s0",
        "True + s0",
        "x0",
        "*".join(["9" * 30] * 20),
    ):
        rule = {"of": [["x", 2]], "op": "==", "value": 0, "expr": bad}
        index["programs"][0].update(inputs={"x": "present"}, sizes=[rule])
        (tmp_path / "m.programs.json").write_text(json.dumps(index))
        with pytest.raises(ManifestError, match="expr"):
            load_program_index(tmp_path / "m.programs.json")
