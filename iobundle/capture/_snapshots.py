"""The observer's tensor snapshots: taken on the model's threads, kept in memory or read back from the bundle.

:class:`SnapshotTable` is both the mapping a ``TensorCollector`` fills and the ``TensorStore``
inference reads. A snapshot is a copy (into a recycled buffer of :class:`BufferPool` while
streaming large tensors), or a reference to an output the writer process copies before the call
returns. Tensors written to the bundle stay readable: the table reads them back from their file on
demand (no cache), checking the file the way ``iobundle.replay`` checks a stranger's, so
``InputObserver.infer_*`` work on a streaming observer as on one that keeps everything in memory.
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from iobundle.calls import NAME_TO_DTYPE, buffer_size, dtype_name, parse_header, read_exactly, rebuild, tensor_span
from iobundle.capture._entries import TensorRow, unpack_answer
from iobundle.errors import TensorFileError

__all__ = ["POOLED_MIN_BYTES", "BufferPool", "SnapshotTable", "snapshot_tensor"]


POOLED_MIN_BYTES = 256 * 1024
"""Tensors at least this large are copied into recycled buffers while streaming (smaller ones come
from the allocator's heap, which is already warm)."""

BUDGET_CALLS = 1.5
"""While the writer still holds buffers of earlier calls, the pool lends at most this many times
the largest call's pooled bytes; a copy beyond it waits for the writer to return a buffer."""

_IS_CPU, _NBYTES, _VERSION = attrgetter("is_cpu"), attrgetter("nbytes"), attrgetter("_version")

_HEADER_CACHE = 64


def snapshot_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor``, detached from autograd, on the same device.

    Always a normal tensor: under ``torch.inference_mode`` a copy would be an inference tensor,
    which keeps no version counter (what tells the recorder and the writer a tensor changed).
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return tensor.detach().clone(memory_format=torch.contiguous_format)
    if tensor.requires_grad or not tensor.is_contiguous():
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return tensor.clone()  # most of a decode step's inputs: 2.5 µs, where detaching and the format cost 3.6


def _poolable(tensor: torch.Tensor) -> bool:
    return (  # the size early: most snapshots of a decode step are small
        tensor.layout == torch.strided
        and not tensor.is_nested
        and tensor.numel() * tensor.element_size() >= POOLED_MIN_BYTES
        and tensor.is_cpu
        and not tensor.is_quantized
        and type(tensor) is torch.Tensor
        and dtype_name(tensor.dtype) is not None
    )


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
            with torch.inference_mode(False):  # a normal tensor, even for a model run under inference_mode
                buf = torch.empty(buffer_size(nbytes), dtype=torch.uint8)
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
            read_exactly(f, nbytes, str(where.path), into=out.reshape(-1).view(torch.uint8).numpy().data.cast("B"))
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
            read_exactly(f, end - begin, name, into=out.reshape(-1).view(torch.uint8).numpy().data.cast("B"))
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
        self._disk: dict[str, _OnDisk | tuple[Any, ...]] = {}  # a row until first read (see written)
        self._roots: list[Path] = []  # the bundles written to: an entry names its own by index
        self._lent: set[str] = set()
        self._backlog: list[tuple[bytes, Path]] = []  # written_packed answers, applied when first needed (_drain)
        self._recycling: list[tuple[torch.Tensor, bool]] = []  # buffers written lets go, to recycle outside the lock
        self._lock = threading.Condition()
        self._reader = _FileReader()
        self.pool: BufferPool | None = None
        self.journal: list[str] | None = None
        """When a list, every key stored is appended to it (to undo a recording that failed half-way)."""
        self.retained: set[str] = set()
        """Keys the writer keeps as bases of later extensions: their buffers are never recycled."""
        self.copied_bytes = 0
        """Bytes :meth:`keep` took (copied, or referenced) since :meth:`take_copied` last reset it."""
        self.copied_off_cpu = False
        """Whether one of those copies is not on the CPU."""
        self.reference = False
        """While True, :meth:`keep` keeps a reference to a contiguous CPU tensor instead of a copy:
        set while the outputs of a call are recorded for a writer process, which copies them into
        shared memory before the call returns (the model cannot have changed them yet)."""
        self._referenced: dict[str, int] = {}  # key -> the version counter of the tensor referenced
        self.discarded = 0
        """How many times keys left the table (a recorder's memo of unchanged objects is void after one)."""

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

    def keep(self, key: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` as ``key``: a :meth:`snapshot`, or the tensor itself while :attr:`reference` allows.

        The collector's way to fill the table, once per new tensor of every call.
        """
        if (
            self.reference
            and tensor.is_cpu
            and type(tensor) is torch.Tensor
            and tensor.is_contiguous()
            and not tensor.is_inference()  # no version counter to tell whether it changed: copied
        ):
            self.copied_bytes += tensor.nbytes
            value = tensor
        else:
            value = self.snapshot(tensor)
        if key in self._pending or key in self._disk or key in self._lent:
            self[key] = value
            return
        if self.reference:
            self._referenced[key] = value._version  # a copy's counter never moves: only references are checked
        self._memory[key] = value
        if self.journal is not None:
            self.journal.append(key)

    def keep_all(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        """:meth:`keep` of each pair, in one pass for plain contiguous CPU tensors while :attr:`reference` allows.

        A decode step's cache holds a new tensor per layer: the checks run over all of them at once.
        """
        memory = self._memory
        if not (
            self.reference
            and all(map(_IS_CPU, tensors))  # the caller's are plain and versioned
            and all(map(torch.Tensor.is_contiguous, tensors))
            and memory.keys().isdisjoint(keys)
            and self._pending.keys().isdisjoint(keys)
            and self._disk.keys().isdisjoint(keys)
            and self._lent.isdisjoint(keys)
        ):
            for key, tensor in zip(keys, tensors):
                self.keep(key, tensor)
            return
        self.copied_bytes += sum(map(_NBYTES, tensors))
        self._referenced.update(zip(keys, map(_VERSION, tensors)))
        memory.update(zip(keys, tensors))
        if self.journal is not None:
            self.journal.extend(keys)

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
                self._drain()
                self._memory[key] = value
                self._pending.pop(key, None)
                self._disk.pop(key, None)
                self._lent.discard(key)
                self._lock.notify_all()
        if self.journal is not None:
            self.journal.append(key)

    def __delitem__(self, key: str) -> None:
        with self._lock:
            self._drain()
            self.discarded += 1
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

    def pop(self, key: str, *default: Any) -> Any:
        with self._lock:
            self._drain()
            self.discarded += 1
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
            meta = self._pending.get(key) or self._on_disk(key)
        if meta is None:
            raise KeyError(key)
        return meta

    def shape(self, key: str) -> tuple[int, ...]:
        tensor = self._memory.get(key)
        return tuple(tensor.shape) if tensor is not None else self._meta(key).shape

    def dtype(self, key: str) -> torch.dtype:
        tensor = self._memory.get(key)
        return tensor.dtype if tensor is not None else self._meta(key).dtype

    def get(self, key: str, *default: Any) -> Any:
        """The tensor of ``key``: the snapshot itself while in memory, else a copy read from its file."""
        with self._lock:
            self._drain()
            while key in self._pending or self._changed(key):  # its file is being written: wait for it
                self._lock.wait()
                self._drain()
            tensor = self._memory.get(key)
            if tensor is not None:
                self._lent.add(key)  # handed out: its buffer is never recycled
                return tensor.detach() if key in self._referenced else tensor
            where = self._on_disk(key)
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
                self._drain()
                while base in self._pending:
                    self._lock.wait()
                    self._drain()
                found = self._on_disk(base)
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
        if wait and not tensor.is_cpu:  # a CPU tensor has no event (and a failed getattr costs an exception)
            event = getattr(tensor, "_iobundle_ready", None)
            if event is not None:
                event.synchronize()
        return tensor

    def all_for_writing(self, keys: list[str]) -> list[torch.Tensor | Exception]:
        """:meth:`for_writing` of each key, not waiting for device copies: its tensor, or what it raised."""
        memory, referenced = self._memory, self._referenced
        out: list[torch.Tensor | Exception] = []
        for key in keys:
            tensor = memory.get(key)
            if tensor is not None:
                version = referenced.get(key)
                if version is None or tensor._version == version:
                    out.append(tensor)  # the common case, inline
                    continue
            try:
                out.append(self.for_writing(key, wait=False))
            except Exception as exc:
                out.append(exc)
        return out

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

    def in_ring(self, groups: list[tuple[list[str], torch.dtype, tuple[int, ...], int, int, int]]) -> None:
        """The bytes of these CPU snapshots (``(keys, dtype, shape, ...)`` groups) are in a writer process's ring.

        Memory lets them go at once (a pooled buffer back to the pool, a tensor of the model's
        referenced let go): the child answers many calls at once, and a snapshot kept until then
        would outlive a young collection, for Python's full collections to walk. The keys stay
        readable, ``get`` waiting for :meth:`written` or :meth:`discard`.
        """
        pool, recycle = self.pool, []
        memory, pending, referenced, lent = self._memory, self._pending, self._referenced, self._lent
        with self._lock:
            for keys, dtype, shape, *_ in groups:
                meta = _Pending(dtype=dtype, shape=shape, device="cpu")
                for key in keys:
                    tensor = memory.pop(key, None)
                    if tensor is None:
                        continue
                    pending[key] = meta
                    if referenced.pop(key, None) is None and tensor.nbytes >= POOLED_MIN_BYTES:
                        recycle.append((tensor, key in lent or key in self.retained))
        for tensor, kept in recycle:
            if not kept and pool is not None and _poolable(tensor):
                _give_back(pool, tensor)
            else:
                self._drop(tensor)

    def restored(self, key: str, tensor: torch.Tensor) -> None:
        """The snapshot of ``key``, let go into a writer process's ring that will not write it, is ``tensor`` again."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                self._memory[key] = tensor
                self._lock.notify_all()

    def written(self, rows: Iterable[TensorRow], root: Path, sizes: dict[str, int]) -> None:
        """Forget the snapshots of the tensors ``rows`` describe, now in their files; recycle their buffers.

        ``root`` is the bundle's directory and ``sizes`` the size of each file the rows name (a
        segment's once their bytes were written). A row that extends another tensor holds the part
        past that tensor's, which this table knows (written before, or earlier in ``rows``).
        Where each went is worked out when it is first read back (:meth:`_on_disk`): a decode step's
        answer costs two dictionary operations per tensor on the thread that settles it.
        """
        with self._lock:
            self._drain()
            self._written(rows, root, sizes)
            self._lock.notify_all()
        self._recycle()

    def written_packed(self, packed: bytes, root: Path) -> None:
        """:meth:`written` of a writer process's answer as it came (:func:`~iobundle.capture._entries.pack_answer`),
        applied when first needed: a read that waits for a key, a key leaving the table.

        Called by the thread that reads the writer process's answers, which holds the interpreter lock the
        model's thread waits for: a list append, where unpickling a 32-layer decode call's rows and applying
        them was most of that thread's work. Its keys stay readable meanwhile (pending, as before the answer).
        """
        with self._lock:
            self._backlog.append((packed, root))
            self._lock.notify_all()

    def _drain(self) -> None:
        """Apply the answers :meth:`written_packed` kept (under the lock); their buffers are recycled by :meth:`_recycle`."""
        if self._backlog:
            backlog, self._backlog = self._backlog, []
            for packed, root in backlog:
                rows, files = unpack_answer(packed)
                self._written(rows, root, {name: entry.size for name, entry in files.items()})

    def _written(self, rows: Iterable[TensorRow], root: Path, sizes: dict[str, int]) -> None:
        """:meth:`written` under the lock; the buffers to recycle go to ``_recycling``."""
        pool = self.pool
        memory, pending, disk, referenced, lent = self._memory, self._pending, self._disk, self._referenced, self._lent
        recycle = self._recycling
        if root not in self._roots:
            self._roots.append(root)
        root_index = self._roots.index(root)  # an int in the entry: the collector untracks it
        for row in rows:
            key = row[0]
            if pending.pop(key, None) is not None:
                tensor = None  # its buffer went back to the pool already
            else:
                tensor = memory.pop(key, None)
                if tensor is None:
                    continue  # not a snapshot of this table
            disk[key] = (row, root_index, sizes[row[1]])  # the row says the dtype and device
            if referenced.pop(key, None) is not None:
                lent.discard(key)
                continue  # the model's own tensor: nothing of the pool's to give back
            if tensor is not None and pool is not None:
                recycle.append((tensor, key in lent or key in self.retained))
            lent.discard(key)

    def _recycle(self) -> None:
        """Give the buffers :meth:`_written` let go back to the pool (outside the lock)."""
        with self._lock:
            recycle, self._recycling = self._recycling, []
        for tensor, kept in recycle:
            if not kept and _poolable(tensor):
                _give_back(self.pool, tensor)  # type: ignore[arg-type]  # recycle is filled only with a pool
            else:
                self._drop(tensor)

    def _on_disk(self, key: str) -> _OnDisk | None:
        """Where ``key`` went (None if not written), under the lock: made from its row on first use."""
        where = self._disk.get(key)
        if where is None or type(where) is _OnDisk:
            return where
        (_, file, name, dtype, shape, device, ext, offset), root_index, size = where
        stored: Any = None  # a list, then the tuple _OnDisk holds
        if ext is not None:
            base: Any = self._disk.get(ext[0]) or self._pending.get(ext[0]) or self._memory.get(ext[0])
            if base is not None:
                base_shape = base[0][4] if type(base) is tuple else base.shape
                stored = list(shape)
                stored[ext[1]] -= base_shape[ext[1]]
                stored = tuple(stored)
        where = _OnDisk(
            self._roots[root_index] / file, name, NAME_TO_DTYPE[dtype], tuple(shape), device, size, ext, stored, offset
        )
        self._disk[key] = where
        return where

    def discard(self, keys: Iterable[str]) -> None:
        """Drop the in-memory snapshots of ``keys`` (they could not be written)."""
        dropped = []
        with self._lock:
            self._drain()
            self.discarded += 1
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
    pool.give(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
