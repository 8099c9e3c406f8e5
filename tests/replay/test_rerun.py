"""rerun_model: the eager model again on every recorded call's inputs, compared with the recorded outputs."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, ReplayError, load_bundle
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
