"""Append calls' small tensors to a segment, a safetensors file whose header is written when it is sealed.

A segment (format version 6, see ``docs/format.md``) is ``[8-byte header length][header][data]``:
the header region is reserved at creation, and each call's small tensors are appended after the
data so far, as one range (one ``pwritev``, an fsync when durable, no file creation); a range
counts once a manifest or journal line names it, so bytes a failed or killed write left past the
last range are never read. Until sealed, the header length reads 0. :meth:`SegmentWriter.seal`
cuts the file at its size, writes the header (each tensor named ``callNNNNNN/PATH``,
``__metadata__`` mapping names to keys), then its length, last: a writer killed while sealing
leaves the segment unsealed, never torn.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from iobundle._paths import CLOEXEC, NOFOLLOW
from iobundle.calls._hashing import WRITE_HASH, new_hasher
from iobundle.errors import BundleWriteError
from iobundle.schema import FileEntry

__all__ = ["SegmentWriter", "seal_segment", "segment_header", "segment_header_entry"]

_IOV_MAX = 1024
_HEAD = b'{"__metadata__":{"format":"pt"'  # then ,NAME:KEY per tensor, }, and ,NAME:{...} per tensor

_FLAGS = NOFOLLOW | CLOEXEC


def segment_header_entry(
    name: str, key: str, dtype: str, shape: Sequence[int], begin: int, end: int
) -> tuple[bytes, bytes]:
    """The two parts of a sealed header for one tensor: ``,"NAME":"KEY"`` (metadata) and ``,"NAME":{...}``.

    ``begin`` and ``end`` are relative to the data area (safetensors' ``data_offsets``).
    """
    quoted, dims = json.dumps(name), ",".join(map(str, shape))
    info = f'{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{begin},{end}]}}'  # a dtype name needs no escape
    return f",{quoted}:{json.dumps(key)}".encode(), f",{quoted}:{info}".encode()


def segment_header(entries: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The sealed header of a segment whose tensors' :func:`segment_header_entry` parts are ``entries``."""
    return b"".join([_HEAD, *(m for m, _ in entries), b"}", *(t for _, t in entries), b"}"])


class SegmentWriter:
    """One segment file being appended to, opened once (created, never through a link).

    Args:
        path: The segment; it must not exist (it is created with ``O_EXCL``, without following a link).
        header_bytes: The header region to reserve (a multiple of 8): the data starts at ``8 + header_bytes``.

    Raises:
        FileExistsError: ``path`` exists (another writer's segment: take the next name).
        BundleWriteError: The file cannot be created.
    """

    def __init__(self, path: Path, header_bytes: int) -> None:
        self.path = path
        self.data_start = 8 + header_bytes
        self.size = self.data_start
        self.ranges: list[tuple[int, int, int, str]] = []
        self.entries: list[tuple[bytes, bytes]] = []
        self._header_used = len(segment_header([]))
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, 0o644)
        except FileExistsError:
            raise
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot create {path}: {exc.strerror or exc}. Check free space and permissions."
            ) from exc

    def fits(self, entries: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the sealed header still fits its region with ``entries`` added."""
        return self._header_used + sum(len(m) + len(t) for m, t in entries) <= self.data_start - 8

    def append(
        self, call: int, parts: list[memoryview], entries: Sequence[tuple[bytes, bytes]], *, durable: bool
    ) -> tuple[int, int, int, str]:
        """Write ``parts`` after the last range, as call ``call``'s range; return ``(call, start, length, digest)``.

        ``entries`` are the header parts of its tensors (:func:`segment_header_entry`), which must :meth:`fit`.

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
        self.entries.extend(entries)
        self._header_used += sum(len(m) + len(t) for m, t in entries)
        self.size = start + length
        return found

    def entry(self) -> FileEntry:
        """The segment's file entry, as its ranges stand now (a copy: later appends do not change it)."""
        return FileEntry.model_construct(size=self.size, hash=WRITE_HASH, ranges=list(self.ranges))

    def seal(self, *, durable: bool) -> None:
        """Cut the file at its size, write the header of every tensor appended, then its length (see the module docstring).

        Raises:
            BundleWriteError: The header cannot be written (the ranges stand: the journal still reads them).
        """
        assert self._fd is not None, "the segment is closed"
        _seal(self._fd, self.path, self.size, self.data_start, self.entries, durable=durable)

    def close(self, *, durable: bool = False) -> None:
        """Seal the segment (when it holds a range) and close it."""
        try:
            if self.ranges and self._fd is not None:
                self.seal(durable=durable)
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)


def _seal(
    fd: int, path: Path, size: int, data_start: int, entries: Sequence[tuple[bytes, bytes]], *, durable: bool
) -> None:
    region = data_start - 8
    text = segment_header(entries)
    if len(text) > region:
        raise BundleWriteError(f"Cannot seal {path}: its header needs {len(text)} bytes, {region} are reserved.")
    try:
        os.ftruncate(fd, size)  # what a failed or killed append left past the last range
        os.pwrite(fd, text + b" " * (region - len(text)), 8)
        if durable:
            os.fsync(fd)
        os.pwrite(fd, struct.pack("<Q", region), 0)  # last: sealed from here on
        if durable:
            os.fsync(fd)
    except OSError as exc:
        raise BundleWriteError(f"Cannot seal {path}: {exc.strerror or exc}. Check free space.") from exc


def seal_segment(
    path: Path, entry: FileEntry, entries: Callable[[], Sequence[tuple[bytes, bytes]]], *, durable: bool
) -> bool:
    """Seal the segment ``path`` that another writer left unsealed (a writer process that died); False if sealed.

    ``entry`` is its manifest entry and ``entries()`` the header parts of its tensors, in file order: called
    only for a segment left unsealed (every segment of a stream is checked when it closes, most are sealed).

    Raises:
        BundleWriteError: The file cannot be opened or sealed.
    """
    try:
        fd = os.open(path, os.O_RDWR | _FLAGS)
    except OSError as exc:
        raise BundleWriteError(f"Cannot seal {path}: {exc.strerror or exc}.") from exc
    try:
        if any(os.pread(fd, 8, 0)):
            return False
        _seal(fd, path, entry.size, (entry.ranges or [(0, 8, 0, "")])[0][1], entries(), durable=durable)
        return True
    finally:
        os.close(fd)
