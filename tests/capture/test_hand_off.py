"""What the model's thread hands over when a call is recorded, and who writes it.

- A tensor is taken once: an output as a reference when the writer process copies it before the call
  returns, a copy otherwise; whatever the model or the caller does to it afterwards, the bundle holds
  what the model received and returned.
- With the default writer (``auto``), small calls go to the writer process and large ones to the
  writer thread, the two never writing at once, and never writing a tensor twice.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.capture import ObservationWarning, _stream, _writer_process
from iobundle.capture._writer import CALLS_DIR


class InPlace(torch.nn.Module):
    """A static cache: the model writes the new token into a state it returns, in place, at each call.

    The state is 1 MiB: more than a call the model's thread writes itself, less than one for the thread.
    """

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.zeros(4, WIDTH)

    def forward(self, x: torch.Tensor, position: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state[position].copy_(x)  # the input changes during the call
        return state, state.sum(0)


WIDTH = 65_536
WRITERS = ["auto", "process", "thread", None]  # None: recorded in memory


@pytest.mark.parametrize("writer", WRITERS)
def test_a_tensor_changed_in_place_after_the_call_is_recorded_as_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str | None
) -> None:
    if writer is not None:
        monkeypatch.setattr(_stream, "WRITER", writer)
    real_write = _stream.CallStream._write

    def slow_write(self: _stream.CallStream, call: object) -> None:
        time.sleep(0.1)  # the writer thread starts after the caller changed what the call returned
        real_write(self, call)  # type: ignore[arg-type]

    monkeypatch.setattr(_stream.CallStream, "_write", slow_write)
    model, observer = InPlace(), InputObserver()
    state = model.state
    target = None if writer is None else tmp_path / "run"
    expected_inputs, expected_outputs = [], []
    with observer(model, store_n_calls=4, stream_to=target):
        for i in range(4):
            expected_inputs.append(state.clone())
            out, total = model(torch.full((WIDTH,), float(i + 1)), i, state)
            expected_outputs.append((out.clone(), total.clone()))
            out.mul_(-7.0)  # the caller changes what the model returned: the bundle keeps what it returned
            total.add_(100.0)
    recorded = load_bundle(target) if target is not None else observer
    calls = recorded.calls if target is not None else observer._rc.calls
    store = recorded if target is not None else None
    assert len(calls) == 4
    for i, call in enumerate(calls):
        assert call.status == "ok"
        get = store.tensor if store is not None else observer._table.get
        assert torch.equal(get(call.args[2].key), expected_inputs[i]), f"input state of call {i}"
        out_key, total_key = (node.key for node in call.outputs.items)
        assert torch.equal(get(out_key), expected_outputs[i][0]), f"output state of call {i}"
        assert torch.equal(get(total_key), expected_outputs[i][1]), f"output sum of call {i}"
    if target is not None:
        assert load_bundle(target).verify() == []


class Mixed(torch.nn.Module):
    def forward(self, x: torch.Tensor, small: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, small * 2


def test_auto_writes_small_calls_with_the_process_and_large_ones_with_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_stream, "WRITER", "auto")
    monkeypatch.setattr(_stream, "PROCESS_MAX_BYTES", 256 * 1024)
    by_process, by_thread = [], []
    real_submit, real_write = _writer_process.WriterProcess.submit, _stream.CallStream._write

    def submit(self: _writer_process.WriterProcess, call: object) -> bool:
        by_process.append(call.index)  # type: ignore[attr-defined]
        return real_submit(self, call)  # type: ignore[arg-type]

    def write(self: _stream.CallStream, call: object) -> None:
        by_thread.append(call.index)  # type: ignore[attr-defined]
        real_write(self, call)  # type: ignore[arg-type]

    monkeypatch.setattr(_writer_process.WriterProcess, "submit", submit)
    monkeypatch.setattr(_stream.CallStream, "_write", write)
    model, observer = Mixed(), InputObserver()
    small = torch.arange(8.0)  # the same tensor in every call: written once, by whichever writer met it first
    sizes = [16, 16, 200_000, 16, 200_000, 200_000, 16, 16]  # floats: 64 B or 800 KB
    with observer(model, store_n_calls=len(sizes), stream_to=tmp_path / "run"):
        for i, n in enumerate(sizes):
            model(torch.full((n,), float(i)), small)
    assert by_process == [0, 1, 3, 6, 7]
    assert by_thread == [2, 4, 5]
    bundle = load_bundle(tmp_path / "run")
    assert bundle.verify() == []
    assert [c.index for c in bundle.calls] == list(range(len(sizes)))
    keys = set()
    for i, (call, n) in enumerate(zip(bundle.calls, sizes)):
        x = bundle.tensor(call.args[0].key)
        assert torch.equal(x, torch.full((n,), float(i)))
        assert torch.equal(bundle.tensor(call.outputs.items[0].key), x + 1)
        keys.add(call.args[1].key)
    assert len(keys) == 1  # the shared tensor has one key, stored once
    (key,) = keys
    entry = bundle.manifest.tensors[key]
    listed = [name for name in bundle.manifest.files if name.startswith(f"{CALLS_DIR}/")]
    assert entry.file == listed[0]  # the first file written holds it: neither writer wrote it again


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs os.getpriority")
def test_the_writer_process_yields_the_cpu_to_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine runs the model first: the writer process runs niced, below the recording process."""
    monkeypatch.setattr(_stream, "WRITER", "process")
    model, observer = torch.nn.Linear(3, 3), InputObserver()
    with observer(model, stream_to=tmp_path / "run"):
        model(torch.ones(1, 3))
        busy = [c for c in _writer_process._CHILDREN if c not in _writer_process._IDLE]
        assert busy
        deadline = time.monotonic() + 60  # the child lowers its priority as it starts
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)  # 19 is the lowest priority there is
        while os.getpriority(os.PRIO_PROCESS, busy[0].proc.pid) < wanted:
            assert time.monotonic() < deadline, "the writer process kept the recording process's priority"
            time.sleep(0.05)
    assert load_bundle(tmp_path / "run").num_obs() == 1


