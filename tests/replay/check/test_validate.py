"""check_discrepancies / validate_onnx: onnxruntime on every recorded call, rows ready for pandas."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime
import pandas
import pytest
import torch

from iobundle import InputObserver, ToleranceError, load_bundle
from iobundle.replay import validate_onnx


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y if mask is None else y * mask


class Flaky(Affine):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 3:
            raise RuntimeError("this call fails")
        return super().forward(x, mask)


@pytest.fixture(scope="module")
def affine_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affine")
    model = Affine().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(5, 4))
    observer.save(tmp / "b")
    path = load_bundle(tmp / "b").to_onnx(model, tmp / "affine.onnx")
    return tmp / "b", path


def test_rows_have_every_documented_column_and_load_in_pandas(affine_bundle):
    bundle, path = affine_bundle
    rows = load_bundle(bundle).check_discrepancies(path, hist=(0.1, 0.01, 1e-6))
    frame = pandas.DataFrame(rows)
    expected = {"abs", "rel", "sum", "n", "dnan", ">0.1", ">0.01", ">1e-06", "SUCCESS", "index", "duration_torch"}
    expected |= {"ort_duration", "n_inputs", "n_none", "n_empty", "inputs", "outputs", "absent_inputs"}
    assert expected <= set(frame.columns)
    assert frame["SUCCESS"].tolist() == [True, True]
    assert frame["n"].tolist() == [6, 15]
    assert frame["inputs"].tolist() == ["2x4:float32", "5x4:float32"]


def test_bit_exact_result_is_a_success_D1(tmp_path):
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x + 0

    observer = InputObserver()
    model = Identity()
    with observer(model):
        model(torch.arange(6.0).reshape(2, 3))
        model(torch.arange(9.0).reshape(3, 3))
    path = observer.to_onnx(model, tmp_path / "id.onnx")
    rows = observer.check_discrepancies(path)
    assert [r["abs"] for r in rows] == [0.0, 0.0]
    assert all(isinstance(r["abs"], float) for r in rows)
    assert [r["SUCCESS"] for r in rows] == [True, True]


def test_failed_call_is_never_paired_with_another_calls_outputs_D3(tmp_path):
    model = Flaky().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=4):
        model(torch.randn(2, 4))
        with pytest.raises(RuntimeError, match="this call fails"):
            model(torch.randn(3, 4))
        model(torch.randn(5, 4))
    observer.save(tmp_path / "b")
    bundle = load_bundle(tmp_path / "b")
    assert [c.status for c in bundle.calls] == ["ok", "failed", "ok"]
    assert bundle.calls[1].outputs is None and "this call fails" in bundle.calls[1].error
    path = bundle.to_onnx(Affine().eval(), tmp_path / "m.onnx")
    rows = bundle.check_discrepancies(path)
    assert [r["index"] for r in rows] == [0, 2]
    assert [r["inputs"] for r in rows] == ["2x4:float32", "5x4:float32"]
    assert [r["outputs"] for r in rows] == ["2x3:float32", "5x3:float32"]
    assert [r["SUCCESS"] for r in rows] == [True, True]


def test_absent_input_fed_a_stand_in_is_not_a_numeric_mismatch_D7(tmp_path):
    model = Affine().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))  # no mask: the export feeds zeros, which the model never saw
        model(torch.randn(2, 4), mask=torch.full((2, 3), 2.0))
    path = observer.to_onnx(model, tmp_path / "m.onnx", check=False)
    rows = observer.check_discrepancies(path)
    assert rows[0]["absent_inputs"] == "mask"
    assert rows[0]["n_none"] == 1
    assert rows[0]["SUCCESS"] is None  # differs, but only because of the stand-in
    assert rows[0]["abs"] > 0
    assert rows[1]["absent_inputs"] == "" and rows[1]["SUCCESS"] is True
    report = validate_onnx(observer._recorded(), path)
    assert report.ok and report.n_failed == 0


def test_works_with_the_pinned_onnxruntime_D11(affine_bundle):
    bundle, path = affine_bundle
    assert onnxruntime.__version__.startswith("1.32")
    report = validate_onnx(load_bundle(bundle)._recorded(), onnx.load(path))
    assert report.ok and "PASS: 2/2" in report.verdict()


def test_wrong_onnx_model_is_reported_per_call(affine_bundle, tmp_path):
    bundle, path = affine_bundle
    proto = onnx.load(path)
    for init in proto.graph.initializer:
        if len(init.dims) == 1:  # the bias: shift it
            arr = onnx.numpy_helper.to_array(init) + 1.0
            init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    rows = load_bundle(bundle).check_discrepancies(proto)
    assert [r["SUCCESS"] for r in rows] == [False, False]
    assert all(r["abs"] == pytest.approx(1.0, abs=1e-5) for r in rows)
    assert all(r[">0.1"] == r["n"] for r in rows)


# --------------------------------------------------------------------------- per output, statistics, progress


class TwoHeads(torch.nn.Module):
    """Two named outputs; ``shift`` moves the logits only."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.lin(x)
        return {"logits": hidden * 2 + self.shift, "hidden": hidden}


