"""Write a file atomically: a temporary name, fsync, rename, fsync of the directory. Stdlib only.

A reader (or a process that survives a crash of the writer) sees either the old file or the
complete new one, never a prefix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from iobundle.errors import BundleWriteError

__all__ = ["CHUNK_BYTES", "write_atomically"]

CHUNK_BYTES = 4 * 1024**2
"""Large buffers are written in pieces of this size, each handed to ``on_chunk`` right after
it is written, while its bytes are still in the CPU cache (hashing then costs little more)."""


def write_atomically(
    path: Path, parts: Iterable[bytes | memoryview], *, on_chunk: Callable[[memoryview], None] | None = None
) -> int:
    """Write the concatenation of ``parts`` to ``path`` atomically and return its size.

    Raises:
        BundleWriteError: The file cannot be written (disk full, permission denied, ...); the
            temporary file is removed and ``path`` is left as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), CHUNK_BYTES):
                    chunk = view[start : start + CHUNK_BYTES]
                    f.write(chunk)
                    if on_chunk is not None:
                        on_chunk(chunk)
                size += len(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise BundleWriteError(
            f"Cannot write {path}: {exc.strerror or exc}. Check free space and permissions."
        ) from exc
    return size


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
