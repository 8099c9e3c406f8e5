"""The writer process's main: it writes the calls a recording process hands it through shared memory.

The recording side (the ring, the pipes, :class:`~iobundle.capture._writer_process.WriterProcess`) is
in :mod:`iobundle.capture._writer_process`; this module is what runs in the child it starts.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from iobundle.calls import NAME_TO_DTYPE
from iobundle.capture._entries import entry_row, mark_incomplete, pack_answer
from iobundle.capture._writer import BundleWriter
from iobundle.capture._writer_process import (
    ANSWER_AFTER_IDLE_S,
    ANSWERS_AT_ONCE,
    CHILD_NICE,
    CONSUMED_EARLY_BYTES,
    POLL_S,
    RING_ALIGN,
    map_ring,
)
from iobundle.errors import BundleWriteError, UnsupportedInputError
from iobundle.schema import CallEntry, FileEntry

__all__ = ["serve"]


def serve() -> None:
    """The child's main: ``argv`` holds its pipe ends and the ring's descriptor.

    It writes one stream after another (each from its ``start`` to its ``close``) and exits at the
    end of its pipe: when the recording process exits or is killed, once every call received is written.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(CHILD_NICE)
    except (AttributeError, OSError):  # no nice() on this platform: the child runs at the parent's priority
        pass
    inbox_fd, outbox_fd, ring_fd = map(int, sys.argv[1:4])
    torch.set_num_threads(1)
    inbox = Connection(inbox_fd, writable=False)
    outbox: Connection | None = Connection(outbox_fd, readable=False)

    def answer(message: tuple[Any, ...]) -> None:
        nonlocal outbox
        if outbox is None:
            return
        try:
            outbox.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the recording process is gone: write what was received, unheard
            outbox = None

    ring = _ChildRing(ring_fd)
    writer: BundleWriter | None = None
    durable = False
    journal_error: str | None = None
    done: list[tuple[Any, ...]] = []  # answers not sent yet (ANSWERS_AT_ONCE, ANSWER_AFTER_IDLE_S)
    while True:
        if done and (durable or len(done) >= ANSWERS_AT_ONCE):
            answer(("done", done))
            done = []
        if writer is not None and not durable and not _polled(inbox, ANSWER_AFTER_IDLE_S) and done:
            answer(("done", done))
            done = []
        try:
            message = pickle.loads(inbox.recv_bytes())
        except EOFError:
            break  # the recording process is gone (or done): everything it sent is written
        kind = message[0]
        if kind != "call" and done:
            answer(("done", done))
            done = []
        if kind == "start":
            _, length, size = message
            path, tensors, files, indices, durable = pickle.loads(ring.view(size)[:length].numpy().tobytes())
            answer(("consumed", 0))
            writer = BundleWriter.resume(path, tensors, files, indices)
            journal_error = None
            try:
                writer.open_journal()
            except BundleWriteError as exc:
                journal_error = str(exc)
        elif kind == "close" and writer is not None:
            error = None
            if not durable:
                try:
                    writer.sync()
                except BundleWriteError as exc:
                    error = str(exc)
            writer.close_journal()
            writer = None
            answer(("closed", error))
        elif kind == "adopt" and writer is not None:
            _, indices, rows, files = message
            for i, index in enumerate(indices):
                writer.adopt(index, rows if i == 0 else [], files if i == 0 else {})
        elif kind == "call" and writer is not None:
            _, seq, call_json, start, specs, size = message
            call = CallEntry.model_validate_json(call_json)
            done.append(_write(writer, call, seq, start, specs, ring.view(size), durable, journal_error, answer))
    if done:
        answer(("done", done))
    if writer is not None:
        writer.close_journal()


def _polled(inbox: Connection, wait_s: float) -> bool:
    """Whether a message (or the end of the pipe) came within ``wait_s``, looked for every :data:`POLL_S`
    without waiting on the pipe (the sender would pay for waking this process)."""
    end = time.monotonic() + wait_s
    while not inbox.poll(0):
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)
    return True


class _ChildRing:
    """The child's mapping of the ring, remapped when the parent grew it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    def view(self, size: int) -> torch.Tensor:
        if self._map is None or len(self._map) != size:
            self._view = None
            self._map = map_ring(self.fd, size)
            self._view = torch.frombuffer(self._map, dtype=torch.uint8)
        assert self._view is not None
        return self._view


def _write(
    writer: BundleWriter,
    call: CallEntry,
    seq: int,
    start: int,
    specs: list[tuple[list[str], tuple[Any, ...]]],
    view: torch.Tensor,
    durable: bool,
    journal_error: str | None,
    answer: Callable[[tuple[Any, ...]], None],
) -> tuple[Any, ...]:
    """Write one call (its tensors copied out of the ring first); the answer to send."""
    snapshots: dict[str, torch.Tensor | Exception] = {}
    devices: dict[str, str] = {}
    copied = 0
    try:
        for group, spec in specs:
            if spec[0] == "tensor":  # each key at the next aligned offset
                _, name, shape, device, offset, nbytes = spec
                dtype, step = NAME_TO_DTYPE[name], (nbytes + RING_ALIGN - 1) & -RING_ALIGN
                begin = start + offset
                for key in group:
                    snapshots[key] = view[begin : begin + nbytes].view(dtype).reshape(shape).clone()
                    devices[key] = device
                    begin += step
                copied += nbytes * len(group)
            elif spec[0] == "unsupported":
                message = f"Tensor {group[0]!r} has dtype {spec[1]}, which a bundle cannot store."
                snapshots[group[0]] = UnsupportedInputError(message)
            else:
                snapshots[group[0]] = _Missing(f"{spec[1]}: {spec[2]}")
    except Exception as exc:  # a bug, or a message that does not fit the ring: this call fails, not the child
        snapshots = {key: exc for group, _ in specs for key in group}
    del view
    if copied >= CONSUMED_EARLY_BYTES:
        answer(("consumed", seq))  # the ring range is free again before the slow part

    def get(key: str) -> torch.Tensor:
        found = snapshots.get(key)
        if found is None:
            raise KeyError(key)
        if isinstance(found, Exception):
            raise found
        return found

    keys: list[str] = []
    error = None
    try:
        keys = writer.write_call(call, get, durable=durable)
        entry = call
    except Exception as exc:
        error = f"its tensors could not be written to '{writer.path}' ({type(exc).__name__}: {exc})"
        entry = mark_incomplete(call, lambda k: k in writer.tensors, error)
    for key in keys:
        device = devices.get(key, "cpu")
        if device != "cpu":
            writer.tensors[key] = writer.tensors[key].model_copy(update={"device": device})
    failed_journal = journal_error
    if failed_journal is None:
        try:
            writer.append_call(entry, keys, durable=durable)
        except Exception as exc:
            failed_journal = str(exc)
    rows = [entry_row(k, writer.tensors[k]) for k in keys]
    written_files: dict[str, FileEntry] = {row[1]: writer.files[row[1]] for row in rows}
    return (seq, call.index, pack_answer(rows, written_files), error, failed_journal)


class _Missing(Exception):
    """A key whose snapshot the recording process no longer had."""
