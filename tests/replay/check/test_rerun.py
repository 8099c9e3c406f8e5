"""rerun_model: the eager model again on every recorded call's inputs, compared with the recorded outputs."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, ReplayError, ToleranceError, load_bundle
from iobundle.replay import rerun_model


class InPlace(torch.nn.Module):
    """Changes its input in place (as a cache update does), and fails when asked to."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.offset = offset

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None, fail: bool = False) -> tuple:
        if fail:
            raise RuntimeError("asked to fail")
        x.mul_(2)
        y = self.lin(x) + self.offset
        return y, (y if cache is None else cache[0] + y.sum())


@pytest.fixture
def bundle(tmp_path):
    model, observer = InPlace().eval(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4), cache=[torch.ones(3, 3)])
    observer.save(tmp_path / "b")
    return load_bundle(tmp_path / "b")


def test_same_model_reproduces_every_call_exactly(bundle):
    report = rerun_model(bundle._recorded(), InPlace().eval())
    assert report.ok and report.kind == "run"
    assert [r["abs"] for r in report.rows] == [0.0, 0.0]
    assert [(c.call, c.name) for c in report.outputs] == [
        (0, "output[0]"),
        (0, "output[1]"),
        (1, "output[0]"),
        (1, "output[1]"),
    ]
    assert all(r["duration_rerun"] > 0 for r in report.rows)
    # the model doubled its inputs in place: the bundle's tensors are untouched, a second run agrees
    assert rerun_model(bundle._recorded(), InPlace().eval()).ok


def test_drift_is_reported_and_tolerated_per_output(bundle):
    report = rerun_model(bundle._recorded(), InPlace(offset=1e-3).eval(), rtol=0.0)
    assert not report.ok and report.n_failed == 2
    assert report.rows[0]["abs"] == pytest.approx(1e-3, rel=1e-3)
    tolerated = rerun_model(bundle._recorded(), InPlace(offset=1e-3).eval(), rtol=0.0, output_atol={"output*": 1e-2})
    assert tolerated.ok


def test_a_call_that_raises_is_a_failed_row(tmp_path):
    model, observer = InPlace().eval(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4), fail=False)
        model(torch.randn(2, 4), fail=False)
    observer.save(tmp_path / "b")

    class FailsOnBatch(InPlace):
        def forward(self, x, cache=None, fail=False):
            return super().forward(x, cache, fail=True)

    report = rerun_model(load_bundle(tmp_path / "b")._recorded(), FailsOnBatch().eval())
    assert [r["SUCCESS"] for r in report.rows] == [False, False]
    assert report.rows[0]["error"] == "RuntimeError: asked to fail"


def test_a_model_without_the_recorded_method_is_refused(bundle):
    with pytest.raises(ReplayError, match="no method 'forward'"):
        rerun_model(bundle._recorded(), object())  # type: ignore[arg-type]


def test_no_worst_output_when_every_output_matches_exactly(bundle):
    report = rerun_model(bundle._recorded(), InPlace().eval())
    assert [r["worst_output"] for r in report.rows] == ["", ""]


class Masked(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x * 2 if mask is None else x * mask + 1


def test_eager_calls_get_the_inputs_as_the_model_received_them(tmp_path):
    from iobundle.replay.infer import received_arguments

    model, observer = Masked(), InputObserver(value_if_missing={"mask": torch.ones(2, 4)})
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4), mask=torch.zeros(2, 4))
        model(torch.randn(2, 4))  # mask absent: the observer records a placeholder the model never saw
    observer.save(tmp_path / "b")
    rc = load_bundle(tmp_path / "b")._recorded()
    with_mask, without = rc.ok_calls
    assert without.filled and "mask" not in received_arguments(rc, without)[1]
    _, kwargs = received_arguments(rc, with_mask)
    assert torch.equal(kwargs["mask"], torch.zeros(2, 4))
    kwargs["mask"].add_(1)  # a fresh copy: the store is untouched
    assert torch.equal(received_arguments(rc, with_mask)[1]["mask"], torch.zeros(2, 4))
    assert rerun_model(rc, model, rtol=0.0, atol=0.0).ok  # run feeds None, as at capture


def test_export_check_of_a_redacted_bundle_calls_the_eager_model_as_run_does(tmp_path):
    """Without recorded outputs the export check's reference is the eager model on the inputs it received."""
    from iobundle.observer import redact_bundle

    model, observer = Masked(), InputObserver(value_if_missing={"mask": torch.ones(2, 4)})
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4), mask=torch.zeros(2, 4))
        model(torch.randn(2, 4))  # mask absent: the model computed x * 2, not x * placeholder + 1
    observer.save(tmp_path / "b")
    redact_bundle(tmp_path / "b", tmp_path / "r")
    bundle = load_bundle(tmp_path / "r")
    bundle.to_onnx(Masked(), tmp_path / "m.onnx")
    report = bundle.export_report()
    assert report is not None
    calls = [(c.success, c.reference, c.absent_inputs) for c in report.calls]
    # The program is fed the placeholder, the eager model was not: the call differs and is "not checked".
    assert calls == [(True, "eager", []), (None, "eager", ["mask"])]


def test_a_tolerance_naming_no_output_is_refused_before_the_model_runs(tmp_path):
    model, observer = Masked(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
    observer.save(tmp_path / "b")
    rc = load_bundle(tmp_path / "b")._recorded()
    seen: list[torch.Tensor] = []
    model.forward = lambda x, mask=None: seen.append(x) or Masked.forward(model, x, mask)  # counts the calls
    with pytest.raises(ToleranceError, match=r"'outptu' matches no output\. Outputs: output"):
        rerun_model(rc, model, output_atol={"outptu": 1.0})
    assert seen == []
    assert rerun_model(rc, model, output_atol={"output": 1.0}).ok and len(seen) == 1
