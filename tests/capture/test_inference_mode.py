"""A model run under torch.inference_mode is recorded like one under torch.no_grad."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli.tiny_models import tiny_llama  # tests/ is on sys.path (tests/conftest.py)

from iobundle import InputObserver, load_bundle
from iobundle.capture import _stream, _writer_process


class Step(torch.nn.Module):
    """Keeps a static state tensor that each call updates in place and returns."""

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state.add_(x)
        return state, x * 2


@pytest.mark.parametrize("writer", ["process", "thread", None])  # None: in memory, then saved
def test_calls_under_inference_mode_are_recorded_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str | None
) -> None:
    if writer is not None:
        monkeypatch.setattr(_stream, "WRITER", writer)
    model, observer = Step(), InputObserver()
    inputs, outputs = [], []
    with torch.inference_mode():
        state = torch.zeros(2, 3)
        with observer(model, store_n_calls=3, stream_to=None if writer is None else tmp_path / "run"):
            for i in range(3):
                x = torch.full((2, 3), float(i + 1))
                inputs.append(state.clone())
                new_state, doubled = model(x, state)
                outputs.append((new_state.clone(), doubled.clone()))
    if writer is None:
        observer.save(tmp_path / "run")
    bundle = load_bundle(tmp_path / "run")
    assert bundle.num_obs() == 3
    for call, before, (after, doubled) in zip(bundle.calls, inputs, outputs, strict=True):
        assert torch.equal(bundle.tensor(call.args[1].key), before)  # the state as the call received it
        assert torch.equal(bundle.tensor(call.outputs.items[0].key), after)  # and as it returned it
        assert torch.equal(bundle.tensor(call.outputs.items[1].key), doubled)


def test_a_generate_under_inference_mode_is_recorded(tmp_path: Path) -> None:
    model, observer = tiny_llama(), InputObserver()
    prompt = torch.randint(0, 64, (1, 5))
    with torch.inference_mode(), observer(model, store_n_calls=10, stream_to=tmp_path / "run"):
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    bundle = load_bundle(tmp_path / "run")
    assert bundle.num_obs() == 4
    assert all(call.status == "ok" for call in bundle.calls)


def test_a_writer_process_started_under_inference_mode_serves_later_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer process (and its shared memory) is kept for the next stream, which may run outside inference_mode."""
    monkeypatch.setattr(_writer_process, "_IDLE", [])  # a new one, started under inference_mode
    monkeypatch.setattr(_stream, "WRITER", "process")
    model = torch.nn.Linear(3, 3)
    for i, inference in enumerate([True, False, True]):
        observer = InputObserver()
        with torch.inference_mode(inference), observer(model, stream_to=tmp_path / f"run{i}"):
            model(torch.ones(1, 3))
        assert load_bundle(tmp_path / f"run{i}").calls[0].status == "ok"
    for child in list(_writer_process._IDLE):  # ours, outside the pool the next tests share: ended here
        _writer_process._IDLE.remove(child)
        child.end()
