"""Write a file atomically: a temporary name, (fsync,) rename, (fsync of the directory). Stdlib only.

A reader, or a process that outlives a killed writer, sees either the old file or the complete
new one, never a prefix: the rename alone guarantees that, since the page cache survives the
process. The fsyncs (``durable=True``) extend the guarantee to a crash of the machine (power
loss, kernel panic): without them, the renamed file may come back empty or short after a reboot.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from iobundle._paths import CREATE
from iobundle.errors import BundleWriteError

__all__ = ["CHUNK_BYTES", "CONCURRENT_HASH_MIN_BYTES", "atomic_file", "fsync_files", "write_atomically"]

CHUNK_BYTES = 4 * 1024**2
"""Large buffers are written in pieces of this size, each handed to ``on_chunk`` once it is written."""

CONCURRENT_HASH_MIN_BYTES = 16 * 1024**2
"""From this total size on, ``on_chunk`` runs in a helper thread, concurrently with the writes
(hashlib and the write syscall both release the GIL on large buffers): a file then costs
max(write, hash) instead of their sum. Smaller files are written and hashed in one thread."""


def _open_tmp(tmp: Path) -> BinaryIO:
    return os.fdopen(os.open(tmp, CREATE, 0o644), "wb")


@contextmanager
def atomic_file(path: Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """A file opened for writing whose bytes appear at ``path`` only once the block completes.

    The block writes to ``.<name>.tmp`` beside ``path``; on a normal exit the file is flushed
    (fsynced with ``durable``), renamed to ``path``, and the directory fsynced (``durable``). On
    an exception the temporary file is removed and ``path`` is left as it was. For callers that
    stream their bytes (``os.copy_file_range`` into ``f.fileno()`` included: flush first); see
    :func:`write_atomically` for buffers already in memory.

    Raises:
        BundleWriteError: The file cannot be written (an ``OSError``, in the block or after it,
            becomes one naming ``path``); an ``IobundleError`` from the block passes unchanged.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with _open_tmp(tmp) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException as exc:
        _discard(tmp, path, exc)
        raise


def _discard(tmp: Path, path: Path, exc: BaseException, *, wrap_errors: bool = False) -> None:
    """Remove the temporary file of a failed atomic write; raise ``exc`` as a ``BundleWriteError`` naming ``path``.

    An ``OSError`` always becomes one; with ``wrap_errors`` any other ``Exception`` (a failed
    callback) too. Anything else returns, for the caller to re-raise unchanged.
    """
    with suppress(OSError):
        tmp.unlink(missing_ok=True)
    if isinstance(exc, OSError):
        raise BundleWriteError(
            f"Cannot write {path}: {exc.strerror or exc}. Check free space and permissions."
        ) from exc
    if wrap_errors and isinstance(exc, Exception) and not isinstance(exc, BundleWriteError):
        raise BundleWriteError(f"Cannot write {path}: {type(exc).__name__}: {exc}") from exc


def write_atomically(
    path: Path,
    parts: Iterable[bytes | memoryview],
    *,
    on_chunk: Callable[[memoryview], None] | None = None,
    on_part: Callable[[int], None] | None = None,
    durable: bool = True,
) -> int:
    """Write the concatenation of ``parts`` to ``path`` atomically and return its size.

    Args:
        path: The final name; the bytes go to ``.<name>.tmp`` beside it, renamed once complete.
        parts: The byte buffers to write, in order. They must stay unchanged until ``on_part``
            reports them done (or the call returns).
        on_chunk: Called with every piece of at most :data:`CHUNK_BYTES`, in order, after it is
            written; from a helper thread when the file is large (:data:`CONCURRENT_HASH_MIN_BYTES`).
        on_part: Called with the index of each part once its bytes are written and passed to
            ``on_chunk`` (its buffer may be reused from then on); from the same thread as ``on_chunk``.
        durable: fsync the file before the rename and the directory after it. Without it the
            rename is still atomic for every process, but not across a crash of the machine.

    Raises:
        BundleWriteError: The file cannot be written (disk full, permission denied, ...) or a
            callback failed; the temporary file is removed and ``path`` is left as it was.
    """
    views = [memoryview(part).cast("B") for part in parts]
    total = sum(len(v) for v in views)
    tmp = path.with_name(f".{path.name}.tmp")
    helper = _Helper(on_chunk, on_part) if on_chunk is not None and total >= CONCURRENT_HASH_MIN_BYTES else None
    try:
        try:
            with _open_tmp(tmp) as f:
                for index, view in enumerate(views):
                    for start in range(0, len(view), CHUNK_BYTES):
                        chunk = view[start : start + CHUNK_BYTES]
                        f.write(chunk)
                        if helper is not None:
                            helper.put(chunk)
                            if helper.error is not None:
                                break  # the helper failed: stop writing, report it below
                        elif on_chunk is not None:
                            on_chunk(chunk)
                    if helper is not None:
                        helper.put(index)
                    elif on_part is not None:
                        on_part(index)
                    if helper is not None and helper.error is not None:
                        break
                f.flush()
                if durable and (helper is None or helper.error is None):
                    os.fsync(f.fileno())  # overlaps the end of the hashing
        except BaseException:
            if helper is not None:
                helper.finish(cancel=True)
            raise
        if helper is not None:
            helper.finish()
        if helper is not None and helper.error is not None:
            raise helper.error
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException as exc:
        _discard(tmp, path, exc, wrap_errors=True)
        raise
    return total


class _Helper:
    """A thread that passes written chunks to ``on_chunk`` and reports finished parts to ``on_part``."""

    def __init__(self, on_chunk: Callable[[memoryview], None] | None, on_part: Callable[[int], None] | None) -> None:
        self._on_chunk = on_chunk
        self._on_part = on_part
        self._queue: queue.SimpleQueue[memoryview | int | None] = queue.SimpleQueue()  # None: done
        self.error: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="iobundle-hash", daemon=True)
        self._thread.start()

    def put(self, item: memoryview | int) -> None:
        self._queue.put(item)

    def finish(self, *, cancel: bool = False) -> None:
        """Wait until every queued item is consumed (or the helper failed); ``cancel``: skip what is left."""
        if cancel:
            self._cancelled = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None or self._cancelled:
                continue  # drain without calling back
            try:
                if isinstance(item, int):
                    if self._on_part is not None:
                        self._on_part(item)
                elif self._on_chunk is not None:
                    self._on_chunk(item)
            except BaseException as exc:  # handed to the writing thread, which raises it
                self.error = exc


def fsync_dir(directory: Path) -> None:
    """fsync a directory (its entries: renames, new files), ignoring systems that cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: Iterable[Path]) -> None:
    """fsync each file of ``paths``, then each directory holding them (once).

    Raises:
        BundleWriteError: A file cannot be opened or flushed to the disk.
    """
    directories: dict[Path, None] = {}
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot flush {path} to the disk: {exc.strerror or exc}. Check the disk and free space."
            ) from exc
        directories[path.parent] = None
    for directory in directories:
        fsync_dir(directory)