def test_a_writer_process_that_dies_during_a_copy_leaves_the_ring_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child ends while the model's thread copies a call into the ring: the reader thread waits for the
    copy before it unmaps the ring (torch's view of it does not keep it mapped: the copy would crash)."""
    monkeypatch.setattr(_stream, "WRITER", "process")
    real, submit = ctypes.memmove, _writer_process.WriterProcess.submit
    killed: list[int] = []
    handed: list[tuple[int, Any]] = []  # (call index, its writer process), as each call is handed over

    def track(self: Any, call: Any) -> bool:
        handed.append((call.index, self))
        return submit(self, call)

    def memmove(dst: int, src: int, n: int) -> int:
        if not killed:
            child = handed[-1][1]._child  # this stream's child (another test's may still be running)
            child.proc.kill()
            killed.append(handed[-1][0])
            child.proc.wait()
            time.sleep(0.5)  # the reader thread sees the end meanwhile
        return real(dst, src, n)

    monkeypatch.setattr(_writer_process.WriterProcess, "submit", track)
    monkeypatch.setattr(_writer_process.ctypes, "memmove", memmove)
    model, observer = torch.nn.Linear(3, 3), InputObserver()
    with (
        pytest.warns(ObservationWarning, match="stopped"),
        observer(model, store_n_calls=3, stream_to=tmp_path / "run"),
    ):
        for i in range(3):
            model(torch.full((1, 3), float(i)))
    assert killed
    loaded = load_bundle(tmp_path / "run")
    statuses = [c.status for c in loaded.calls]
    # the call being copied: written by the thread, or marked incomplete if the child had started (it may
    # have written it); every other call is written (the next ones by the thread)
    copied = killed[0]
    assert statuses[copied] in ("ok", "incomplete"), statuses
    assert statuses[:copied] + statuses[copied + 1 :] == ["ok", "ok"], statuses
    assert loaded.verify() == []


class Layers(torch.nn.Module):
    """Returns one tensor per layer, all of one shape (a cache's layers), computed with autograd on."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, _writer_process.CAT_MIN_TENSORS + 2))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x * s for s in self.scale]


@pytest.mark.parametrize("shape", [(2, 3, 16), (3, 5)])  # 16 floats: back to back in the ring; 5: padded apart
def test_outputs_of_one_shape_that_require_grad_reach_the_bundle_as_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    """The writer process's hand-off copies a run of same-shape outputs into the ring in one step (the tensors
    back to back) or one by one (each padded to the ring's alignment), autograd on or not."""
    monkeypatch.setattr(_stream, "WRITER", "process")
    model, observer = Layers(), InputObserver()
    returned = []
    with observer(model, store_n_calls=3, stream_to=tmp_path / "run"):
        for i in range(3):
            out = model(torch.randn(*shape, generator=torch.Generator().manual_seed(i)))
            assert out[0].requires_grad
            returned.append([t.detach().clone() for t in out])
    bundle = load_bundle(tmp_path / "run")
    assert bundle.num_obs() == 3
    for call, tensors in zip(bundle.calls, returned, strict=True):
        for node, expected in zip(call.outputs.items, tensors, strict=True):
            assert torch.equal(bundle.tensor(node.key), expected)
