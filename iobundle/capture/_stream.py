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

Tensors written to the bundle stay readable: :class:`SnapshotTable` reads them back from their
file on demand (no cache), checking the file the way ``iobundle.replay`` checks a stranger's, so
``InputObserver.infer_*`` work on a streaming observer as on one that keeps everything in memory.
"""

from __future__ import annotations

import bisect
import functools
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from iobundle.calls import (
    RecordedCalls,
    dtype_name,
    parse_header,
    read_exactly,
    rebuild,
    tensor_span,
)
from iobundle.capture._writer import BundleWriter, TensorRow, call_keys, entry_row, mark_incomplete
from iobundle.capture._writer_process import WriterProcess, WriterProcessUnavailable
from iobundle.errors import BundleWriteError, TensorFileError
from iobundle.schema import CallEntry, Manifest

__all__ = ["CallStream", "SnapshotTable", "mark_incomplete", "snapshot_tensor"]

POOLED_MIN_BYTES = 256 * 1024
"""Tensors at least this large are copied into recycled buffers while streaming (smaller ones come
from the allocator's heap, which is already warm)."""

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

BUDGET_CALLS = 1.5
"""While the writer still holds buffers of earlier calls, the pool lends at most this many times
the largest call's pooled bytes; a copy beyond it waits for the writer to return a buffer."""

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


_HEADER_CACHE = 64


def snapshot_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor``, detached from autograd, on the same device."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _poolable(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_nested
        and not tensor.is_quantized
        and type(tensor) is torch.Tensor
        and dtype_name(tensor.dtype) is not None
        and tensor.numel() * tensor.element_size() >= POOLED_MIN_BYTES
    )


