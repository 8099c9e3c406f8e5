"""Ops that depend only on constants and weights are folded before the ONNX conversion; one that depends on the
inputs and has no translation is named with its module."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.errors import ExportError


class SparseGate(torch.nn.Module):
    """Keeps the activations beyond the 95% quantile of a standard normal (``Normal(0, 1).icdf``: ``erfinv``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        threshold = torch.distributions.Normal(0, 1).icdf(torch.tensor(0.95))
        return h * (h.abs() > threshold * h.std(-1, keepdim=True))


class BetaPrior(torch.nn.Module):
    """A log-normaliser of Beta distributions from its weights (``lgamma``) and a buffer's normal quantile (``ndtri``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_a = torch.nn.Parameter(torch.rand(6))
        self.log_b = torch.nn.Parameter(torch.rand(6))
        self.register_buffer("level", torch.tensor([0.9]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.log_a.exp(), self.log_b.exp()
        log_norm = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
        return x * log_norm + torch.special.ndtri(self.level)


class Smoothing(torch.nn.Module):
    """A moving average weighted by a Bartlett window made at each call from numbers alone (no input node)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taps = torch.bartlett_window(5, periodic=False)
        return torch.nn.functional.conv1d(x.unsqueeze(1), (taps / taps.sum()).view(1, 1, 5), padding=2).squeeze(1)


class Gate(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.special.erfinv(torch.tanh(h) * 0.9)


class Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


def record(model: torch.nn.Module, tmp_path):
    torch.manual_seed(0)
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for rows in (2, 3, 5):
            model(torch.randn(rows, 6))
    observer.save(tmp_path / "m.iobundle")
    return load_bundle(tmp_path / "m.iobundle")


@pytest.mark.parametrize(
    "build, op",
    [(SparseGate, "aten.erfinv"), (BetaPrior, "aten.lgamma"), (Smoothing, "aten.bartlett_window")],
    ids=["normal_icdf", "beta_weights", "numbers_alone"],
)
def test_values_computed_from_constants_and_weights_alone_are_folded_before_onnx(build, op, tmp_path):
    torch.manual_seed(0)
    model = build().eval()
    bundle = record(model, tmp_path)
    result = bundle.export_programs(model)
    path = result.to_onnx(tmp_path / "m.onnx")  # without the folding: "No ONNX function found for prims.*"
    assert any("folded" in o and op in o for o in result.report.options)
    rows = bundle.check_discrepancies(path)
    assert [r["SUCCESS"] for r in rows] == [True, True, True]
    assert max(r["abs"] for r in rows) < 1e-5
    # The exported program still computes what the model does on inputs no call had.
    x = torch.randn(4, 6)
    torch.testing.assert_close(result.programs[0].program.module()(x), model(x))


def test_an_op_without_translation_that_depends_on_the_inputs_is_named_with_its_module(tmp_path):
    torch.manual_seed(0)
    model = Gated().eval()
    bundle = record(model, tmp_path)
    result = bundle.export_programs(model)
    with pytest.raises(ExportError) as caught:
        result.to_onnx(tmp_path / "m.onnx")
    first = str(caught.value).splitlines()[0]
    assert "no ONNX translation for prims.erf_inv, used by module 'gate' (Gate)" in first
    assert not (tmp_path / "m.onnx").exists()
