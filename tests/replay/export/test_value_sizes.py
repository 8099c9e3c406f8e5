"""Sizes read from tensor values (``torch.split(x, lengths.tolist())``): one program per recorded value set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.errors import ManifestError
from iobundle.schema import load_program_index


class Segments(torch.nn.Module):
    """Sums of the segments of ``x`` that ``counts`` gives, empty ones dropped: how many is read from its values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = counts[counts > 0].tolist()
        return torch.stack([part.sum(0) for part in torch.split(self.lin(x), sizes)])


def segments_calls() -> list[tuple[torch.Tensor, ...]]:
    counts = [[2, 0, 3], [1, 1, 0], [2, 0, 3], [4, 1, 1]]
    return [(torch.randn(sum(c), 4), torch.tensor(c)) for c in counts]


class Runs(Segments):
    """Sums of the runs of ``x`` that ``counts`` gives, as many as it has values (none dropped)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return torch.stack([part.sum(0) for part in torch.split(self.lin(x), counts.tolist())])


def runs_calls() -> list[tuple[torch.Tensor, ...]]:
    """2 to 4 counts: the trace specialises their number ("Constraints violated", not a data-dependent guard)."""
    counts = [[2, 3], [1, 1, 4], [2, 3], [4, 1, 1, 2]]
    return [(torch.randn(sum(c), 4), torch.tensor(c)) for c in counts]


class Paired(Segments):
    """Sums of the pairs of rows of ``x`` within each segment ``counts`` gives: the bounds built from its values with
    ``torch.arange``, a mask and ``torch.unique_consecutive`` (data-dependent sizes unless those values are fixed)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(counts, 0)
        grid = torch.arange(int(ends[-1]) + 1)
        bounds = torch.unique_consecutive(grid[(grid % 2 == 0) | torch.isin(grid, ends)])
        return torch.stack([part.sum(0) for part in torch.split(self.lin(x), torch.diff(bounds).tolist())])


def qwen2_vl_vision() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    vision = transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=2, temporal_patch_size=1,
            spatial_merge_size=1, in_channels=1,
        )
    ).vision_config  # fmt: skip
    vision._attn_implementation = "sdpa"
    return modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(vision).eval()


def qwen2_vl_calls() -> list[tuple[torch.Tensor, ...]]:
    grids = [[[1, 2, 3], [1, 2, 2]], [[1, 3, 3], [1, 1, 2]], [[1, 2, 3], [1, 2, 2]], [[1, 4, 2], [1, 2, 5]]]
    return [(torch.randn(int(torch.tensor(g).prod(-1).sum()), 4), torch.tensor(g)) for g in grids]


CASES = {
    "segments": (Segments, segments_calls, "counts"),
    "runs": (Runs, runs_calls, "counts"),
    "paired": (Paired, segments_calls, "counts"),  # factories of the values' numbers: constants too
    "qwen2_vl_vision": (qwen2_vl_vision, qwen2_vl_calls, "grid_thw"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_input_whose_values_fix_sizes_gets_one_program_per_recorded_value_set(case, tmp_path):
    build, calls, carrier = CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    recorded = calls()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(recorded)):
        for args in recorded:
            model(*args)
    observer.save(tmp_path / "m.iobundle")
    bundle = load_bundle(tmp_path / "m.iobundle")
    # One program: "Could not guard on data-dependent expression" (torch.export); runs:
    # "Constraints violated (L['counts'].size()[0])".
    result = bundle.export_programs(model)
    assert [p.phase.calls for p in result.programs] == [(0, 2), (1,), (3,)]  # calls 0 and 2 hold the same values
    assert result.ok and f"sizes read from the values of {carrier}" in result.reason
    for program in result.programs:
        assert list(program.values) == [carrier]
        assert any(o.startswith(f"traced with the values of {carrier} fixed") for o in program.report.options)
    index = result.to_onnx(tmp_path / "m.onnx")
    entries = json.loads(Path(index).read_text())["programs"]
    assert entries[1]["values"] == {
        carrier: {"shape": list(recorded[1][1].shape), "data": recorded[1][1].flatten().tolist()}
    }
    rows = bundle.check_discrepancies(index)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p0", True), (1, "p1", True), (2, "p0", True), (3, "p2", True)
    ]  # fmt: skip
    # A call holding values no program was traced with is served by none, and says so.
    other = InputObserver()
    counts = recorded[3][1].clone()
    counts.view(-1)[-1] -= 1
    with torch.no_grad(), other(model):
        model(recorded[3][0][:-1] if case in ("segments", "runs", "paired") else recorded[3][0][:-2], counts)
    rows = other.check_discrepancies(index)
    assert rows[0]["SUCCESS"] is False and "serves call 0" in rows[0]["error"]
    assert f"{carrier} holding" in rows[0]["error"]


def _index(tmp_path, version: int = 2, **program):
    entry = {"name": "p0", "file": "m.onnx", "calls": [0], "traced_call": 0, "inputs": {"x": "present"}, **program}
    path = tmp_path / "m.programs.json"
    path.write_text(json.dumps({"format": "iobundle.programs", "format_version": version, "programs": [entry]}))
    return path


def test_an_index_refuses_malformed_values_and_division_naming_the_field(tmp_path):
    values = {"lengths": {"shape": [2], "data": [3, 4]}}
    assert load_program_index(_index(tmp_path, values=values)).programs[0].values["lengths"].data == [3, 4]
    with pytest.raises(ManifestError, match=r"programs\[0\]\.values\['lengths'\]: shape \[3\] does not hold 2"):
        load_program_index(_index(tmp_path, values={"lengths": {"shape": [3], "data": [3, 4]}}))
    with pytest.raises(ManifestError, match="format_version 1 index has no size rules"):
        load_program_index(_index(tmp_path, version=1, values=values))
    rule = {"of": [["x", 2], ["x", 3]], "op": "==", "value": 4, "div": [14]}
    with pytest.raises(ManifestError, match=r"programs\[0\]\.sizes\[0\]\.div: \[14\] must hold one divisor"):
        load_program_index(_index(tmp_path, sizes=[rule]))
    with pytest.raises(ManifestError, match=r"div: \[14, 0\] must hold one divisor of 1 or more"):
        load_program_index(_index(tmp_path, sizes=[{**rule, "div": [14, 0]}]))
