"""A packed bundle: one uncompressed POSIX tar file, read in place (tensor members memory-mapped where they lie).

Why tar: a member's bytes are contiguous and start on a 512-byte boundary, so every tensor of a
safetensors member keeps the alignment it has in its own file (8 bytes at least) and is viewed
straight from one memory mapping of the whole archive; standard tools read it (``tar tf``).
A zip with stored members would need padding in its extra fields to get the same alignment.

Packing and unpacking are ``iobundle.travel``'s; a packed bundle is read-only.

A packed bundle is untrusted input. Reading its index refuses, with an
:class:`~iobundle.errors.ArchiveError` naming the archive and the member: anything but a regular
file or a directory (symbolic and hard links, devices, FIFOs, sparse files), a name that is
absolute, holds a ``..``, ``.`` or empty component, a backslash, a colon or a control character
(a leading ``./``, as ``tar cf x.tar -C run.iobundle .`` writes, is accepted),
a name given twice (or a file used as a directory), a member whose bytes run past the end of the
archive or overlap another's, more than :data:`MAX_ARCHIVE_MEMBERS` members, bytes after the last
member that are neither a tar header nor the end of the archive, and a compressed archive.
"""

from __future__ import annotations

import io
import itertools
import os
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle._locations import local_path
from iobundle._store._base import Store, check_member_name, folder_listing
from iobundle._store._fsspec import open_filesystem
from iobundle._store._local import open_regular
from iobundle._store._names import MANIFEST_FILENAME
from iobundle.errors import (
    ArchiveError,
    BundleNotFoundError,
    IntegrityError,
    IobundleError,
    TensorFileError,
    UnsafeBundleError,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["MAX_ARCHIVE_MEMBERS", "TarStore", "open_archive", "read_index"]

MAX_ARCHIVE_MEMBERS = 1_000_000
"""Most entries read from a packed bundle (a bundle holds about one file per call, at most 100 000 calls)."""

_BLOCK = tarfile.BLOCKSIZE
_COPY = 4 * 1024**2
_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}


class _Slice(io.RawIOBase):
    """``size`` bytes of ``f`` from ``offset`` on, as a file that ends there."""

    def __init__(self, f: io.RawIOBase | io.BufferedIOBase, offset: int, size: int) -> None:
        super().__init__()
        self._f = f
        self._left = size
        f.seek(offset)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._left)
        if n <= 0:
            return 0
        got = self._f.readinto(view[:n])
        got = got or 0
        self._left -= got
        return got

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()


class TarStore(Store):
    """The members of a packed bundle (read-only), indexed once by :func:`open_archive`: ``members`` maps a
    name to its offset in the archive and its size; ``size`` is the archive's, ``local`` its local path (or None)."""

    def __init__(
        self,
        path: Path | str,
        members: dict[str, tuple[int, int]],
        size: int,
        opener: Callable[[], io.RawIOBase | io.BufferedIOBase],
        local: Path | None,
    ) -> None:
        self.path = path
        self.members = members
        self.size = size
        self._opener = opener
        self.local = local
        self._mapping: torch.Tensor | None = None
        self._lock = threading.Lock()

    def describe(self, name: str) -> str:
        return f"{self.path}:{name}"

    def _span(self, name: str) -> tuple[int, int]:
        check_member_name(name)
        span = self.members.get(name)
        if span is None:
            raise TensorFileError(f"{name}: missing from the packed bundle '{self.path}'.")
        return span

    def open(self, name: str) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        offset, size = self._span(name)
        return self.open_slice(offset, size, name), size

    def map(self, name: str, size: int) -> torch.Tensor | None:
        offset, found = self._span(name)
        if found != size:
            raise IntegrityError(f"{name}: {found} bytes in '{self.path}', expected {size}.")
        whole = self.mapping()
        return None if whole is None else whole[offset : offset + size]

    def list(self, folder: str = "") -> dict[str, str]:
        return folder_listing(self.members, folder)

    def open_slice(self, offset: int, size: int, name: str) -> io.RawIOBase | io.BufferedIOBase:
        """``size`` bytes of the archive from ``offset`` on, as a file that ends there."""
        try:
            f = self._opener()
        except IobundleError:
            raise
        except Exception as exc:
            raise TensorFileError(f"{name}: cannot open the packed bundle '{self.path}' ({exc}).") from exc
        return io.BufferedReader(_Slice(f, offset, size), buffer_size=_COPY)

    def mapping(self) -> torch.Tensor | None:
        """One read-only (copy-on-write) mapping of the whole archive, made on first use; None for a remote one."""
        if self.local is None:
            return None
        with self._lock:
            if self._mapping is None:
                fd, size = open_regular(self.local, str(self.local), link_ok=True)
                os.close(fd)
                if size != self.size:  # a mapping past the end of a file is a SIGBUS, not an exception
                    raise IntegrityError(
                        f"'{self.path}': {size} bytes now, {self.size} when it was opened. The file was changed."
                    )
                self._mapping = torch.from_file(str(self.local), shared=False, size=size, dtype=torch.uint8)
            return self._mapping


def _kind(info: tarfile.TarInfo) -> str | None:
    """What is wrong with the type of ``info`` (None: a regular file or a directory)."""
    if info.type in _KINDS:
        return _KINDS[info.type]
    if info.sparse is not None or any(k.startswith("GNU.sparse") for k in info.pax_headers):
        return "a sparse file"
    if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE):
        return None
    return f"an entry of type {info.type!r}"


