"""build_report: what a report shows, as plain data (environment, bundle, verdict, rows, worst outputs, histogram)."""

from __future__ import annotations

import json

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.replay import build_report, rerun_model


class Two(torch.nn.Module):
    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(x)
        return {"logits": y + self.shift, "hidden": y[:, :2]}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    model, observer = Two().eval(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    observer.save(tmp / "b")
    bundle = load_bundle(tmp / "b")
    return bundle, rerun_model(bundle._recorded(), Two(shift=1e-3).eval(), rtol=0.0)


def test_report_holds_environment_bundle_verdict_and_rows(result):
    bundle, run = result
    report = build_report(run, [bundle], command="iobundle run b --model m:f")
    assert report.kind == "run" and report.ok is False and report.verdict.startswith("FAIL: 0/2 calls")
    assert {"python", "platform", "iobundle", "torch", "numpy"} <= report.environment.keys()
    assert report.environment["torch"].split("+")[0] == torch.__version__.split("+")[0]
    (paragraph,) = report.paragraphs
    assert [kind for kind, _ in paragraph] == ["code", "text", "code", "text"]
    assert "holds 2 recorded calls of " in paragraph[1][1] and paragraph[2][1].endswith("Two.forward")
    assert "(2 ok)" in paragraph[3][1]
    assert [r["status"] for r in report.rows] == ["FAIL: mismatch", "FAIL: mismatch"]  # as the terminal says it
    assert report.columns[:2] == ["index", "status"]
    json.dumps(report.as_dict(), allow_nan=False)  # plain data


def test_worst_outputs_come_first_with_names_and_shapes(result):
    bundle, run = result
    report = build_report(run, [bundle], worst=3)
    assert len(report.worst) == 3
    assert [(w["output"], w["SUCCESS"]) for w in report.worst[:2]] == [("logits", False), ("logits", False)]
    assert {w["shape"] for w in report.worst[:2]} == {"2x6", "3x6"} and report.worst[0]["dtype"] == "float32"
    assert report.worst[2]["output"] == "hidden" and report.worst[2]["SUCCESS"] is True


def test_histogram_and_chart_series_cover_every_element(result):
    bundle, run = result
    report = build_report(run, [bundle])
    assert sum(count for _, count in report.histogram) == (2 + 3) * (6 + 2)
    assert [p["index"] for p in report.per_call] == [0, 1]
    assert {e["output"]: e["failed"] for e in report.per_output} == {"logits": 2, "hidden": 0}
