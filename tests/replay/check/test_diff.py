"""diff_bundles: two bundles compared call by call (structure, shapes, dtypes, constants, values)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver, ToleranceError, load_bundle
from iobundle.replay import diff_bundles
from iobundle.replay.check._compare import output_paths


class Scaled(torch.nn.Module):
    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)
        self.offset = offset

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        y = self.lin(x) * scale
        return {"logits": y + self.offset, "hidden": y}


def record(path: Path, *, offset: float = 0.0, sizes: tuple[int, ...] = (2, 3), scale: float = 1.0) -> Path:
    model, observer = Scaled(offset).eval(), InputObserver()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), observer(model, store_n_calls=10):
        for n in sizes:
            model(torch.randn(n, 4, generator=g), scale=scale)
    observer.save(path)
    return path


def test_same_calls_are_alike(tmp_path):
    report = diff_bundles(record(tmp_path / "a"), record(tmp_path / "b"))
    assert report.ok and report.differences == []
    assert [r["SUCCESS"] for r in report.rows] == [True, True]
    assert [r["abs"] for r in report.rows] == [0.0, 0.0] and [r["inputs_abs"] for r in report.rows] == [0.0, 0.0]
    assert report.verdict().startswith("PASS: 2/2 calls alike")


def test_values_out_of_tolerance_name_the_output(tmp_path):
    a, b = record(tmp_path / "a"), record(tmp_path / "b", offset=1e-3)
    report = diff_bundles(a, b, rtol=0.0)
    assert not report.ok
    assert [r["worst_output"] for r in report.rows] == ["logits", "logits"]
    assert {c.name: c.success for c in report.outputs if c.call == 0} == {"logits": False, "hidden": True}
    assert diff_bundles(a, b, rtol=0.0, output_atol={"logits": 1e-2}).ok
    with pytest.raises(ToleranceError, match="'logit' matches no output"):
        diff_bundles(a, b, output_atol={"logit": 1e-2})


def test_shapes_constants_and_number_of_calls(tmp_path):
    a = load_bundle(record(tmp_path / "a", sizes=(2, 3, 4)))
    b = load_bundle(record(tmp_path / "b", sizes=(2, 5), scale=2.0))
    report = diff_bundles(a, b)
    assert not report.ok
    assert report.differences == ["calls: 3 in A, 2 in B (the first 2 compared)"]
    first, second = (r["differences"] for r in report.rows)
    assert "constant scale: None in A, 2.0 in B" in first
    assert "x: 3x4 float32 in A, 5x4 float32 in B" in second
    assert "logits: 3x2 float32 in A, 5x2 float32 in B" in second
    assert report.rows[1]["n_differences"] >= 3


def test_inputs_that_differ_are_reported(tmp_path):
    a = record(tmp_path / "a")
    model, observer = Scaled().eval(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.zeros(2, 4))
        model(torch.zeros(3, 4))
    observer.save(tmp_path / "b")
    report = diff_bundles(a, tmp_path / "b")
    assert not report.ok
    assert all("input x: max abs difference" in r["differences"] for r in report.rows)
    assert all(r["inputs_abs"] > 0 for r in report.rows)


def test_on_progress(tmp_path):
    events = []
    diff_bundles(record(tmp_path / "a"), record(tmp_path / "b"), on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("diff", 0, 2), ("diff", 1, 2), ("diff", 2, 2)]


class WithCache(torch.nn.Module):
    """Returns logits and a real transformers DynamicCache of 2 layers (context ["full", "full"], 4 tensors)."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(2):
            cache.update(x[:, None, :, :] + layer, x[:, None, :, :] * 2 + layer + self.offset, layer)
        return {"logits": x.sum(-1), "past_key_values": cache}


def test_cache_outputs_are_named_as_validate_names_them(tmp_path):
    pytest.importorskip("transformers")
    paths = []
    for name, offset in (("a", 0.0), ("b", 1e-2)):
        model, observer = WithCache(offset), InputObserver()
        with torch.no_grad(), observer(model):
            model(torch.ones(1, 3, 8))
        observer.save(tmp_path / name)
        paths.append(tmp_path / name)
    a, b = paths
    names = output_paths(load_bundle(a).calls[0].outputs)
    assert names == ["logits", *(f"past_key_values[{i}]" for i in range(4))]
    report = diff_bundles(a, b, rtol=0.0)
    assert [c.name for c in report.outputs] == names
    assert {c.name for c in report.outputs if c.success is False} == {"past_key_values[1]", "past_key_values[3]"}
    assert report.rows[0]["worst_output"] == "past_key_values[1]"
    loose = {"past_key_values[1]": 0.1, "past_key_values[3]": 0.1}
    assert diff_bundles(a, b, rtol=0.0, output_atol=loose).ok


class Small(torch.nn.Module):
    """Outputs of about 1e-2 in float32 tensors, computed in bfloat16 under ``torch.autocast``; ``offset`` shifts them."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.lin.weight.mul_(0.03)
            self.lin.bias.zero_()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).float() + self.offset


def record_autocast(path: Path, *, offset: float = 0.0, autocast: bool = True) -> Path:
    """Two calls of :class:`Small`, under CPU autocast in bfloat16 (or without, ``autocast=False``)."""
    model, observer = Small(offset).eval(), InputObserver()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), observer(model):
        for n in (2, 3):
            model(torch.randn(n, 8, generator=g))
    observer.save(path)
    return path


def test_autocast_captures_take_the_autocast_dtypes_tolerances(tmp_path):
    """Two bfloat16 autocast captures differing by 3e-3 on outputs of 1e-2 are alike; a regression of 0.1 is not."""
    a = record_autocast(tmp_path / "a")
    near = record_autocast(tmp_path / "near", offset=3e-3)
    report = diff_bundles(a, near)
    assert report.ok, report.verdict()
    assert {(c.dtype, c.atol) for c in report.outputs} == {("float32", 2e-2)}
    assert "recorded under torch.autocast(bfloat16): float32 outputs take its row" in report.criterion()
    assert not diff_bundles(a, record_autocast(tmp_path / "far", offset=0.1)).ok
    assert not diff_bundles(a, near, output_atol={"output": 1e-4}).ok  # still overridable
    # the same difference between plain captures is out of float32's tolerances
    plain = record_autocast(tmp_path / "plain", autocast=False)
    assert not diff_bundles(plain, record_autocast(tmp_path / "plain_near", offset=3e-3, autocast=False)).ok
