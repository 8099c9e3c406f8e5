"""Append calls' small tensors to a segment file (format version 4): no header, one hashed range per call.

A segment holds the bytes of many calls back to back, each call's bytes once, at the end, never
rewritten: a call costs one ``pwritev`` (and an fsync when durable), no file creation and no
header. What the bytes are is the manifest's business (``FileEntry.ranges``, ``TensorEntry.offset``,
see :mod:`iobundle.schema._compact`); a range counts only once the manifest (or the journal line)
that names it is written, so bytes a failed or killed write left past the last range are never
read, and the next call's bytes go over them.
"""

from __future__ import annotations

import os
from pathlib import Path

from iobundle.calls._hashing import WRITE_HASH, new_hasher
from iobundle.errors import BundleWriteError
from iobundle.schema import FileEntry

__all__ = ["SegmentWriter"]

_IOV_MAX = 1024


class SegmentWriter:
    """One segment file being appended to, opened once (created, never through a link).

    Args:
        path: The segment; it must not exist (it is created with ``O_EXCL``, without following a link).

    Raises:
        FileExistsError: ``path`` exists (another writer's segment: take the next name).
        BundleWriteError: The file cannot be created.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self.ranges: list[tuple[int, int, int, str]] = []
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd: int | None = os.open(path, flags, 0o644)
        except FileExistsError:
            raise
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot create {path}: {exc.strerror or exc}. Check free space and permissions."
            ) from exc

    def append(self, call: int, parts: list[memoryview], *, durable: bool) -> tuple[int, int, int, str]:
        """Write ``parts`` after the last range, as call ``call``'s range; return ``(call, start, length, digest)``.

        Raises:
            BundleWriteError: The bytes cannot be written; the segment's ranges are unchanged.
        """
        assert self._fd is not None, "the segment is closed"
        hasher = new_hasher(WRITE_HASH)
        length = 0
        for part in parts:
            hasher.update(part)
            length += len(part)
        start = self.size
        try:
            done = os.pwritev(self._fd, parts, start) if len(parts) <= _IOV_MAX else 0
            if done < length:  # a short write (rare on a regular file): the rest, in one piece
                view = memoryview(b"".join(parts))[done:]
                while view:
                    view = view[os.pwrite(self._fd, view, start + length - len(view)) :]
            if durable:
                os.fsync(self._fd)
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot append call {call}'s tensors to {self.path}: {exc.strerror or exc}. Check free space."
            ) from exc
        found = (call, start, length, hasher.hexdigest())
        self.ranges.append(found)
        self.size = start + length
        return found

    def entry(self) -> FileEntry:
        """The segment's file entry, as its ranges stand now (a copy: later appends do not change it)."""
        return FileEntry.model_construct(size=self.size, hash=WRITE_HASH, ranges=list(self.ranges))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
