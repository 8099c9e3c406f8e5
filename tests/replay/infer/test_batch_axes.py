"""The batch axis of each input is found from the sizes of the calls (set_batch_dimension_for, --batch-all)."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver

DYN = torch.export.Dim.DYNAMIC


class Rotary3D(torch.nn.Module):
    """A text model with 3-D rotary positions: ``position_ids`` is ``(3, batch, length)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) + position_ids.float().mean(0)[..., None]
        return self.proj(h) + extra.sum()


def observe(calls: list[tuple[int, int, tuple[int, ...]]]) -> InputObserver:
    """Record ``Rotary3D`` on calls of (batch, length, shape of ``extra``)."""
    model = Rotary3D().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for batch, length, extra in calls:
            ids = torch.randint(0, 10, (batch, length))
            positions = torch.arange(length).expand(3, batch, length)
            model(input_ids=ids, position_ids=positions, extra=torch.ones(extra))
    return observer


def axes(observer: InputObserver, spec: object = True) -> dict[str, int | None]:
    return {a.label: a.axis for a in observer.infer_batch_axes(spec)}


def test_batch_on_axis_1_is_found_and_made_dynamic():
    observer = observe([(2, 5, (7,)), (2, 1, (7,))])
    assert axes(observer) == {"input_ids": 0, "position_ids": 1, "extra": None}
    shapes = observer.infer_dynamic_shapes(set_batch_dimension_for=True)
    assert shapes == {"input_ids": {0: DYN, 1: DYN}, "position_ids": {1: DYN, 2: DYN}, "extra": {}}
    reasons = {a.label: a.reason for a in observer.infer_batch_axes()}
    assert reasons["position_ids"] == "the only axis of the batch's size in every call"
    assert reasons["extra"] == "no batch axis: no axis has the batch's size in every call"


def test_an_input_without_a_batch_axis_is_left_alone():
    observer = observe([(2, 5, (4, 3)), (2, 1, (4, 3))])
    assert axes(observer)["extra"] is None
    assert observer.infer_dynamic_shapes(set_batch_dimension_for=True)["extra"] == {}


def test_a_size_equal_to_the_batch_in_one_call_only_is_a_coincidence():
    # Call 0: batch 3 equals the 3 rotary sections (axis 0 of position_ids) and extra's axis 0;
    # call 1: batch 2, only axis 1 of position_ids follows it.
    observer = observe([(3, 5, (3,)), (2, 1, (3,))])
    found = {a.label: a for a in observer.infer_batch_axes()}
    assert found["position_ids"].axis == 1
    assert found["position_ids"].reason == (
        "the only axis of the batch's size in every call; axis 0 equal the batch in some calls only"
    )
    assert found["extra"].axis is None
    assert observer.infer_dynamic_shapes(set_batch_dimension_for=True)["position_ids"] == {1: DYN, 2: DYN}


def test_several_axes_of_the_batch_size_take_the_layouts_batch():
    # batch 3 in every call: axes 0 and 1 of position_ids both qualify; its layout says axis 1.
    observer = observe([(3, 5, (3, 3)), (3, 1, (3, 3))])
    found = {a.label: a for a in observer.infer_batch_axes()}
    assert found["position_ids"].axis == 1
    assert "axis 1 is the batch in the layout of position_ids" in found["position_ids"].reason
    # extra has no known layout: the first axis of the batch's size is taken
    assert found["extra"].axis == 0
    assert found["extra"].reason == "axes 0, 1 have the batch's size in every call; the first is taken"


def test_an_input_named_explicitly_keeps_axis_0_when_no_axis_qualifies():
    observer = observe([(2, 5, (4,)), (2, 1, (4,))])
    found = observer.infer_batch_axes({"extra"})
    assert [(a.label, a.axis) for a in found] == [("extra", 0)]
    assert found[0].reason.startswith("named in set_batch_dimension_for; axis 0 taken")
    assert observer.infer_dynamic_shapes(set_batch_dimension_for={"extra"})["extra"] == {0: DYN}


def test_export_with_batch_on_axis_1_checks_another_batch():
    observer = observe([(2, 5, (7,)), (2, 1, (7,))])
    observer.export(Rotary3D().eval(), set_batch_dimension_for=True)
    report = observer.export_report()
    assert report is not None and report.ok
    check = report.batch_check
    assert (check.recorded_batch, check.batch, check.success) == (2, 1, True), check.summary()


def test_a_qwen2_vl_text_decoder_has_its_batch_on_axis_1_of_position_ids():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2VLConfig(
        text_config={
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "vocab_size": 100, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "patch_size": 2,
                       "spatial_merge_size": 1, "temporal_patch_size": 1},
        image_token_id=97, video_token_id=98, vision_start_token_id=96,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    observer = InputObserver()
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad(), observer(model):
        model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    found = {a.name: a.axis for a in observer.infer_batch_axes()}
    assert found["position_ids"] == 1  # (4, batch, length): text positions and 3 rotary sections
    assert found["input_ids"] == 0 and found["cache"] == 0
    shapes = observer.infer_dynamic_shapes(set_batch_dimension_for=True)
    assert 0 not in shapes["position_ids"] and 1 in shapes["position_ids"]


def test_the_static_batch_hint_names_the_batch_axis_of_each_input():
    observer = observe([(2, 5, (7,)), (2, 1, (7,))])
    hints = [h for h in observer.static_dim_hints() if h.kind == "batch"]
    assert [(h.size, h.axes) for h in hints] == [(2, (("input_ids", 0), ("position_ids", 1)))]
    assert observer.static_dim_hints(True) == []


def test_an_input_whose_rank_changes_gets_no_batch_axis_and_the_shapes_say_why():
    # extra is (2,) then (2, 2): no batch axis is guessed; the shape inference refuses the change of rank.
    from iobundle import DynamicShapeError

    observer = observe([(2, 5, (2,)), (2, 1, (2, 2))])
    found = {a.label: a for a in observer.infer_batch_axes()}
    assert (found["extra"].axis, found["extra"].reason) == (None, "no batch axis: its rank changes across calls")
    with pytest.raises(DynamicShapeError, match="different ranks across calls"):
        observer.infer_dynamic_shapes(set_batch_dimension_for=True)