@pytest.fixture(scope="module")
def shifted(tmp_path_factory):
    """A bundle of TwoHeads() and an ONNX model of TwoHeads(shift=1e-3): only ``logits`` is off, by 1e-3."""
    tmp = tmp_path_factory.mktemp("two-heads")
    model = TwoHeads().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for n in (2, 3, 5):
            model(torch.randn(n, 4))
    observer.save(tmp / "b")
    bundle = load_bundle(tmp / "b")
    path = bundle.to_onnx(TwoHeads(shift=1e-3).eval(), tmp / "shifted.onnx", check=False)
    return bundle, path


def test_every_output_is_checked_with_its_name_shape_and_dtype(shifted):
    bundle, path = shifted
    report = validate_onnx(bundle._recorded(), path, rtol=0.0)
    assert not report.ok and report.n_failed == 3
    assert [(c.call, c.name, c.shape, c.dtype) for c in report.outputs[:2]] == [
        (0, "logits", (2, 3), "float32"),
        (0, "hidden", (2, 3), "float32"),
    ]
    by_name = {c.name: c for c in report.outputs if c.call == 2}
    assert by_name["logits"].success is False and by_name["logits"].stats.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert by_name["hidden"].success is True and by_name["hidden"].stats.max_abs < 1e-5
    assert all(r["worst_output"] == "logits" for r in report.rows)
    assert sum(count for _, count in report.histogram()) == sum(c.stats.n for c in report.outputs)


def test_per_output_tolerance_lets_one_output_differ(shifted):
    bundle, path = shifted
    report = validate_onnx(bundle._recorded(), path, rtol=0.0, output_atol={"logits": 1e-2})
    assert report.ok, report.rows
    assert {c.name: c.atol for c in report.outputs if c.call == 0} == {"logits": 1e-2, "hidden": 1e-4}
    assert "(logits: atol=0.01)" in report.verdict()
    # a pattern works too, and so does the API of check_discrepancies
    rows = bundle.check_discrepancies(path, rtol=0.0, output_atol={"log*": 1e-2})
    assert [r["SUCCESS"] for r in rows] == [True, True, True]


def test_per_output_tolerance_naming_no_output_is_refused(shifted):
    bundle, path = shifted
    with pytest.raises(ToleranceError, match=r"'logit' matches no output\. Outputs: logits, .*hidden"):
        validate_onnx(bundle._recorded(), path, output_atol={"logit": 1e-2})


def test_check_error_stat_median_with_a_loose_atol(shifted):
    bundle, path = shifted
    strict = validate_onnx(bundle._recorded(), path, atol=5e-4, rtol=0.0)
    median = validate_onnx(bundle._recorded(), path, atol=5e-4, rtol=0.0, check_error_stat="median")
    assert not strict.ok  # logits are off by 1e-3 everywhere: the median too
    assert not median.ok and "on the median error" in median.verdict()
    loose = validate_onnx(
        bundle._recorded(), path, atol=2e-3, rtol=0.0, check_error_stat="quantile", error_quantile=0.5
    )
    assert loose.ok and "0.5 quantile" in loose.verdict()


def test_on_progress_reports_each_call(shifted):
    bundle, path = shifted
    events = []
    validate_onnx(bundle._recorded(), path, on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("validate", i, 3) for i in range(4)]
    assert events[-1].detail == "call 2"


def test_check_discrepancies_keeps_its_positional_api_and_columns(affine_bundle):
    bundle, path = affine_bundle
    rows = load_bundle(bundle).check_discrepancies(path, 1e-4, 0.1, (0.1,), False, False)
    assert [r["SUCCESS"] for r in rows] == [True, True]
    assert "worst_output" not in rows[0] and "inputs" not in rows[0] and ">0.1" in rows[0]
    report = validate_onnx(load_bundle(bundle)._recorded(), path, atol=1e-4, rtol=0.1)
    assert (report.atol, report.rtol, report.ok) == (1e-4, 0.1, True)


def test_bundle_validate_and_rerun_methods(shifted):
    bundle, path = shifted
    report = bundle.validate(path, rtol=0.0, output_atol={"logits": 1e-2})
    assert report.ok and report.kind == "validate" and len(report.outputs) == 6
    drift = bundle.rerun(TwoHeads(shift=1e-3).eval(), rtol=0.0)
    assert drift.kind == "run" and not drift.ok
    assert {c.name for c in drift.outputs if c.success is False} == {"logits"}


def test_check_discrepancies_refuses_a_tolerance_naming_no_output_before_running(shifted):
    bundle, path = shifted
    events = []
    with pytest.raises(ToleranceError, match=r"'logit' matches no output. Outputs: logits, "):
        bundle.check_discrepancies(path, output_atol={"logit": 1e-2}, on_progress=events.append)
    assert events == []  # refused before the first call ran
    with pytest.raises(ToleranceError, match="'nope' matches no output"):
        validate_onnx(bundle._recorded(), path, output_rtol={"nope": 1.0}, on_progress=events.append)
    assert events == []
    assert len(bundle.check_discrepancies(path, output_atol={"log*": 1e-2})) == 3


