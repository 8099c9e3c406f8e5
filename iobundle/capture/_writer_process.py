"""The stream's writer process: writes the calls a recording process hands it through shared memory.

On the recording thread a call costs its snapshot, one copy of its new tensors into a ring of
shared memory and a small message (the call entry and where its tensors are in the ring). The
writer process, started in the background when the stream opens, does everything else with its
own interpreter lock: delta checks, headers, hashing, file creation, the journal. It answers,
in call order and many calls at once, what it wrote; the recording process's reader thread turns the
answers into the stream's bookkeeping (where each tensor is, the failures reported). A call's CPU
snapshots leave the recording process's memory once copied into the ring; the calls of a child
that dies before writing them get them back from the ring, the calls its journal lists stay written.
The child's own code is :mod:`iobundle.capture._writer_child`.

- The ring is an anonymous memory file (``memfd_create``; else an unlinked temporary file)
  handed to the child as a descriptor: no name outlives a SIGKILL, nothing is left to clean up.
  A call takes one contiguous range; the child copies it out and releases it before writing.
- The child is a fresh interpreter (``subprocess`` with ``pass_fds``: fork and exec, never a fork
  that goes on running Python next to torch's threads, and never a re-import of the user's
  ``__main__`` as multiprocessing's spawn does). It imports the writer (torch and the project's
  write path: the delta checks and the file writer are torch code) once, while the model runs,
  and the later streams of the process reuse it (one stream at a time per child).
- The child reads its pipe until end of file: when the recording process dies, even by SIGKILL,
  the child writes every call it received, then exits (no orphan, nothing received is lost).
- The child ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group): the
  recording process decides when the stream ends, and :meth:`WriterProcess.close` waits for it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from iobundle.calls import Packed, PinnedStager, dtype_name
from iobundle.capture._call_json import CallJson
from iobundle.capture._entries import TensorRow, call_keys, unpack_answer
from iobundle.capture._writer import BundleWriter
from iobundle.errors import BundleWriteError
from iobundle.schema import CallEntry, FileEntry

__all__ = ["WriterProcess", "WriterProcessUnavailable"]

RING_BYTES = 4 * 1024 * 1024
"""Initial size of the shared ring; it grows for a call that does not fit, and back to this size between
streams once larger than :data:`POPULATED_MAX_BYTES`."""

POPULATED_MAX_BYTES = 64 * 1024 * 1024
"""A ring up to this size is mapped with its pages in place (``MAP_POPULATE``, where the system has it): one
system call, about 0.3 µs a page already allocated, 0.9 µs a new one. Mapped lazily, the copy on the model's
thread faults at each page it touches first, 2.7 µs a page (measured: 30 faults per 32-layer decode call, as
each stream's ring was grown, mapped again and shrunk back). A larger ring (grown for a large call) is mapped
lazily, and not kept between streams."""


def map_ring(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of the ring's file ``fd``, shared, with its pages in place up to :data:`POPULATED_MAX_BYTES`."""
    populate = getattr(mmap, "MAP_POPULATE", 0) if size <= POPULATED_MAX_BYTES else 0
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)


ANSWERS_AT_ONCE = 16
"""The child answers up to this many calls in one message. Each message wakes the recording process's
reader thread, which then takes the interpreter lock from the model at its next torch op: answered one
by one, the model's thread of a 32-layer decode step waited 0.7-1.1 ms per call for the lock, and
recording added 2.9-3.5 ms per call; answered in sixteens, 1.6-1.9 ms (2-core machine, figure 1f's
model, runs under SCHED_FIFO)."""

ANSWER_AFTER_IDLE_S = 0.02
"""The child answers the calls it wrote once no call came for this long (or at once, ``durable``;
and whenever the recording process asks: :meth:`WriterProcess.wait_idle`, the end of the stream). A
decode loop hands it a call every few milliseconds: one answer per :data:`ANSWERS_AT_ONCE` calls.
Until then, reading one of its snapshots back waits for the answer, then reads its file."""

