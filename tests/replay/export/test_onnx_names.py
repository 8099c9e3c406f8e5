"""ONNX outputs named after the recorded outputs, mapped in the metadata, matched by name on validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch

from iobundle import InputObserver, load_bundle

pytest.importorskip("onnxruntime")

NODE_NAME = re.compile(r"[a-z_]+_[0-9]+")  # what torch.onnx names a value: linear_14, cat_3, mul_2


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.lin(x)
        return {"h": h, "stats": {"sum": h.sum(-1), "x2": x * 2}}


class Awkward(torch.nn.Module):
    """Outputs ONNX cannot simply rename: one named like an input, an input, a weight, one tensor twice."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(3.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x * 2 + y
        return {"x": h, "same": h, "echo": y, "weight": self.w}


def _bundle(model: torch.nn.Module, calls: list[tuple[torch.Tensor, ...]], path: Path):
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(calls)):
        for args in calls:
            model(*args)
    observer.save(path)
    return load_bundle(path)


def _outputs(path: str | Path) -> tuple[list[str], dict[str, str]]:
    proto = onnx.load(str(path))
    return [o.name for o in proto.graph.output], {p.key: p.value for p in proto.metadata_props}


def _node_named_copy(path: str | Path, target: Path) -> Path:
    """The model as ``iobundle export`` wrote it before outputs were named: node names, no output mapping."""
    model = ir.load(str(path))
    names = []
    for i, value in enumerate(model.graph.outputs):
        value.name = f"linear_{40 + i}"
        names.append(value.name)
    model.metadata_props.pop("iobundle.output_paths")
    model.metadata_props["iobundle.output_names"] = json.dumps(names)
    ir.save(model, str(target))
    return target


def _reordered_copy(path: str | Path, target: Path) -> Path:
    """The model with its graph outputs in reverse order (a graph another tool rewrote): names still match."""
    model = ir.load(str(path))
    outputs = list(model.graph.outputs)
    model.graph.outputs.clear()
    model.graph.outputs.extend(reversed(outputs))
    model.metadata_props["iobundle.output_names"] = json.dumps([v.name for v in reversed(outputs)])
    ir.save(model, str(target))
    return target


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    tmp = tmp_path_factory.mktemp("nested")
    g = torch.Generator().manual_seed(0)
    bundle = _bundle(Nested().eval(), [(torch.randn(n, 3, generator=g),) for n in (2, 4, 5)], tmp / "run.iobundle")
    return bundle, bundle.to_onnx(Nested().eval(), tmp / "nested.onnx")


class TestPlainModel:
    def test_onnx_outputs_bear_the_recorded_names(self, nested: tuple[object, str]) -> None:
        bundle, path = nested
        names, _ = _outputs(path)
        assert names == ["h", "stats.sum", "stats.x2"]
        # the very names validation reports and per-output tolerances take
        report = bundle.validate(path, output_atol={"stats.sum": 1e-3})
        assert [c.name for c in report.outputs[:3]] == names
        assert all(c.other_name is None for c in report.outputs)
        assert report.ok

    def test_metadata_maps_each_output_to_its_recorded_name(self, nested: tuple[object, str]) -> None:
        _, path = nested
        names, meta = _outputs(path)
        assert json.loads(meta["iobundle.output_paths"]) == {n: n for n in names}
        assert json.loads(meta["iobundle.output_names"]) == names

    def test_validation_matches_outputs_by_name_not_position(self, nested: tuple[object, str], tmp_path: Path) -> None:
        bundle, path = nested
        reordered = _reordered_copy(path, tmp_path / "reordered.onnx")
        assert _outputs(reordered)[0] == ["stats.x2", "stats.sum", "h"]
        assert all(row["SUCCESS"] for row in bundle.check_discrepancies(reordered))
        assert [c.name for c in bundle.validate(reordered).outputs[:3]] == ["h", "stats.sum", "stats.x2"]

    def test_a_file_named_after_graph_nodes_still_validates_by_position(
        self, nested: tuple[object, str], tmp_path: Path
    ) -> None:
        bundle, path = nested
        old = _node_named_copy(path, tmp_path / "old.onnx")
        names, meta = _outputs(old)
        assert all(NODE_NAME.fullmatch(n) for n in names) and "iobundle.output_paths" not in meta
        report = bundle.validate(old)
        assert report.ok
        assert [(c.name, c.other_name) for c in report.outputs[:3]] == list(zip(["h", "stats.sum", "stats.x2"], names))

    def test_a_mapping_naming_no_graph_output_is_refused(self, nested: tuple[object, str], tmp_path: Path) -> None:
        from iobundle.errors import ModelLoadError

        bundle, path = nested
        model = ir.load(str(path))
        model.metadata_props["iobundle.output_paths"] = json.dumps({"logits": "h"})
        ir.save(model, str(tmp_path / "bad.onnx"))
        with pytest.raises(ModelLoadError, match=r"'iobundle.output_paths' names \['logits'\], which are not outputs"):
            bundle.validate(tmp_path / "bad.onnx")

    def test_a_recorded_output_the_model_lacks_fails_its_rows_naming_it(
        self, nested: tuple[object, str], tmp_path: Path
    ) -> None:
        bundle, path = nested
        model = ir.load(str(path))
        model.metadata_props["iobundle.output_paths"] = json.dumps({"h": "h", "stats.sum": "stats.sum"})
        ir.save(model, str(tmp_path / "partial.onnx"))
        rows = bundle.check_discrepancies(tmp_path / "partial.onnx")
        assert [r["SUCCESS"] for r in rows] == [False] * 3
        assert all("recorded outputs stats.x2 are not outputs of the model" in r["error"] for r in rows)


def test_outputs_onnx_cannot_rename_in_place_get_their_own_values(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)) for n in (2, 3)]
    bundle = _bundle(Awkward(), calls, tmp_path / "run.iobundle")
    path = bundle.to_onnx(Awkward(), tmp_path / "awkward.onnx")
    names, meta = _outputs(path)
    # `x` is the name of an input: the output gets a suffix, and the metadata says which output it is
    assert names == ["x.output", "same", "echo", "weight"]
    assert json.loads(meta["iobundle.output_paths"]) == {
        "x.output": "x", "same": "same", "echo": "echo", "weight": "weight",
    }  # fmt: skip
    proto = onnx.load(path)
    assert [i.name for i in proto.graph.input] == ["x", "y"]
    onnx.checker.check_model(proto, full_check=True)
    report = bundle.validate(path)
    assert report.ok and {c.name for c in report.outputs} == {"x", "same", "echo", "weight"}


@pytest.mark.slow
def test_llama_with_a_cache_names_its_onnx_outputs_after_the_recorded_ones(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from iobundle.demo._llama import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=3):
        model.generate(ids, max_new_tokens=3, do_sample=False)
    observer.save(tmp_path / "llama.iobundle")
    bundle = load_bundle(tmp_path / "llama.iobundle")
    path = bundle.to_onnx(model, tmp_path / "llama.onnx")

    names, meta = _outputs(path)
    report = bundle.validate(path)
    assert report.ok, report.verdict()
    recorded = list(dict.fromkeys(c.name for c in report.outputs))
    assert names == recorded and names[0] == "logits" and len(names) == 5  # logits, a key and a value per layer
    assert not any(NODE_NAME.fullmatch(n) for n in names)
    assert json.loads(meta["iobundle.output_paths"]) == {n: n for n in names}

    reordered = _reordered_copy(path, tmp_path / "reordered.onnx")
    assert bundle.validate(reordered).ok
    old = _node_named_copy(path, tmp_path / "old.onnx")
    assert bundle.validate(old).ok