def _round_up(nbytes: int) -> int:
    """Round ``nbytes`` up to one of 8 sizes per power of two (at most 12.5% slack), 4 KiB aligned."""
    step = max(4096, 1 << max(nbytes.bit_length() - 4, 0))
    return -(-nbytes // step) * step


class BufferPool:
    """Recycled CPU byte buffers for snapshots.

    A copy into memory that was already touched costs no page faults, which is most of the
    price of copying into fresh memory. Buffers come back as soon as the writer has written the
    snapshot they held; at most ``limit`` free bytes are kept (the most a call took).

    While the writer drains submitted calls, at most ``budget`` bytes are lent out (:data:`BUDGET_CALLS`
    times the most a call took): :meth:`take` waits for the writer to give buffers back beyond
    that. It never waits while the writer is idle, so a call larger than the budget still goes through.
    """

    def __init__(self) -> None:
        self.limit = 0
        self.budget = 0
        self._draining = False
        self._call_bytes = 0  # taken since the last submitted call
        self._max_call_bytes = 0
        self._sizes: list[int] = []
        self._free: list[torch.Tensor] = []
        self._bytes = 0
        self._taken: dict[int, int] = {}  # data_ptr -> size of the buffers lent out
        self._lent = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (a recycled one of at most twice that, else a new one)."""
        with self._cond:
            while self._draining and self.budget and self._lent + nbytes > self.budget:
                self._cond.wait()
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
                del self._sizes[i]
                buf = self._free.pop(i)
                self._bytes -= buf.numel()
            else:
                buf = None
        if buf is None:
            buf = torch.empty(_round_up(nbytes), dtype=torch.uint8)
        with self._cond:
            self._taken[buf.data_ptr()] = buf.numel()
            self._lent += buf.numel()
            self._call_bytes += buf.numel()
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Take back ``buf`` (its snapshot is written): keep it for reuse, within ``limit``."""
        n = buf.numel()
        with self._cond:
            self._lent -= self._taken.pop(buf.data_ptr(), 0)
            self._cond.notify_all()
            if self._bytes + n > self.limit:
                return
            i = bisect.bisect_left(self._sizes, n)
            self._sizes.insert(i, n)
            self._free.insert(i, buf)
            self._bytes += n

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting the buffer ``tensor`` views as lent (handed to the user, or dropped)."""
        with self._cond:
            self._lent -= self._taken.pop(tensor.untyped_storage().data_ptr(), 0)
            self._cond.notify_all()

    def set_draining(self, draining: bool) -> None:
        """Whether the writer holds buffers of submitted calls (that it will give back).

        Turning it on marks the end of a call: what was taken since the last one is that call's size.
        """
        with self._cond:
            if draining:
                self._max_call_bytes = max(self._max_call_bytes, self._call_bytes)
                self._call_bytes = 0
                self.budget = int(BUDGET_CALLS * self._max_call_bytes)
                self.limit = self._max_call_bytes
            self._draining = draining
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._sizes.clear()
            self._free.clear()
            self._bytes = 0
            self._draining = False
            self.budget = 0
            self._cond.notify_all()


class _OnDisk(NamedTuple):
    """Where a snapshot went: the tensor ``name`` of the safetensors file ``path``, or bytes of a segment.

    For a segment, ``offset`` is where its bytes start and ``file_size`` the segment's size once they
    were written (it only grows). A named tuple: one is made for every tensor a stream writes.
    """

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    file_size: int
    extends: tuple[str, int] | None = None
    """``(key, dim)`` when the file holds only the part past the tensor ``key`` along ``dim``."""
    stored_shape: tuple[int, ...] | None = None
    """The shape of what the file holds, when it is not ``shape``."""
    offset: int | None = None


@dataclass(frozen=True)
class _Pending:
    """A snapshot whose bytes are in a file that is not complete yet (its buffer was recycled)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str


class _FileReader:
    """Reads single tensors back from the files a :class:`BundleWriter` wrote, checking each file first.

    The files were written by this process, but they live in a directory anyone may touch: a file
    that is not a regular file, whose size changed, whose header is not what was written, or whose
    byte spans do not fit is a :class:`TensorFileError`, never a crash. Reading copies the bytes into
    a fresh tensor, never a memory mapping (a mapping past the end of a truncated file is a SIGBUS).
    """

    def __init__(self) -> None:
        self._headers: OrderedDict[tuple[Path, int, int, int], tuple[dict[str, Any], int]] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, where: _OnDisk) -> torch.Tensor:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(where.path, flags | getattr(os, "O_NOFOLLOW", 0))  # a file swapped for a link is refused
        except OSError as exc:
            raise TensorFileError(
                f"{where.path}: tensor {where.name!r} cannot be read back ({exc.strerror or exc}). "
                "The streamed bundle was moved or changed while the observer still used it."
            ) from exc
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                info = os.fstat(f.fileno())
                segment = where.offset is not None
                if not stat.S_ISREG(info.st_mode) or (
                    info.st_size < where.file_size if segment else info.st_size != where.file_size
                ):
                    raise TensorFileError(
                        f"{where.path}: {info.st_size} bytes, {where.file_size} were written. "
                        "The streamed bundle was changed while the observer still used it."
                    )
                if where.offset is not None:
                    return self._read_bytes(f, where, where.offset)
                header, data_start = self._header(f, where, info)
                return self._read_tensor(f, where, header, data_start)
        except OSError as exc:
            raise TensorFileError(f"{where.path}: cannot be read back ({exc.strerror or exc}).") from exc

    def _header(self, f: Any, where: _OnDisk, info: os.stat_result) -> tuple[dict[str, Any], int]:
        cache_key = (where.path, info.st_ino, info.st_size, info.st_mtime_ns)
        with self._lock:
            cached = self._headers.get(cache_key)
            if cached is not None:
                self._headers.move_to_end(cache_key)
                return cached
        name = str(where.path)
        header, data_start = parse_header(name, where.file_size, lambda n: read_exactly(f, n, name))
        with self._lock:
            self._headers[cache_key] = (header, data_start)
            while len(self._headers) > _HEADER_CACHE:
                self._headers.popitem(last=False)
        return header, data_start

    def _read_bytes(self, f: Any, where: _OnDisk, offset: int) -> torch.Tensor:
        """The tensor whose bytes start at ``offset`` (in a segment, which has no header)."""
        shape = where.shape if where.stored_shape is None else where.stored_shape
        out = torch.empty(shape, dtype=where.dtype)
        nbytes = out.numel() * out.element_size()
        if nbytes:
            f.seek(offset)
            read_exactly(
                f, nbytes, str(where.path), into=memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            )
        return out

    def _read_tensor(self, f: Any, where: _OnDisk, header: dict[str, Any], data_start: int) -> torch.Tensor:
        name = str(where.path)
        shape = where.shape if where.stored_shape is None else where.stored_shape
        begin, end = tensor_span(
            name,
            header,
            where.name,
            dtype=dtype_name(where.dtype),
            shape=shape,
            data_len=where.file_size - data_start,
            expected_by="when it was written",
        )
        out = torch.empty(shape, dtype=where.dtype)
        if end > begin:
            f.seek(data_start + begin)
            read_exactly(f, end - begin, name, into=memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B"))
        return out


class SnapshotTable(MutableMapping[str, torch.Tensor]):
    """The observer's tensor snapshots, by key: in memory, or in a bundle file once streamed.

    It is both the mapping a ``TensorCollector`` fills and the ``TensorStore`` inference reads.
    A key stays valid after its snapshot was written and dropped from memory, so a tensor seen
    again in a later call is referenced, not copied again, and ``get`` reads it back from its file.
    Reading back returns a new tensor each time, on the device the original was on when possible.
    A key whose buffer was recycled before its file was complete is read once the file is (``get``
    waits for the writer).
    """

    def __init__(self) -> None:
        self._memory: dict[str, torch.Tensor] = {}
        self._pending: dict[str, _Pending] = {}
        self._disk: dict[str, _OnDisk] = {}
        self._lent: set[str] = set()
        self._lock = threading.Condition()
        self._reader = _FileReader()
        self.pool: BufferPool | None = None
        self.journal: list[str] | None = None
        """When a list, every key stored is appended to it (to undo a recording that failed half-way)."""
        self.retained: set[str] = set()
        """Keys the writer keeps as bases of later extensions: their buffers are never recycled."""
        self.copied_bytes = 0
        """Bytes :meth:`snapshot` took (copied, or referenced) since :meth:`take_copied` last reset it."""
        self.copied_off_cpu = False
        """Whether one of those copies is not on the CPU."""
        self.reference = False
        """While True, :meth:`snapshot` keeps a reference to a contiguous CPU tensor instead of a copy:
        set while the outputs of a call are recorded for a writer process, which copies them into
        shared memory before the call returns (the model cannot have changed them yet)."""
        self._referenced: dict[str, int] = {}  # key -> the version counter of the tensor referenced

    def take_copied(self) -> tuple[int, bool]:
        """``(copied_bytes, copied_off_cpu)`` since the last call of this method; resets both."""
        with self._lock:
            copied = self.copied_bytes, self.copied_off_cpu
            self.copied_bytes, self.copied_off_cpu = 0, False
        return copied

    # -- snapshots (the model's threads) -------------------------------------------------------

    def snapshot(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor``: with :func:`snapshot_tensor`, or into a recycled buffer while streaming.

        While streaming, a CUDA copy also gets an event: the copy runs on the model's current
        stream and the writer reads it from another thread (and stream), after the event.
        """
        if self.reference and tensor.is_cpu and type(tensor) is torch.Tensor and tensor.is_contiguous():
            self.copied_bytes += tensor.nbytes
            return tensor
        pool = self.pool
        if pool is None or not _poolable(tensor):
            out = snapshot_tensor(tensor)
            if pool is None:
                return out
            self.copied_bytes += out.numel() * out.element_size()
            if out.device.type != "cpu":
                self.copied_off_cpu = True
            if out.is_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(out.device))
                out._iobundle_ready = event  # type: ignore[attr-defined]
            return out
        nbytes = tensor.numel() * tensor.element_size()
        self.copied_bytes += nbytes
        out = pool.take(nbytes)[:nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor.detach())
        return out

    def _drop(self, tensor: torch.Tensor | None) -> None:
        """``tensor`` leaves the table without going back to the pool: stop counting its buffer."""
        pool = self.pool
        if (
            tensor is not None
            and pool is not None
            and tensor.numel() * tensor.element_size() >= POOLED_MIN_BYTES  # smaller ones never came from it
            and tensor.device.type == "cpu"
        ):
            pool.forget(tensor)

    # -- MutableMapping ------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._memory or key in self._pending or key in self._disk

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if self.reference:
            self._referenced[key] = value._version  # a copy's counter never moves: only references are checked
        if key not in self._pending and key not in self._disk and key not in self._lent:
            self._memory[key] = value  # a new key (every snapshot): nothing waits for it
        else:
            with self._lock:
                self._memory[key] = value
                self._pending.pop(key, None)
                self._disk.pop(key, None)
                self._lent.discard(key)
                self._lock.notify_all()
        if self.journal is not None:
            self.journal.append(key)

    def __delitem__(self, key: str) -> None:
        with self._lock:
            tensor = self._memory.pop(key, None)
            found = tensor is not None
            found = self._pending.pop(key, None) is not None or found
            found = self._disk.pop(key, None) is not None or found
            self._lent.discard(key)
            self._referenced.pop(key, None)
            self._lock.notify_all()
        self._drop(tensor)
        if not found:
            raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            keys = list(dict.fromkeys([*self._memory, *self._pending, *self._disk]))
        return iter(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._memory.keys() | self._pending.keys() | self._disk.keys())

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        with self._lock:
            value = self._memory.pop(key, None)
            pending = self._pending.pop(key, None)
            on_disk = self._disk.pop(key, None)
            self._lent.discard(key)
            self._referenced.pop(key, None)
            self._lock.notify_all()
        if value is None and pending is None and on_disk is None:
            if default:
                return default[0]
            raise KeyError(key)
        self._drop(value)
        return value

    # -- TensorStore -----------------------------------------------------------------------------

    def _changed(self, key: str) -> bool:
        """Whether ``key`` references a tensor changed in place since it was recorded (read it from its file)."""
        version = self._referenced.get(key)
        return version is not None and key in self._memory and self._memory[key]._version != version

    def _meta(self, key: str) -> _OnDisk | _Pending:
        with self._lock:
            meta = self._pending.get(key) or self._disk.get(key)
        if meta is None:
            raise KeyError(key)
        return meta

    def shape(self, key: str) -> tuple[int, ...]:
        tensor = self._memory.get(key)
        return tuple(tensor.shape) if tensor is not None else self._meta(key).shape

    def dtype(self, key: str) -> torch.dtype:
        tensor = self._memory.get(key)
        return tensor.dtype if tensor is not None else self._meta(key).dtype

    def get(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        """The tensor of ``key``: the snapshot itself while in memory, else a copy read from its file."""
        with self._lock:
            while key in self._pending or self._changed(key):  # its file is being written: wait for it
                self._lock.wait()
            tensor = self._memory.get(key)
            if tensor is not None:
                self._lent.add(key)  # handed out: its buffer is never recycled
                return tensor.detach() if key in self._referenced else tensor
            where = self._disk.get(key)
        if where is None:
            if default:
                return default[0]
            raise KeyError(key)
        tensor = self._read(where)
        if where.device != "cpu":
            try:
                tensor = tensor.to(where.device)
            except (RuntimeError, AssertionError):
                pass  # the device is gone: the CPU copy holds the same values
        return tensor

    def _read(self, where: _OnDisk) -> torch.Tensor:
        """The tensor ``where`` describes, read from its file; an extension rebuilt from its chain."""
        parts = []
        while where.extends is not None:
            base, dim = where.extends
            if where.stored_shape is None:  # its base was gone when it was written: its part has no shape
                raise TensorFileError(
                    f"{where.path}: tensor {where.name!r} extends {base!r}, which this observer no longer holds."
                )
            parts.append((self._reader.read(where), dim))
            with self._lock:
                while base in self._pending:
                    self._lock.wait()
                found = self._disk.get(base)
                memory = self._memory.get(base) if found is None else None
            if found is None:
                if memory is None:
                    raise TensorFileError(
                        f"{where.path}: tensor {where.name!r} extends {base!r}, which this observer no longer holds."
                    )
                return rebuild(memory.cpu(), parts[::-1])
            where = found
        return rebuild(self._reader.read(where), parts[::-1])

    # -- the writer's side -----------------------------------------------------------------------

    def for_writing(self, key: str, *, wait: bool = True) -> torch.Tensor:
        """The tensor of ``key`` for the writer (not marked as handed out).

        A CUDA snapshot is returned once its copy is done, unless ``wait`` is False: the caller then
        orders its own work after the snapshot's event (``_iobundle_ready``) on the device.

        Raises:
            TensorFileError: ``key`` is a reference to a tensor changed in place since it was recorded
                (its bytes can no longer be what the model received or returned).
        """
        tensor = self._memory.get(key)
        if tensor is None:
            return self.get(key)
        version = self._referenced.get(key)
        if version is not None and tensor._version != version:
            raise TensorFileError(
                f"tensor {key!r} was changed in place after it was recorded, before it could be written; "
                "its recorded value is lost."
            )
        event = getattr(tensor, "_iobundle_ready", None) if wait else None
        if event is not None:
            event.synchronize()
        return tensor

    def own(self, keys: Iterable[str]) -> None:
        """Replace the references among ``keys`` by copies: a writer thread will read them while the model runs on."""
        with self._lock:
            for key in keys:
                if self._referenced.pop(key, None) is not None and key in self._memory:
                    self._memory[key] = snapshot_tensor(self._memory[key])

    def released(self, key: str) -> None:
        """The bytes of ``key`` are in its file (not complete yet): recycle its buffer now if it is pooled.

        Called by the writer (or its hashing thread) while the file is being written; the key
        stays readable, ``get`` waiting for :meth:`written` or :meth:`discard`.
        """
        pool = self.pool
        if pool is None:
            return
        with self._lock:
            tensor = self._memory.get(key)
            if (
                tensor is None
                or key in self._lent
                or key in self.retained
                or key in self._referenced
                or not _poolable(tensor)
            ):
                return
            del self._memory[key]
            self._pending[key] = _Pending(dtype=tensor.dtype, shape=tuple(tensor.shape), device=str(tensor.device))
        _give_back(pool, tensor)

    def written(self, rows: Iterable[TensorRow], root: Path, sizes: dict[str, int]) -> None:
        """Forget the snapshots of the tensors ``rows`` describe, now in their files; recycle their buffers.

        ``root`` is the bundle's directory and ``sizes`` the size of each file the rows name (a
        segment's once their bytes were written). A row that extends another tensor holds the part
        past that tensor's, which this table knows (written before, or earlier in ``rows``).
        """
        pool = self.pool
        paths = {file: root / file for file in sizes}
        recycle = []
        with self._lock:
            for key, file, name, _, shape, _, ext, offset in rows:
                pending = self._pending.pop(key, None)
                tensor = self._memory.pop(key, None) if pending is None else None
                meta = pending if pending is not None else tensor
                if meta is None:
                    continue
                stored = None
                if ext is not None:
                    base = self._disk.get(ext[0]) or self._pending.get(ext[0]) or self._memory.get(ext[0])
                    if base is not None:
                        stored = list(shape)
                        stored[ext[1]] -= base.shape[ext[1]]
                        stored = tuple(stored)
                self._disk[key] = _OnDisk(
                    paths[file], name, meta.dtype, tuple(shape), str(meta.device), sizes[file], ext, stored, offset
                )
                lent = key in self._lent or key in self.retained or self._referenced.pop(key, None) is not None
                self._lent.discard(key)
                if tensor is not None and pool is not None:
                    recycle.append((tensor, lent))
            self._lock.notify_all()
        for tensor, lent in recycle:
            if not lent and _poolable(tensor):
                _give_back(pool, tensor)
            else:
                self._drop(tensor)

    def discard(self, keys: Iterable[str]) -> None:
        """Drop the in-memory snapshots of ``keys`` (they could not be written)."""
        dropped = []
        with self._lock:
            for key in keys:
                tensor = self._memory.pop(key, None)
                if tensor is not None:
                    self._lent.discard(key)
                    dropped.append(tensor)
                self._pending.pop(key, None)
                self._referenced.pop(key, None)
            self._lock.notify_all()
        for tensor in dropped:
            self._drop(tensor)

    def in_memory(self) -> int:
        """Bytes of the snapshots held in memory (not counting the buffer pool)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._memory.values())


def _give_back(pool: BufferPool, tensor: torch.Tensor) -> None:
    """Return the whole buffer ``tensor`` views to ``pool``."""
    storage = tensor.untyped_storage()
    del tensor
    pool.give(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)))


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
                    functools.partial(table.for_writing, wait=False),
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
        if process is not None and (not recorded_now or WRITER == "process" or taken < PROCESS_MAX_BYTES):
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
        self, call: CallEntry, rows: list[TensorRow] | None, error: str | None, journal_error: str | None
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
        self._start_thread()
        if started:
            for call in lost:  # it may have written them: never write a call's file twice
                self._answered(call, None, "the writer process stopped before confirming it was written", None)

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

    def _settle(self, call: CallEntry, rows: list[TensorRow], error: str | None) -> CallEntry:
        """Drop from memory the snapshots ``rows`` describe (written), or mark ``call`` incomplete: its entry."""
        writer, table = self.writer, self._table
        if error is not None:
            entry = mark_incomplete(call, lambda k: k in writer.tensors, error)
            table.discard(k for k in call_keys(call) if k not in writer.tensors)
            with self._cond:
                self._failures.append((entry, f"iobundle could not record call {call.index}: {error}"))
            return entry
        if rows:
            files = writer.files
            table.written(rows, writer.path, {row[1]: files[row[1]].size for row in rows})
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