POLL_S = 0.001
"""While calls come (and the stream is not ``durable``), the child looks for the next one this often
without waiting on its pipe: a write to a pipe a process waits on wakes that process, at the writer's
cost (28 µs of the recording thread's CPU per call measured, 2-core VM; 4-10 µs to a pipe no one waits
on). After :data:`ANSWER_AFTER_IDLE_S` without a call it waits on the pipe again."""

CONSUMED_EARLY_BYTES = 1024 * 1024
"""A call whose tensors take at least this much of the ring gets its range back as soon as the child
copied them out (a message of its own); a smaller one with its answer."""

MAX_IN_FLIGHT = 64
"""Calls handed to the child and not confirmed yet, at most (a slow disk makes submit wait)."""

RING_ALIGN = 64
"""Each call's range of the ring, and each tensor in it, starts at a multiple of this many bytes (any dtype's view)."""

_InRing = tuple[list[str], torch.dtype, tuple[int, ...], int, int, int]
"""CPU snapshots of one dtype and shape copied into the ring: ``(keys, dtype, shape, offset, nbytes, step)``."""

# done(call, the rows of the tensors written (or packed: entries.pack_answer) or None, write error or None,
# journal error or None)
Done = Callable[[CallEntry, list[TensorRow] | bytes | None, str | None, str | None], None]


class WriterProcessUnavailable(Exception):
    """The writer process cannot be started here (never raised to the user: the stream writes with a thread)."""


