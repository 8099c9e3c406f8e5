"""Export from bundles: torch.export checked on every call, ONNX checked with onnxruntime, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch

from iobundle import ExportError, InputObserver, load_bundle

MODELS = textwrap.dedent(
    '''
    import torch

    class NestedDict(torch.nn.Module):
        """Nested dict inputs, keywords in any order, an int constant, dict outputs."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 4)

        def forward(self, x, d=None, scale=1, bias=None):
            h = self.lin(x) * scale
            if d is not None:
                h = h + d["w"]["a"].sum() - d["v"][0].mean()
            if bias is not None:
                h = h + bias
            return {"h": h, "stats": {"sum": h.sum(-1), "x2": x * 2}}

    class Wrong(NestedDict):
        def forward(self, x, d=None, scale=1, bias=None):
            out = super().forward(x, d=d, scale=scale, bias=bias)
            out["h"] = out["h"] + 1.0
            return out

    def nested():
        return NestedDict().eval()

    def wrong():
        return Wrong().eval()
    '''
)


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    """A module of models that the test process imports but the replay subprocess also finds via PYTHONPATH."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(src))
    import importlib

    import toy_models

    importlib.reload(toy_models)
    return toy_models, src


def _capture(model, bundle: Path) -> InputObserver:
    observer = InputObserver()
    g = torch.Generator().manual_seed(0)
    with observer(model, store_n_calls=4):
        model(
            torch.randn(2, 3, generator=g), scale=3, d={"w": {"a": torch.ones(2)}, "v": [torch.randn(5, generator=g)]}
        )
        # keywords in another order than the signature
        model(
            d={"v": [torch.randn(5, generator=g)], "w": {"a": torch.ones(4)}}, scale=3, x=torch.randn(4, 3, generator=g)
        )
        model(
            torch.randn(6, 3, generator=g),
            bias=torch.randn(4, generator=g),
            scale=3,
            d={"w": {"a": torch.ones(3)}, "v": [torch.randn(5, generator=g)]},
        )
    observer.save(bundle)
    return observer


REPLAY = textwrap.dedent(
    """
    import json, sys
    import iobundle
    from iobundle import load_bundle
    import toy_models
    assert "toy_models" not in sys.modules or True
    bundle = load_bundle(sys.argv[1])
    model = toy_models.nested()
    ep = bundle.export(model)
    path = bundle.to_onnx(model, sys.argv[2])
    rows = bundle.check_discrepancies(path, include_io=False)
    report = ep.report
    json.dump({"rows": rows, "export_checks": [c.success for c in report.calls],
               "captured_here": hasattr(bundle, "_observer")}, open(sys.argv[3], "w"))
    """
)


def test_export_and_validate_in_fresh_process(tmp_path, model_module):
    toy_models, src = model_module
    bundle = tmp_path / "run.iobundle"
    _capture(toy_models.nested(), bundle)
    out = tmp_path / "result.json"
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(script), str(bundle), str(tmp_path / "m.onnx"), str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["export_checks"] == [True, True, True]
    assert [r["SUCCESS"] for r in result["rows"]] == [True, True, True]
    assert [r["index"] for r in result["rows"]] == [0, 1, 2]
    # the third call has `bias`, the others had it absent (None slots filled with zeros)
    assert [r["n_none"] for r in result["rows"]] == [1, 1, 0]
    assert all(r["abs"] <= 1e-5 for r in result["rows"])


def test_onnx_inputs_mapped_through_the_program_signature(tmp_path, model_module):
    toy_models, _ = model_module
    bundle = tmp_path / "run.iobundle"
    _capture(toy_models.nested(), bundle)
    b = load_bundle(bundle)
    path = b.to_onnx(toy_models.nested(), tmp_path / "m.onnx")
    proto = onnx.load(path)
    meta = {p.key: p.value for p in proto.metadata_props}
    slots = json.loads(meta["iobundle.input_slots"])
    graph_inputs = [i.name for i in proto.graph.input]
    # x, d.w.a, d.v.0, bias: the int constant `scale` is not a graph input
    assert len(graph_inputs) == 4
    assert sorted(slots.values()) == [0, 1, 2, 3]
    assert set(graph_inputs) == set(slots)
    # dict outputs lose their keys in ONNX: three tensors, in the recorded order
    assert len(json.loads(meta["iobundle.output_names"])) == 3


def test_weights_over_the_threshold_take_the_external_data_path_and_validate(tmp_path, model_module, monkeypatch):
    # The threshold (256 MiB) lowered to one byte: a tiny model takes the path of a large one.
    from iobundle.replay import export_onnx

    toy_models, _ = model_module
    bundle = tmp_path / "run.iobundle"
    _capture(toy_models.nested(), bundle)
    b = load_bundle(bundle)
    small = b.to_onnx(toy_models.nested(), tmp_path / "small" / "m.onnx")
    assert sorted(p.name for p in Path(small).parent.iterdir()) == ["m.onnx"]  # inline below the threshold
    monkeypatch.setattr(sys.modules[export_onnx.__module__], "EXTERNAL_DATA_BYTES", 1)
    path = b.to_onnx(toy_models.nested(), tmp_path / "large" / "m.onnx")
    assert sorted(p.name for p in Path(path).parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    # (onnxscript keeps tensors of a few bytes inline even then: these tiny weights stay in m.onnx)
    assert b.validate(path).ok


def test_wrong_model_fails_the_export_check_with_a_report(tmp_path, model_module):
    toy_models, _ = model_module
    bundle = tmp_path / "run.iobundle"
    _capture(toy_models.nested(), bundle)
    b = load_bundle(bundle)
    with pytest.raises(ExportError, match="does not reproduce") as info:
        b.export(toy_models.wrong())
    report = info.value.report
    # calls 0 and 1 had no `bias`: they are fed zeros the model never saw, so a difference there
    # is reported as "not checked" (D7), while call 2 is a plain numeric mismatch
    assert [c.absent_inputs for c in report.calls] == [["bias"], ["bias"], []]
    assert [c.success for c in report.calls] == [None, None, False]
    assert [c.index for c in report.failures] == [2]
    assert all(c.abs == pytest.approx(1.0, abs=1e-5) for c in report.calls)
    ep = b.export(toy_models.wrong(), check=False)
    assert ep.report.failures


def test_to_onnx_takes_the_tolerance_keywords_of_the_check(tmp_path, model_module):
    from iobundle.errors import ToleranceError
    from iobundle.replay import Tolerances

    toy_models, _ = model_module
    _capture(toy_models.nested(), tmp_path / "run.iobundle")
    b = load_bundle(tmp_path / "run.iobundle")
    wrong = toy_models.wrong()  # h off by 1, so stats.sum by 4 (h has 4 columns); stats.x2 exact
    with pytest.raises(ExportError, match="does not reproduce"):
        b.to_onnx(wrong, tmp_path / "default.onnx")
    with pytest.raises(ToleranceError, match="'nope'"):  # refused before anything is traced
        b.to_onnx(wrong, tmp_path / "unknown.onnx", output_atol={"nope": 1.0})
    per_output = b.to_onnx(wrong, tmp_path / "per_output.onnx", output_atol={"h": 1.5, "stats.sum": 4.5})
    assert Path(per_output).is_file() and b.export_report().ok
    assert b.to_onnx(wrong, tmp_path / "old.onnx", atol=4.5, rtol=0.0)  # the keywords of before still work
    with pytest.raises(ExportError):  # a given Tolerances wins over the keywords
        b.to_onnx(wrong, tmp_path / "given.onnx", atol=4.5, tolerances=Tolerances(atol=1e-4))


def test_observer_exports_in_memory_like_the_bundle(tmp_path, model_module):
    toy_models, _ = model_module
    observer = _capture(toy_models.nested(), tmp_path / "b")
    ep = observer.export(toy_models.nested())
    assert all(c.success for c in ep.report.calls)
    # the result is ours: nothing is hung on torch's program, and the recorded calls keep no report
    assert [name for name in vars(ep.program) if name.startswith("iobundle")] == []
    assert not hasattr(observer._recorded(), "last_export_report") and observer.export_report() is ep.report
    path = observer.to_onnx(toy_models.nested(), tmp_path / "m.onnx")
    assert [r["SUCCESS"] for r in observer.check_discrepancies(path)] == [True, True, True]


def test_export_reports_progress_of_each_stage(tmp_path):
    class Small(torch.nn.Module):
        def forward(self, x):
            return x * 2

    model, observer = Small(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(4, 3))
    events = []
    observer.to_onnx(model, tmp_path / "m.onnx", on_progress=events.append)
    stages = [(e.task, e.done, e.total) for e in events]
    assert stages == [
        ("torch.export", 0, 1),
        ("torch.export", 1, 1),
        ("check exported program", 0, 2),
        ("check exported program", 1, 2),
        ("check exported program", 2, 2),
        ("torch.onnx.export", 0, 1),
        ("torch.onnx.export", 1, 1),
    ]
