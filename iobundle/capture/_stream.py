"""Streaming capture: every recorded call reaches the bundle as soon as it returns.

Who does what:

- The model's threads (any number) record calls. They only copy tensors (:meth:`SnapshotTable.snapshot`)
  and, when a call returns, hand it to the writer with :meth:`CallStream.submit`.
- A writer process (:mod:`iobundle.capture._writer_process`, with ``IOBUNDLE_WRITER=process``,
  :data:`WRITER`) does
  the writing below with its own interpreter lock: :meth:`CallStream.submit` copies the call's
  new tensors into shared memory and hands it over; the answers come back in call order and
  drop the written snapshots from memory. By default, or where no process can be started:
- One writer thread per stream (or, for a small CPU call, the thread that submits it) writes
  the call's new tensors (a tensor that extends one written recently, such as a growing KV cache,
  as its new part only): the small ones appended as one range to the current segment
  (``calls/segment-NNNNNN.bin``, XXH3-128 of the range computed while writing), the large ones to
  ``calls/NNNNNN.safetensors`` (temporary name, XXH3-128 computed while writing, rename); see
  :mod:`iobundle.capture._writer`. It then appends the call's line to ``journal.jsonl``, naming
  the range and its digest, and drops from memory the snapshots it wrote. Each snapshot's buffer goes
  back to the pool as soon as its bytes are in the file, unless it is kept as the base a later
  tensor may extend. ``manifest.json`` is written once, by :meth:`CallStream.close`.
- With ``durable=True`` every file is fsynced before its rename (and its directory after);
  by default the fsyncs wait for :meth:`CallStream.close`, which flushes every file written.

With the writer thread, the hand-off holds one call: :meth:`CallStream.submit` waits until the writer has finished the
previous call (its file and the journal line that lists it). The writer writes call k while the
model computes call k+1 (a small CPU call is written by the submitting thread itself, see
:data:`INLINE_MAX_BYTES`), so

- a SIGKILL loses at most the call in flight; the journal only ever lists complete files and
  ranges written before their line (renames are atomic for every process; the page cache outlives
  the killed process), a line cut short by the kill is ignored by the reader, and so are the bytes
  of a range being appended (past the segment's size as the last complete line gives it);
- memory holds the snapshots of about 1.5 calls: while the writer drains call k, the copies of
  call k+1 wait for its buffers once the pool has lent :data:`BUDGET_CALLS` calls' worth.

Tensors written to the bundle stay readable (:mod:`iobundle.capture._snapshots`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from iobundle.calls import RecordedCalls
from iobundle.capture._entries import TensorRow, call_keys, entry_row, mark_incomplete
from iobundle.capture._snapshots import BufferPool, SnapshotTable
from iobundle.capture._writer import BundleWriter
from iobundle.capture._writer_process import WriterProcess, WriterProcessUnavailable
from iobundle.errors import BundleWriteError
from iobundle.schema import CallEntry, FileEntry, Manifest, load_journal

__all__ = ["CallStream"]

INLINE_MAX_BYTES = 256 * 1024
"""A call whose snapshots add up to less than this (and are all on the CPU) is written by the thread
that submits it, once the writer is idle, instead of by the writer thread. A small call's writing is
Python work that holds the GIL; in a second thread it also pays a GIL hand-off at every torch call
and syscall against a model thread that holds the GIL most of the time. Measured on the 2-core
benchmark machine, tiny Llama of ``benchmarks/run.py`` (about 3 KiB per call), generate() of 24
tokens, machine quiet: writer time per call 3.2-3.6 ms in the thread, 1.3 ms in place, streamed/plain
2.6-2.8 against 2.1-2.2 (before the writer's fast paths). With them, machine shared with other jobs:
medians 1.8 in place against 2.5 in the thread in one series of four alternating runs, equal within
the noise in another. Written in place, a small call is also in the bundle as soon as it returns."""

WRITER = os.environ.get("IOBUNDLE_WRITER", "auto")
"""Who writes a stream's calls: ``"auto"`` (the default: the writer process for small calls, a thread
of the recording process for large ones, :data:`PROCESS_MAX_BYTES`), ``"process"`` (every call to the
writer process, :mod:`iobundle.capture._writer_process`) or ``"thread"`` (every call to the thread).
``IOBUNDLE_WRITER`` in the environment sets it when iobundle is imported. See docs/capture.md for the
measurements behind the default."""

PROCESS_MAX_BYTES = 4 * 1024 * 1024
"""With :data:`WRITER` ``"auto"``, a call whose snapshots add up to fewer bytes goes to the writer
process; a larger one to the writer thread. Below it a call's cost on the model's thread is per
tensor, which the process takes off the interpreter lock; above it, it is per byte, and the ring
would copy the bytes once more and hold them (figures 1a and 2 of BENCHMARKS.md)."""


def stream_writer_kind() -> str:
    """``"auto"``, ``"process"`` or ``"thread"``: what :data:`WRITER` means for a stream opened now (anything else is ``"auto"``)."""
    return WRITER if WRITER in ("process", "thread") else "auto"


class CallStream:
    """Writes recorded calls to a bundle: in a writer process (:data:`WRITER`), else a thread.

    With the writer process, :meth:`submit` copies the call's new tensors into shared memory and
    hands the call over (see :mod:`iobundle.capture._writer_process`); it waits only when many
    calls are not written yet (or, ``durable``, for the previous call). With the thread, it waits
    for the previous call, and a small CPU call (:data:`INLINE_MAX_BYTES`) is written by the
    thread that submits it. A process that cannot be started, or that ends before the stream is
    closed, leaves the writing to the thread, with one warning.

    Opening the stream writes, synchronously, the tensors of ``value_if_missing`` and the head of
    ``journal.jsonl`` (the calls written so far): from then on the directory opens with ``load_bundle``. Calls recorded
    before the stream opened are submitted like new ones. Failures after opening never raise:
    :meth:`take_failures` hands them to the model's thread, which warns and marks the call incomplete.

    Args:
        writer: The bundle directory, prepared.
        rc: The observer's calls (its signature and ``value_if_missing`` go in every manifest).
        table: The snapshots; written ones are dropped from memory.
        written: Calls ``writer`` already wrote (a stream reopened on the same directory).
        durable: fsync every file as it is written. Otherwise the files are renamed into place
            without fsync (atomic for every process, not across a crash of the machine) and
            :meth:`close` fsyncs them all.

    Raises:
        BundleWriteError: The first writes failed (the caller keeps recording in memory).
    """

    def __init__(
        self,
        writer: BundleWriter,
        rc: RecordedCalls,
        table: SnapshotTable,
        written: Iterable[CallEntry] = (),
        *,
        durable: bool = False,
    ) -> None:
        self.writer = writer
        self.path = writer.path
        self.durable = durable
        self._rc = rc
        self._table = table
        self._written: list[CallEntry] = list(written)
        self._failures: list[tuple[CallEntry | None, str]] = []
        self._queue: list[CallEntry] = []
        self._told: list[tuple[int, list[TensorRow]]] = []  # what the thread wrote, for the writer process
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        writer.write_missing_values(rc.value_if_missing, table.for_writing, durable=durable)
        writer.start_journal(rc, self._written, durable=durable)
        self.pool = BufferPool()
        table.pool = self.pool
        self._thread: threading.Thread | None = None
        self.process: WriterProcess | None = None
        if stream_writer_kind() != "thread":
            try:
                self.process = WriterProcess(
                    writer,
                    table.all_for_writing,
                    released=table.in_ring,
                    restored=table.restored,
                    durable=durable,
                    done=self._answered,
                    gone=self._process_gone,
                    idle=lambda: self.pool.set_draining(False),
                )
                self.process.start()
            except WriterProcessUnavailable as exc:
                self._failures.append(
                    (
                        None,
                        f"iobundle cannot start its writer process ({exc}); the calls streamed to "
                        f"'{self.path}' are written by a thread of this process instead.",
                    )
                )
        if self.process is None:
            self._start_thread()

    def _start_thread(self) -> None:
        if self.writer.deltas is not None:
            self._table.retained = self.writer.deltas.retained
        thread = threading.Thread(target=self._run, name=f"iobundle-writer:{self.path.name}", daemon=True)
        thread.start()
        with self._cond:
            self._thread = thread
            self._cond.notify_all()

    @property
    def manifest_calls(self) -> list[CallEntry]:
        """The calls the manifest lists now."""
        with self._cond:
            return list(self._written)

    def submit(self, call: CallEntry, *, recorded_now: bool = True) -> None:
        """Hand ``call`` to the writer process, or write it / queue it for the writer thread.

        Which writer takes it is decided per call (:data:`WRITER` ``"auto"``, the default): a call
        whose snapshots add up to less than :data:`PROCESS_MAX_BYTES` goes to the writer process
        (on the model's thread it costs one ``memmove`` per new tensor and a message), a larger one
        to the writer thread (one copy, written while the model computes the next call, where the
        ring would add a second copy and its memory). The two never write at once: a call that
        changes writer first waits until the other one has written everything it was given.

        With the thread: after waiting for the previous call to be written, a small CPU call
        (its snapshots under :data:`INLINE_MAX_BYTES`; not ``durable``) is written here, by the
        calling thread: the writer thread is idle then, and handing the call over would cost more
        than writing it. Others go to the writer thread, which writes them while the model
        computes the next call. ``recorded_now=False`` (a call recorded before the stream opened,
        whose copies :meth:`SnapshotTable.take_copied` did not count) goes to the process if there
        is one, else to the thread.
        """
        taken, off_cpu = self._table.take_copied()
        process = self.process
        if process is not None and (not recorded_now or stream_writer_kind() == "process" or taken < PROCESS_MAX_BYTES):
            with self._cond:
                if self._closed:
                    self._failures.append(
                        (None, f"the stream to '{self.path}' is closed; call {call.index} stays in memory")
                    )
                    return
            self._wait_thread_idle()
            self.pool.set_draining(True)
            if self._told:
                told, self._told = self._told, []
                process.tell(told, self.writer.files)
            if process.submit(call):
                return
            process.wait_gone()  # the child ended: the thread writes from now on
        elif process is not None:
            process.wait_idle()  # a large call: the thread writes it, once the process has written the rest
            self._table.own(call_keys(call))  # the thread reads them while the model runs on
            if self._thread is None:
                self._start_thread()
        self._submit_to_thread(call, recorded_now and not self.durable and not off_cpu and taken < INLINE_MAX_BYTES)

    def _wait_thread_idle(self) -> None:
        with self._cond:
            while self._thread is not None and (self._busy or self._queue) and self._thread.is_alive():
                self._cond.wait()

    def _submit_to_thread(self, call: CallEntry, inline: bool) -> None:
        with self._cond:
            while self._thread is None and not self._closed:
                self._cond.wait()
            thread = self._thread
            while thread is not None and (self._busy or self._queue) and thread.is_alive():
                self._cond.wait()
            if self._closed or thread is None or not thread.is_alive():
                self._failures.append(
                    (None, f"the stream to '{self.path}' is closed; call {call.index} stays in memory")
                )
                return
            self._busy = True
            if not inline:
                self._queue.append(call)
                self.pool.set_draining(True)
                self._cond.notify_all()
                return
        try:
            self._write(call)
        except Exception as exc:  # a bug here must not break the observed program
            with self._cond:
                self._failures.append((None, f"iobundle's writer failed on call {call.index} ({exc!r})"))
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def take_failures(self) -> list[tuple[CallEntry | None, str]]:
        """What went wrong since the last call: ``(incomplete call entry or None, message)`` pairs."""
        with self._cond:
            failures, self._failures = self._failures, []
        return failures

    def close(self) -> Manifest:
        """Wait for the writer, stop it, fsync what it wrote and write the final manifest (with fsync).

        Raises:
            BundleWriteError: A file cannot be flushed to the disk, or the final manifest cannot be written.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        error = None
        process = self.process
        if process is not None:
            try:
                process.close()
            except BundleWriteError as exc:
                error = exc
        if self._thread is not None:
            self._thread.join()
        self.pool.clear()
        self._table.pool = None
        if not self.durable:
            try:
                self.writer.sync()
            except BundleWriteError as exc:
                error = error or exc
        manifest = self.writer.finish_journal(self._rc, self.manifest_calls)
        if error is not None:
            raise error
        return manifest

    # -- the writer process's answers (its reader thread) --------------------------------------

    def _answered(
        self, call: CallEntry, rows: list[TensorRow] | bytes | None, error: str | None, journal_error: str | None
    ) -> None:
        self._settled(self._settle(call, rows or [], error), journal_error)

    def _process_gone(self, lost: list[CallEntry], started: bool, reason: str) -> None:
        """The child ended before the stream closed: the thread takes over; ``lost`` are the calls it never answered."""
        with self._cond:
            self.process = None
            self._failures.append(
                (
                    None,
                    f"iobundle's writer process for '{self.path}' stopped ({reason}); the calls are written "
                    "by a thread of this process from now on.",
                )
            )
            if not started:  # it wrote nothing: the snapshots are still here, queued before the thread runs
                self._queue.extend(lost)
                self._busy = bool(lost)
        if not started and lost:
            self.pool.set_draining(True)
        if started:  # settled before the thread starts: the calls submitted meanwhile wait for it, in order
            written = self._journaled(lost)
            for call in lost:  # it may have written them: never write a call's file twice
                found = written.get(call.index)
                if found is not None:  # in the journal: written whole, only its answer was lost
                    self.writer.adopt(call.index, *found)
                    self._answered(call, found[0], None, None)
                else:
                    self._answered(call, None, "the writer process stopped before confirming it was written", None)
        self._start_thread()

    def _journaled(self, calls: list[CallEntry]) -> dict[int, tuple[list[TensorRow], dict[str, FileEntry]]]:
        """What the journal says ``calls`` added (their tensors' rows and the files those name), by call index,
        for the calls it lists: a dead child's answers.

        The child answers many calls at once: the ones it wrote and listed before it died are in
        the bundle, and stay in it.
        """
        try:
            manifest = load_journal(self.path)
        except Exception:  # unreadable: the calls are marked incomplete
            return {}
        listed = {c.index for c in manifest.calls if c.status == "ok"}
        known, found = self.writer.tensors, {}
        for call in calls:
            if call.index in listed and call.status == "ok":
                keys = [k for k in dict.fromkeys(call_keys(call)) if k not in known and k in manifest.tensors]
                rows = [entry_row(k, manifest.tensors[k]) for k in keys]
                found[call.index] = (rows, {row[1]: manifest.files[row[1]] for row in rows})
        return found

    # -- the writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        return
                    call = self._queue.pop(0)
                try:
                    self._write(call)
                except Exception as exc:  # a bug here must not kill the thread the model waits on
                    with self._cond:
                        self._failures.append((None, f"iobundle's writer failed on call {call.index} ({exc!r})"))
                finally:
                    with self._cond:
                        self._busy = bool(self._queue)
                        if not self._busy:
                            self.pool.set_draining(False)
                        self._cond.notify_all()
        finally:
            self.pool.set_draining(False)  # no copy ever waits for a writer that is gone

    def _write(self, call: CallEntry) -> None:
        writer, table = self.writer, self._table
        keys: list[str] = []
        error = None
        try:
            keys = writer.write_call(call, table.for_writing, durable=self.durable, on_written=table.released)
        except Exception as exc:  # the observed program never sees it: reported through take_failures
            error = f"its tensors could not be written to '{self.path}' ({type(exc).__name__}: {exc})"
        rows = [entry_row(k, writer.tensors[k]) for k in keys]
        entry = self._settle(call, rows, error)
        if self.process is not None:
            with self._cond:
                self._told.append((call.index, rows))  # the writer process must not write them again
        journal_error = None
        try:
            writer.append_call(entry, keys, durable=self.durable)
        except Exception as exc:
            journal_error = str(exc)
        self._settled(entry, journal_error)

    def _settle(self, call: CallEntry, rows: list[TensorRow] | bytes, error: str | None) -> CallEntry:
        """Drop from memory the snapshots ``rows`` describe (written; packed as the writer process answers), or
        mark ``call`` incomplete: its entry."""
        writer, table = self.writer, self._table
        if error is not None:
            entry = mark_incomplete(call, lambda k: k in writer.tensors, error)
            table.discard(k for k in call_keys(call) if k not in writer.tensors)
            with self._cond:
                self._failures.append((entry, f"iobundle could not record call {call.index}: {error}"))
            return entry
        if isinstance(rows, bytes):
            table.written_packed(rows, writer.path)
        elif rows:
            files = writer.files
            table.written(rows, writer.path, {file: files[file].size for file in {row[1] for row in rows}})
        return call

    def _settled(self, entry: CallEntry, journal_error: str | None) -> None:
        with self._cond:
            if journal_error is not None:
                self._failures.append(
                    (
                        None,
                        f"iobundle could not append call {entry.index} to the journal of '{self.path}' ({journal_error})",
                    )
                )
            self._written.append(entry)