def _memory_file() -> int:
    """A descriptor of an anonymous file in memory (no name: nothing outlives the processes)."""
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create("iobundle-ring", getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            pass
    folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryFile(dir=folder) as f:  # unlinked already
        return os.dup(f.fileno())


CAT_MIN_TENSORS = 16
"""A run of at least this many same-shape CPU tensors (a deep cache's layers) goes into the ring in one
``torch.cat``: 8.8 µs for 16 tensors of 1.3 KiB where a ``memmove`` each takes 9.7 (its call costs more than
the copy), 26 µs for 64 of 4 KiB against 38; below, the op's fixed cost loses (4 tensors: 6.7 µs against 2.7)."""


def _copy_run(tensors: list[torch.Tensor], into: torch.Tensor) -> None:
    """Copy contiguous CPU tensors of one dtype and shape into the bytes ``into``, back to back, in one torch op."""
    first = tensors[0]
    with torch.no_grad():  # a tensor that requires grad cannot be copied into out= otherwise
        torch.cat(tensors, out=into.view(first.dtype).view(-1, *first.shape[1:]))


_Plan = tuple[
    list[tuple[list[str], tuple[Any, ...]]],  # the message's specs: (keys, spec)
    list[_InRing],  # the CPU groups copied into the ring
    list[tuple[list[torch.Tensor], int, int, int]],  # what to copy: (tensors, offset, nbytes, step)
    list[tuple[torch.Tensor, int, int]],  # device tensors, for one packed copy: (tensor, offset, nbytes)
    int,  # the bytes the call takes in the ring
]


def _plan(keys: list[str], tensors: list[torch.Tensor | Exception], names: dict[torch.dtype, str]) -> _Plan:
    """Where each new tensor of a call goes in the ring, and what the child is told of it.

    Contiguous CPU tensors of one dtype and shape in a row (a cache's layers) share one spec: the
    child finds each at the next aligned offset. ``names`` caches the safetensors name of each dtype met.
    Once per new tensor of every call: kept lean (a loop, where ``map`` over torch's attributes was slower).
    """
    specs: list[tuple[list[str], tuple[Any, ...]]] = []
    in_ring: list[_InRing] = []
    copies: list[tuple[list[torch.Tensor], int, int, int]] = []
    on_device: list[tuple[torch.Tensor, int, int]] = []
    group: list[str] = []
    run: list[torch.Tensor] = []
    last_dtype = last_shape = None
    total = nbytes = step = 0
    cpu, strided = True, torch.strided
    for key, tensor in zip(keys, tensors):
        if isinstance(tensor, Exception):  # its snapshot is gone: the child reports the call incomplete
            specs.append(([key], ("error", type(tensor).__name__, str(tensor))))
            last_dtype = None
            continue
        dtype, shape = tensor.dtype, tensor.shape
        if not (
            dtype is last_dtype
            and shape == last_shape
            and tensor.is_cpu  # only CPU tensors share a spec: a device tensor is checked on its own
            and tensor.layout is strided
            and tensor.is_contiguous()
        ):
            name = names.get(dtype)
            if name is None and (name := dtype_name(dtype)) is not None:
                names[dtype] = name
            if name is None or tensor.layout is not strided or not tensor.is_contiguous():
                specs.append(([key], ("unsupported", str(dtype))))
                last_dtype = None
                continue
            nbytes, cpu = tensor.nbytes, tensor.is_cpu
            step = (nbytes + RING_ALIGN - 1) & -RING_ALIGN
            group, dims = [key], tuple(shape)
            specs.append((group, ("tensor", name, dims, "cpu" if cpu else str(tensor.device), total, nbytes)))
            last_dtype, last_shape = (dtype, dims) if cpu else (None, None)
            if cpu:
                in_ring.append((group, dtype, dims, total, nbytes, step))
                run = []
                copies.append((run, total, nbytes, step))
        else:
            group.append(key)  # a CPU tensor, as the group's first
        if nbytes and cpu:
            run.append(tensor)
        elif nbytes:
            on_device.append((tensor, total, nbytes))
        total += step
    return specs, in_ring, copies, on_device, total


class _Ring:
    """The shared memory file, mapped here; calls take contiguous ranges, released in the order taken."""

    def __init__(self, size: int) -> None:
        self.fd = _memory_file()
        self.size = 0
        self._map: mmap.mmap | None = None
        self.view: torch.Tensor | None = None
        self._spans: deque[tuple[int, int, int]] = deque()  # (seq, start, end), in allocation order
        self.resize(size)

    def resize(self, size: int) -> None:
        """Map ``size`` bytes (growing keeps the bytes and offsets of the ranges taken)."""
        self.view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with it
        os.ftruncate(self.fd, size)
        self._map = map_ring(self.fd, size)
        with torch.inference_mode(False):  # a normal tensor: later streams copy into it outside inference_mode
            self.view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.size = size

    def grow_for(self, n: int) -> None:
        """Grow so that ``n`` bytes fit after the ranges taken (once :meth:`take` found no room), unless they wrap.

        A call larger than the free space is not kept waiting for the child (which may still be starting).
        """
        spans = self._spans
        if spans and spans[-1][1] < spans[0][1]:
            return  # wrapped: the ranges before the end free up first
        head = spans[-1][2] if spans else 0
        if head + n > self.size:
            self.resize(-(-max(2 * self.size, 2 * (head + n)) // mmap.PAGESIZE) * mmap.PAGESIZE)

    def take(self, seq: int, n: int) -> int | None:
        """The start of a free range of ``n`` bytes for call ``seq``, or None while there is none."""
        if n == 0:
            return 0
        n = -(-n // RING_ALIGN) * RING_ALIGN  # the next range starts aligned for every dtype
        spans, start = self._spans, None
        if not spans:
            start = 0 if n <= self.size else None
        else:
            head, tail = spans[-1][2], spans[0][1]
            if spans[-1][1] >= tail:  # the taken ranges do not wrap around the end
                if head + n <= self.size:
                    start = head
                elif n <= tail:
                    start = 0
            elif head + n <= tail:
                start = head
        if start is not None:
            spans.append((seq, start, start + n))
        return start

    def release(self, seq: int) -> None:
        for i, span in enumerate(self._spans):
            if span[0] == seq:
                del self._spans[i]
                return

    def close(self) -> None:
        self.view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
        os.close(self.fd)


CHILD_NICE = 10
"""The writer process lowers its priority by this much. A message wakes it for every call; at the
parent's priority the scheduler of a busy machine then often runs it on the model's core at once,
and the model waits out the child's work on its call (measured: a 32-layer decode step streamed at
2.0-2.4x the plain one under load, 1.3x niced). Niced, it yields to the model it serves; an idle core
runs it all the same.
"""

PIPE_BYTES = 1024 * 1024
"""The pipe to the child holds this many bytes of messages (Linux; 64 KiB elsewhere): a few dozen
calls' entries, so that a burst of calls (or a child slowed down by another process) does not make
the model's thread wait in ``write``."""


def _widen(fd: int) -> None:
    """Grow the pipe ``fd`` to :data:`PIPE_BYTES` where the system allows it (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    import fcntl

    setpipe = getattr(fcntl, "F_SETPIPE_SZ", 1031)
    for size in (PIPE_BYTES, PIPE_BYTES // 4):
        try:
            fcntl.fcntl(fd, setpipe, size)
            return
        except OSError:  # above /proc/sys/fs/pipe-max-size for this user
            continue


class _Child:
    """A writer process, its pipes and its ring; reused by the streams of this process one after another."""

    def __init__(self) -> None:
        if not sys.executable:
            raise WriterProcessUnavailable("no Python executable to start (sys.executable is empty)")
        self.ring = ring = _Ring(RING_BYTES)
        fds: list[int] = []
        try:
            to_child, from_child = os.pipe(), os.pipe()
            fds = [*to_child, *from_child]
            root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
            env.setdefault("OMP_NUM_THREADS", "1")  # the child's torch ops are copies and comparisons
            # not the current folder first (``-c`` puts it there): a folder named iobundle would shadow this package
            code = "import sys; del sys.path[0]; from iobundle.capture._writer_child import serve; serve()"
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(to_child[0]), str(from_child[1]), str(ring.fd)],
                pass_fds=(to_child[0], from_child[1], ring.fd),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            ring.close()
            raise WriterProcessUnavailable(f"{type(exc).__name__}: {exc}") from exc
        os.close(to_child[0])
        os.close(from_child[1])
        _widen(to_child[1])
        _widen(from_child[0])  # answers too: a batch of them in a 64 KiB pipe made the child wait for the reader
        self.out = Connection(to_child[1], readable=False)
        self.inbox = Connection(from_child[0], writable=False)
        self.started = False  # it answered once: it runs the writer
        with _CHILDREN_LOCK:
            _CHILDREN.add(self)

    def send(self, message: tuple[Any, ...]) -> None:
        self.out.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self) -> tuple[Any, ...]:
        message: tuple[Any, ...] = pickle.loads(self.inbox.recv_bytes())
        return message

    def end(self) -> int:
        """Close the pipes (the child writes what it received, then exits) and wait for it; its exit code."""
        with _CHILDREN_LOCK:
            _CHILDREN.discard(self)
        self.out.close()
        self.inbox.close()
        code = self.proc.wait()
        self.ring.close()
        return code

    @classmethod
    def take(cls) -> _Child:
        """An idle child of an earlier stream, else a new one (started in the background)."""
        with _CHILDREN_LOCK:
            while _IDLE:
                child = _IDLE.pop()
                if child.proc.poll() is None:
                    return child
        return cls()

    def give_back(self) -> None:
        """Keep the child for the next stream; a ring grown by large calls goes back to its first size (one
        grown by small calls in flight stays as it is, mapped: the next stream would grow it again)."""
        if self.ring.size > POPULATED_MAX_BYTES:
            self.ring.resize(RING_BYTES)  # its memory is freed: no range is taken between streams
        with _CHILDREN_LOCK:
            _IDLE.append(self)


_CHILDREN: set[_Child] = set()
_IDLE: list[_Child] = []
_CHILDREN_LOCK = threading.Lock()


def _after_fork() -> None:
    """In a forked copy of this process, drop the pipes to the writer processes: only the parent feeds them
    (a copy holding them would keep a child of a killed parent waiting for more)."""
    for child in list(_CHILDREN):
        for conn in (child.out, child.inbox):
            try:
                conn.close()
            except OSError:
                pass
    _CHILDREN.clear()
    _IDLE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class WriterProcess:
    """Hands the recorded calls of one stream to a writer process; answers come back through ``done``, in order.

    Args:
        writer: The stream's writer: the bundle is prepared and its journal started. What the
            child writes is added to it (:meth:`BundleWriter.adopt`) as the answers come.
        get: The snapshots of keys, in order: each a tensor, or the exception its key raised (the stream's table).
        durable: The child fsyncs each call, and :meth:`submit` waits for the previous call.
        done: Called by the reader thread for each call: ``(call, the rows of the tensors written, packed
            as :func:`~iobundle.capture._entries.pack_answer` packs them, or None, write error or None,
            journal error or None)``.
        gone: Called once by the reader thread if the child ends before :meth:`close`, with the
            calls it never answered, whether it had started (else it wrote none of them) and why.
        idle: Called by the reader thread when every call handed over is answered.

    Raises:
        WriterProcessUnavailable: No process can be started.
    """

    def __init__(
        self,
        writer: BundleWriter,
        get: Callable[[list[str]], list[torch.Tensor | Exception]],
        *,
        released: Callable[[list[_InRing]], None],
        restored: Callable[[str, torch.Tensor], None],
        durable: bool,
        done: Done,
        gone: Callable[[list[CallEntry], bool, str], None],
        idle: Callable[[], None],
    ) -> None:
        self.path = writer.path
        self._writer = writer
        self._get = get
        self._released = released
        self._restored = restored
        self._rings: dict[int, tuple[int, list[_InRing]]] = {}  # seq -> where its CPU snapshots are in the ring
        self._on_device: set[int] = set()  # the calls with device snapshots, held in memory until answered
        self._durable = durable
        self._done = done
        self._gone = gone
        self._idle = idle
        self._sent: set[str] = set(writer.tensors)
        self._json = CallJson()
        self._names: dict[torch.dtype, str] = {}  # the dtypes met, by safetensors name
        self._resend = False  # set when keys handed over were not written: serialise every node again
        self._stager = PinnedStager()  # CUDA tensors: one packed copy per device into pinned memory
        self._staged: tuple[tuple[Any, ...], list[Packed]] | None = None  # a call waiting for its device copies
        self._calls: dict[int, CallEntry] = {}
        self._seq = 0
        self._closing = False
        self._dead = False
        self._closed_error: str | None = None
        self._copying = 0  # copies into the ring in progress, outside the lock
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._child = child = _Child.take()
        ring = child.ring
        state = pickle.dumps(
            (str(writer.path), writer.tensors, writer.files, sorted(writer.call_indices), durable),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        # the state goes through the ring: a pipe would make this wait for a child still starting
        ring.grow_for(len(state))
        start = ring.take(0, len(state))
        assert start == 0 and ring.view is not None
        ring.view[: len(state)].copy_(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._reader = threading.Thread(target=self._read, name=f"iobundle-writer-reader:{self.path.name}", daemon=True)
        try:
            child.send(("start", len(state), ring.size))
        except OSError:
            self._dead = True  # the child died already: the reader thread reports it once started

    def start(self) -> None:
        """Start reading the child's answers (``done``, ``gone`` and ``idle`` may be called from now on)."""
        self._reader.start()

    def submit(self, call: CallEntry) -> bool:
        """Copy the new tensors of ``call`` into the ring and hand it to the child; False if the child is gone.

        False means the call is the caller's to write: it was never handed over, and the reader
        thread will not report it among the calls the child lost (it would be written twice).
        """
        with self._submit_lock:
            self._flush()  # the previous call's device copies, first: messages go in call order, and it holds room
            if self._resend:  # the child failed a call: its unwritten tensors go again, whichever nodes hold them
                self._json, self._resend = CallJson(), False
            call_json, met = self._json(call)
            sent = self._sent
            new = [k for k in dict.fromkeys(met) if k not in sent]
            specs, in_ring, runs, on_device, total = _plan(new, self._get(new), self._names)
            ring = self._child.ring
            with self._cond:
                self._seq += 1
                seq = self._seq
                while True:
                    if self._dead:
                        return False
                    busy = len(self._calls) >= (1 if self._durable else MAX_IN_FLIGHT)
                    start = None if busy else ring.take(seq, total)
                    if start is None and not busy:
                        ring.grow_for(total)
                        start = ring.take(seq, total)
                    if start is not None:
                        break
                    # not asked to answer now (a message sent under the condition could wait on a full pipe
                    # while the reader waits for the condition): it answers within ANSWER_AFTER_IDLE_S anyway
                    self._cond.wait()
                self._calls[seq] = call
                self._rings[seq] = (start, in_ring)
                if on_device:
                    self._on_device.add(seq)
                view = ring.view
                self._copying += 1
            assert view is not None
            base, memmove = view.data_ptr() + start, ctypes.memmove
            try:
                for tensors, offset, nbytes, step in runs:  # without the lock
                    if len(tensors) >= CAT_MIN_TENSORS and step == nbytes and tensors[0].dim():  # back to back
                        _copy_run(tensors, view[start + offset : start + offset + nbytes * len(tensors)])
                        continue
                    for tensor in tensors:
                        memmove(base + offset, tensor.data_ptr(), nbytes)
                        offset += step
            finally:
                self._copied()
            self._released(in_ring)  # the child answers many calls later: memory keeps none of these
            self._sent.update(new)
            message = ("call", seq, call_json, start, specs)
            if on_device:  # sent by the next submit (or close): the copies run meanwhile
                self._staged = (message, self._stager.to_pinned(on_device))
                return True
            return self._send(message)

    def _restore(self, rings: list[tuple[int, list[_InRing]]]) -> None:
        """Hand the table back the CPU snapshots of calls the child never wrote, read from the ring (still mapped)."""
        view = self._child.ring.view
        if view is None:
            return
        for start, groups in rings:
            for keys, dtype, shape, offset, nbytes, step in groups:
                begin = start + offset
                for key in keys:
                    self._restored(key, view[begin : begin + nbytes].view(dtype).reshape(shape).clone())
                    begin += step

    def _copied(self) -> None:
        """A copy into the ring is over: the reader thread may unmap it now (torch's view of it does not hold it)."""
        with self._cond:
            self._copying -= 1
            if not self._copying:
                self._cond.notify_all()

    def _send(self, message: tuple[Any, ...]) -> bool:
        """Send a call's message (with the ring's size now); False if the child is gone and the call is the caller's."""
        seq = message[1]
        try:
            self._child.send((*message, self._child.ring.size))
        except OSError:  # the child is gone and never read this call
            with self._cond:
                if seq not in self._calls:
                    return True  # the reader thread took it among the calls lost, and reports it
                del self._calls[seq]  # the caller writes it: it is not reported lost too
                ring = self._rings.pop(seq, None)
                self._copying += 1  # the ring stays mapped while its snapshots are read back
            try:
                if ring is not None:
                    self._restore([ring])
            finally:
                self._copied()
            with self._cond:
                self._child.ring.release(seq)
            return False
        return True

    def _flush(self) -> None:
        """Finish the staged call: wait for its device copies, move them into its ring range, send it.

        Were the child gone, the call stays among those handed over: the reader thread reports it lost.
        """
        staged, self._staged = self._staged, None
        if staged is None:
            return
        message, pinned = staged
        with self._cond:
            if self._dead:  # the ring may be gone: the call is among the lost ones the reader reports
                return
            self._copying += 1
            view = self._child.ring.view
        assert view is not None
        try:
            self._stager.land(pinned, view.data_ptr() + message[3])
        finally:
            self._copied()
        try:
            self._child.send((*message, self._child.ring.size))
        except OSError:
            pass  # the child is gone: the call is among those handed over, which the reader thread reports

    def tell(self, written: list[tuple[int, list[TensorRow]]], files: dict[str, FileEntry]) -> None:
        """What another writer of the stream wrote meanwhile: ``(call index, rows)`` pairs, and the files.

        The child takes them in (a later call that holds those tensors refers to them) and is never
        handed their tensors again.
        """
        rows = [row for _, call_rows in written for row in call_rows]
        named = {row[1]: files[row[1]] for row in rows if row[1] in files}
        with self._submit_lock:
            self._flush()
            self._sent.update(row[0] for row in rows)
            try:
                self._child.send(("adopt", [index for index, _ in written], rows, named))
            except OSError:
                pass  # the child is gone: the reader thread reports it

    def wait_idle(self) -> None:
        """Wait until the child has answered every call handed to it (or is gone)."""
        with self._submit_lock:
            self._flush()
            if self._calls:  # read without the condition: a call answered meanwhile costs one message
                self._ask()
        with self._cond:
            while self._calls and not self._dead:
                self._cond.wait()

    def _ask(self) -> None:
        """Ask the child to answer the calls it wrote now, not after :data:`ANSWER_AFTER_IDLE_S` (holding the submit lock)."""
        try:
            self._child.send(("answer",))
        except OSError:
            pass  # the child is gone: the reader thread reports it

    def close(self) -> None:
        """Wait until the child has written every call and synced its files (unless durable).

        Raises:
            BundleWriteError: The child could not flush its files, or ended before finishing.
        """
        with self._submit_lock:
            self._flush()
            with self._cond:
                self._closing = True
                dead = self._dead
            if not dead:
                try:
                    self._child.send(("close",))
                except OSError:
                    pass
        self._reader.join()
        if self._closed_error is not None:
            raise BundleWriteError(self._closed_error)

    def wait_gone(self) -> None:
        """Wait until the reader thread has reported the child gone (after :meth:`submit` returned False)."""
        self._reader.join()

    # -- the reader thread ----------------------------------------------------------------------

    def _read(self) -> None:
        child, ring = self._child, self._child.ring
        reason = "it ended"
        finished = False
        try:
            while not self._dead:
                message = child.receive()
                kind = message[0]
                child.started = True
                if kind == "consumed":
                    with self._cond:
                        ring.release(message[1])
                        self._cond.notify_all()
                elif kind == "done":  # the answers of one call or more, in call order
                    for seq, index, packed, error, journal_error in message[1]:
                        rows: list[TensorRow] | bytes = packed
                        if seq in self._on_device:  # its device snapshots leave memory with the answer: unpacked now
                            self._on_device.discard(seq)
                            rows, files = unpack_answer(packed)
                            self._writer.adopt(index, rows, files)
                        else:
                            self._writer.adopt_packed(index, packed)
                        with self._cond:
                            call = self._calls[seq]
                        if error is not None:
                            self._sent.difference_update(k for k in call_keys(call) if k not in self._writer.tensors)
                            self._resend = True
                        self._done(call, rows if error is None else None, error, journal_error)
                        with self._cond:
                            ring.release(seq)  # the child is done with its range (if it did not say so earlier)
                            del self._calls[seq]
                            self._rings.pop(seq, None)
                            idle = not self._calls
                            self._cond.notify_all()
                    if idle:
                        self._idle()
                elif kind == "closed":
                    self._closed_error = message[1]
                    finished = True
                    return
        except (EOFError, OSError) as exc:
            reason = f"it ended: {type(exc).__name__}"
        except Exception as exc:  # a bug here must not hang the model's thread
            reason = f"its answer could not be read: {exc!r}"
        finally:
            with self._cond:
                self._dead = True
                lost = [self._calls[s] for s in sorted(self._calls)]
                rings = [self._rings[s] for s in sorted(self._calls) if s in self._rings]
                self._calls.clear()
                self._rings.clear()
                closing = self._closing
                self._cond.notify_all()
            self._idle()
            with self._cond:  # a copy into the ring in progress (its range taken before the end) finishes first:
                while self._copying:  # closing or shrinking the ring unmaps it under the copy
                    self._cond.wait()
            self._restore(rings)  # before the ring goes: the lost calls' snapshots are only there
            if finished:
                child.give_back()
            else:
                code = child.end()
                if closing and not lost:
                    self._closed_error = (
                        f"iobundle's writer process for '{self.path}' ended ({reason}, exit code {code}) "
                        "before it had synced the bundle's files."
                    )
                else:
                    self._gone(lost, child.started, f"{reason}, exit code {code}")