def read_index(f: io.RawIOBase | io.BufferedIOBase, size: int, where: str) -> dict[str, tuple[int, int]]:
    """Read and check the index of the tar archive ``f`` of ``size`` bytes: member name -> ``(offset, size)``.

    Raises:
        ArchiveError: See the module docstring.
    """
    start = f.read(_BLOCK)
    if start[:2] == b"\x1f\x8b" or start[:3] == b"BZh" or start[:6] == b"\xfd7zXZ\x00" or start[:4] == b"PK\x03\x04":
        raise ArchiveError(
            f"{where}: a compressed archive (or a zip). A packed bundle is an uncompressed tar file "
            "(iobundle pack writes one); decompress it first or unpack it with the tool that made it."
        )
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115 (closed below)
    except tarfile.TarError as exc:
        raise ArchiveError(
            f"{where}: not a tar archive ({exc}). Pass a bundle directory or a file written by iobundle pack."
        ) from exc
    members: dict[str, tuple[int, int]] = {}
    directories: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    count = 0
    try:
        while True:
            at = tar.offset
            try:
                info = tar.next()
            except (tarfile.TarError, ValueError, OverflowError, UnicodeError) as exc:
                raise ArchiveError(f"{where}: the entry at byte {at} is not a valid tar header ({exc}).") from exc
            if info is None:
                break
            count += 1
            if count > MAX_ARCHIVE_MEMBERS:
                raise ArchiveError(
                    f"{where}: more than {MAX_ARCHIVE_MEMBERS} entries (MAX_ARCHIVE_MEMBERS). "
                    "The file is corrupt or hostile."
                )
            tar.members.clear()  # type: ignore[attr-defined]  # (not in typeshed) the index below is all we keep
            name = info.name
            if name.startswith("./"):  # `tar cf x.tar -C run.iobundle .` names members ./manifest.json
                name = name[2:]
            if name in (".", "") and info.isdir():
                continue
            label = f"{where}: member {name!r}"
            kind = _kind(info)
            if kind is not None:
                raise ArchiveError(f"{label} is {kind}; a packed bundle holds regular files only.", member=name)
            try:
                check_member_name(name)
            except UnsafeBundleError as exc:
                raise ArchiveError(f"{label}: {exc}", member=name) from exc
            if name in members or name in directories:
                raise ArchiveError(f"{label} appears twice; refusing to choose one.", member=name)
            if info.isdir():
                directories.add(name)
                continue
            if info.size < 0 or info.offset_data + info.size > size:
                raise ArchiveError(
                    f"{label}: {info.size} bytes from byte {info.offset_data} run past the end of the archive "
                    f"({size} bytes). The file is truncated or hostile.",
                    member=name,
                )
            members[name] = (info.offset_data, info.size)
            spans.append((info.offset, info.offset_data + info.size, name))
        end = tar.offset
    finally:
        tar.close()
    if end < size:
        f.seek(end)
        block = f.read(_BLOCK)
        if block.strip(b"\x00"):
            raise ArchiveError(
                f"{where}: the bytes at offset {end}, after the last member, are neither a tar header nor the "
                "end of the archive. The file is corrupt or hostile."
            )
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise ArchiveError(f"{where}: members {a!r} and {b!r} overlap. The file is hostile.", member=b)
    for name in members:
        parent = PurePosixPath(name).parent
        while str(parent) != ".":
            if str(parent) in members:
                raise ArchiveError(
                    f"{where}: member {name!r} lies under {str(parent)!r}, which is a file.", member=name
                )
            parent = parent.parent
    return members


def open_archive(location: str | os.PathLike[str]) -> TarStore:
    """Index the packed bundle at ``location`` (a local file or a URL).

    Raises:
        BundleNotFoundError: ``location`` does not exist or holds no ``manifest.json``.
        ArchiveError: The archive is invalid or hostile (see the module docstring).
    """
    local = local_path(location)
    opener: Callable[[], io.RawIOBase | io.BufferedIOBase]
    if local is not None:
        try:
            fd, size = open_regular(local, str(local), link_ok=True)
        except TensorFileError as exc:
            raise BundleNotFoundError(f"'{location}': {exc}") from exc
        os.close(fd)
        where = str(local)

        def opener() -> io.RawIOBase | io.BufferedIOBase:
            fd, _ = open_regular(local, str(local), link_ok=True)
            return os.fdopen(fd, "rb", buffering=0)

        path: Path | str = local
    else:
        url = str(location)
        fs, inner = open_filesystem(url)
        try:
            size = int(fs.info(inner)["size"])
        except FileNotFoundError as exc:
            raise BundleNotFoundError(f"'{url}' does not exist.") from exc
        where = url

        def opener() -> io.RawIOBase | io.BufferedIOBase:
            return fs.open(inner, "rb")

        path = url
    try:
        with opener() as f:
            members = read_index(f, size, where)
    except IobundleError:
        raise
    except OSError as exc:
        raise ArchiveError(f"{where}: cannot be read ({exc.strerror or exc}).") from exc
    if MANIFEST_FILENAME not in members:
        raise BundleNotFoundError(
            f"'{where}' is a tar archive without {MANIFEST_FILENAME}. Is it a bundle packed by iobundle pack?"
        )
    return TarStore(path, members, size, opener, local)
