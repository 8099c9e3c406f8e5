"""``iobundle inspect`` on many calls: one row per run of consecutive calls that differ only in sizes."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.cli import _render, main

STEPS = 30
FAILING_STEP = 12


class Decoder(torch.nn.Module):
    def forward(self, input_ids, past=None, attention_mask=None, temperature=1.0):
        if past is not None and past[0].shape[2] == 4 + FAILING_STEP:
            raise ValueError("no cache of this length")
        return input_ids.float().sum()


@pytest.fixture(scope="module")
def decode_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prefill (no cache), then decode steps whose cache and mask grow by one; one step fails."""
    model, observer = Decoder(), InputObserver()
    with observer(model, store_n_calls=STEPS + 1):
        model(torch.ones(2, 4, dtype=torch.int64), attention_mask=torch.ones(2, 4), temperature=0.5)
        for step in range(STEPS):
            past = [torch.randn(2, 3, 4 + step, 8) for _ in range(2)]
            try:
                model(torch.ones(2, 1, dtype=torch.int64), past, torch.ones(2, 5 + step), temperature=0.5)
            except ValueError:
                pass
    path = tmp_path_factory.mktemp("bundles") / "decode.iobundle"
    observer.save(path)
    return path


ROW = re.compile(r"\s*\d+(-\d+)?\s+(ok|failed)\s")


def _rows(out: str) -> list[list[str]]:
    """The table's rows, split into their first columns (the calls, the status, ...)."""
    return [line.split(maxsplit=4) for line in out.splitlines() if ROW.match(line)]


def _row(out: str, calls: str) -> str:
    return next(line for line in out.splitlines() if ROW.match(line) and line.split()[0] == calls)


def test_runs_summarise_the_decode_steps(capsys, decode_bundle):
    assert main(["inspect", str(decode_bundle)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    last = STEPS
    assert [r[:2] for r in rows] == [
        ["0", "ok"],
        [f"1-{FAILING_STEP}", "ok"],
        [str(FAILING_STEP + 1), "failed"],
        [f"{FAILING_STEP + 2}-{last}", "ok"],
    ]
    assert f"{STEPS + 1} calls in 4 runs of consecutive calls" in out
    first_run = _row(out, f"1-{FAILING_STEP}")
    assert f"past=[2x3x4..{3 + FAILING_STEP}x8 f32, 2x3x4..{3 + FAILING_STEP}x8 f32]" in first_run
    assert f"attention_mask=2x5..{4 + FAILING_STEP} f32" in first_run and "input_ids=2x1 i64" in first_run
    assert first_run.rstrip().endswith("temperature=0.5")
    later = _row(out, f"{FAILING_STEP + 2}-{last}")
    assert f"past=[2x3x{5 + FAILING_STEP}..{3 + STEPS}x8 f32" in later
    assert f"call {FAILING_STEP + 1} failed: ValueError: no cache of this length" in out


def test_calls_all_lists_every_call(capsys, decode_bundle):
    assert main(["inspect", str(decode_bundle), "--calls", "all"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r[0] for r in rows] == [str(i) for i in range(STEPS + 1)]
    assert "runs of consecutive calls" not in out
    assert "past=[2x3x7x8 f32, 2x3x7x8 f32]" in _row(out, "4")


def test_runs_agree_with_the_calls_they_summarise(decode_bundle):
    """Each run's row is what every one of its calls shows, sizes aside, and its ranges span theirs."""
    manifest = load_bundle(decode_bundle).manifest
    runs = _render.call_runs(manifest)
    assert [c.index for run in runs for c in run.calls] == [c.index for c in manifest.calls]
    for run in runs:
        ranges = run.shape_text(manifest)
        for keys in run.keys:
            texts = [_render.format_tensor(manifest, k).split() for k in keys]
            for key, (shape, dtype) in zip(run.keys[0], texts):
                merged, merged_dtype = ranges(key).split()
                assert merged_dtype == dtype
                for size, span in zip(shape.split("x"), merged.split("x")):
                    low, _, high = span.partition("..")
                    assert int(low) <= int(size) <= int(high or low)


def test_few_calls_are_listed_one_by_one_unless_runs_are_asked_for(capsys, tmp_path):
    model, observer = Decoder(), InputObserver()
    with observer(model):
        for step in range(3):
            model(torch.ones(2, 1, dtype=torch.int64), [torch.randn(2, 3, 4 + step, 8)])
    observer.save(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b")]) == 0
    assert [r[0] for r in _rows(capsys.readouterr().out)] == ["0", "1", "2"]
    assert main(["inspect", str(tmp_path / "b"), "--calls", "runs"]) == 0
    out = capsys.readouterr().out
    assert [r[0] for r in _rows(out)] == ["0-2"] and "past=[2x3x4..6x8 f32]" in out


def test_a_call_passing_one_tensor_twice_is_a_run_of_its_own(capsys, tmp_path):
    model, observer = Decoder(), InputObserver()
    shared = torch.randn(2, 3, 4, 8)
    with observer(model):
        model(torch.ones(2, 1, dtype=torch.int64), [torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)])
        model(torch.ones(2, 1, dtype=torch.int64), [shared, shared])
        model(torch.ones(2, 1, dtype=torch.int64), [torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)])
    observer.save(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b"), "--calls", "runs"]) == 0
    assert [r[0] for r in _rows(capsys.readouterr().out)] == ["0", "1", "2"]


def test_a_dtype_change_splits_a_run(capsys, tmp_path):
    model, observer = Decoder(), InputObserver()
    with observer(model, store_n_calls=4):
        for dtype in (torch.float32, torch.float32, torch.float16, torch.float16):
            model(torch.ones(2, 1, dtype=torch.int64), [torch.randn(2, 3, 4, 8, dtype=dtype)])
    observer.save(tmp_path / "b")
    assert main(["inspect", str(tmp_path / "b"), "--calls", "runs"]) == 0
    out = capsys.readouterr().out
    assert [r[0] for r in _rows(out)] == ["0-1", "2-3"]
    assert "past=[2x3x4x8 f16]" in out


def test_inspect_leaves_the_collector_on(capsys, decode_bundle):
    assert gc.isenabled()
    assert main(["inspect", str(decode_bundle)]) == 0
    assert main(["inspect", str(decode_bundle / "nope")]) == 2
    capsys.readouterr()
    assert gc.isenabled()