# --------------------------------------------------------------------------- half precision


@pytest.fixture(scope="module")
def bf16_affine(tmp_path_factory):
    """A bfloat16 Affine recorded on two calls and exported: onnxruntime's CPU provider cannot load it."""
    tmp = tmp_path_factory.mktemp("bf16")
    model = Affine().to(torch.bfloat16).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4, dtype=torch.bfloat16))
        model(torch.randn(5, 4, dtype=torch.bfloat16))
    observer.save(tmp / "b")
    path = load_bundle(tmp / "b").to_onnx(model, tmp / "affine_bf16.onnx")
    return tmp / "b", path


def test_bfloat16_program_is_validated_through_its_float32_copy(bf16_affine):
    from iobundle.replay.check import float32_copy

    bundle, path = bf16_affine
    proto = onnx.load(path)
    with pytest.raises(Exception, match="Could not find an implementation"):
        onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    before = Path(path).read_bytes()
    report = load_bundle(bundle).validate(path)
    assert report.ok and report.ran == "bfloat16 program validated through a float32 copy"
    assert report.verdict().endswith("; bfloat16 program validated through a float32 copy")
    assert [c.dtype for c in report.outputs] == ["bfloat16", "bfloat16"]
    assert all((c.atol, c.rtol) == (2e-2, 0.1) for c in report.outputs)  # the dtype's row of the table
    assert [r["ran"] for r in report.rows] == [report.ran] * 2
    assert Path(path).read_bytes() == before  # the program on disk is the one the user deploys
    copy, widened = float32_copy(proto)
    assert widened == ["bfloat16"] and not any(t.data_type == onnx.TensorProto.BFLOAT16 for t in copy.graph.initializer)
    assert any(t.data_type == onnx.TensorProto.BFLOAT16 for t in proto.graph.initializer)  # the original is untouched


def test_a_changed_bfloat16_model_fails_through_the_float32_copy(bf16_affine, tmp_path):
    bundle, _ = bf16_affine
    model = Affine()
    with torch.no_grad():
        model.lin.weight.add_(0.5)
    model = model.to(torch.bfloat16).eval()
    path = load_bundle(bundle).to_onnx(model, tmp_path / "changed.onnx", check=False)
    report = load_bundle(bundle).validate(path)
    assert not report.ok and report.n_failed == 2 and report.ran


class Alternating(torch.nn.Module):
    """Float32 outputs of about 1e-2; ``drift`` is added to the outputs of the calls made without autocast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.lin.weight.mul_(0.03)
            self.lin.bias.zero_()
        self.drift = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).float()
        return y if torch.is_autocast_enabled("cpu") else y + self.drift


def _alternating(path: Path, drift: float) -> tuple[Alternating, Path]:
    """Four calls alternating CPU autocast (bfloat16) on and off; the plain calls drift by ``drift``."""
    model, observer = Alternating().eval(), InputObserver()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), observer(model, store_n_calls=4):
        for i, n in enumerate((2, 3, 4, 5)):
            model.drift = drift
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 0):
                model(torch.randn(n, 8, generator=g))
    model.drift = 0.0
    observer.save(path)
    return model, path


def test_calls_alternating_autocast_take_each_their_own_tolerances(tmp_path):
    """A plain call keeps float32's tolerances in a bundle that mixes autocast and plain calls, in validate and export.

    The plain calls are recorded 3e-3 off the model: within bfloat16's tolerances (atol 2e-2), out of float32's.
    """
    model, path = _alternating(tmp_path / "same.iobundle", drift=0.0)
    bundle = load_bundle(path)
    assert [c.autocast is not None for c in bundle.calls] == [True, False, True, False]
    onnx_path = bundle.to_onnx(model, tmp_path / "m.onnx", set_batch_dimension_for=True)
    report = bundle.validate(onnx_path)
    assert report.ok, report.verdict()
    assert [(c.call, c.atol) for c in report.outputs] == [(0, 2e-2), (1, 1e-4), (2, 2e-2), (3, 1e-4)]
    assert report.criterion() == (
        "atol=0.0001 rtol=0.1 (calls 0, 2 recorded under torch.autocast(bfloat16): their float32 outputs take its "
        "row (atol=0.02 rtol=0.1), the calls recorded without float32's)"
    )

    model, path = _alternating(tmp_path / "drift.iobundle", drift=3e-3)
    drifted = load_bundle(path)
    rows = drifted.check_discrepancies(onnx_path)
    assert [r["SUCCESS"] for r in rows] == [True, False, True, False]
    ep = drifted.export(model, set_batch_dimension_for=True, check=False)
    assert [c.success for c in ep.report.calls] == [True, False, True, False]
