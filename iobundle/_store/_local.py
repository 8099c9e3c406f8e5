"""A bundle directory: every member reached from the root without following a link (:class:`iobundle._paths.Tree`).

Each folder (``calls/``) is opened from the root without following a link and listed once; a member
then costs a lookup in that listing and is opened with ``O_NOFOLLOW``: a link is refused wherever it
points. Tensor files are memory-mapped.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from iobundle._lazy import lazy_module
from iobundle._paths import CLOEXEC, CREATE, LINK, NOFOLLOW, Tree, link_message
from iobundle._store._base import PLAIN_MEMBER, Store, check_member_name
from iobundle._store._names import temporary_name
from iobundle.errors import BundleWriteError, IobundleError, TensorFileError, UnsafeBundleError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["LocalStore", "open_regular"]

READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | CLOEXEC | getattr(os, "O_BINARY", 0)
"""How a member is opened for reading: without blocking (a FIFO would), never through a link (``NOFOLLOW``)."""


def open_regular(path: Path, name: str, *, link_ok: bool = False) -> tuple[int, int]:
    """Open ``path`` read-only without blocking, never through a link (but with ``link_ok``: a path the user gave);
    return ``(fd, size)``. Refuses anything but a regular file."""
    try:
        fd = os.open(path, READ_FLAGS if link_ok else READ_FLAGS | NOFOLLOW)
    except FileNotFoundError as exc:
        raise TensorFileError(f"{name}: missing from the bundle.") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeBundleError(f"{name}: {link_message(path)}") from exc
        raise TensorFileError(f"{name}: cannot be opened ({exc.strerror or exc}).") from exc
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TensorFileError(f"{name}: not a regular file (a directory, FIFO or device); refusing to read it.")
    return fd, info.st_size


class LocalStore(Store):
    """The bundle directory ``path``.

    Args:
        path: The directory (links above it and at it are the user's choice; nothing below it is followed).
        error: What a link (or a component that is not a folder) raises.
    """

    path: Path

    def __init__(self, path: str | os.PathLike[str], *, error: type[IobundleError] = UnsafeBundleError) -> None:
        self.path = Path(path)
        self._error = error
        self._tree = Tree(self.path, error=error)
        self._names: dict[str, tuple[str, ...]] = {}
        self._lock = threading.RLock()  # the tree's descriptors are opened and closed by one reader at a time

    def _parts(self, name: str) -> tuple[str, ...]:
        parts = self._names.get(name) if isinstance(name, str) else None
        if parts is None:
            plain = isinstance(name, str) and PLAIN_MEMBER.fullmatch(name)
            parts = self._names[name] = tuple(name.split("/")) if plain else check_member_name(name).parts
        return parts

    def file(self, name: str) -> Path:
        """The path of member ``name``, checked as :meth:`check` does (it may be missing)."""
        parts = self._parts(name)
        if len(parts) == 1:  # in the root, nothing to list: the open's O_NOFOLLOW refuses a link
            return self.path / name
        with self._lock:
            try:
                return self._tree.check_file(parts, where=f"File {name!r}")
            except IobundleError:
                raise
            except OSError as exc:
                raise UnsafeBundleError(f"File {name!r} cannot be resolved inside the bundle: {exc}.") from exc
            finally:
                self._tree.close()  # the listings stay: a bundle held open holds no descriptor

    def check(self, name: str) -> None:
        self.file(name)

    def check_all(self, names: Iterable[str]) -> None:
        """One listing per folder, one lookup per name."""
        tree = self._tree
        with self._lock:
            try:
                for name in names:
                    parts = self._parts(name)
                    kind = tree.listing(parts[:-1]).get(parts[-1])
                    if kind == LINK:
                        raise UnsafeBundleError(f"File {name!r}: {link_message(self.path.joinpath(*parts))}")
                    if kind is None:  # made since the listing: in full
                        self.file(name)
            except IobundleError:
                raise
            except OSError as exc:
                raise UnsafeBundleError(f"Files of the bundle cannot be listed: {exc}.") from exc
            finally:
                tree.close()

    def open(self, name: str) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        fd, size = open_regular(self.file(name), name)
        return os.fdopen(fd, "rb", buffering=0), size

    def map(self, name: str, size: int) -> torch.Tensor:
        return torch.from_file(str(self.file(name)), shared=False, size=size, dtype=torch.uint8)

    def list(self, folder: str = "") -> dict[str, str]:
        with Tree(self.path, error=self._error) as tree:  # listed now, not the listing cached for reading
            return dict(tree.listing(self._parts(folder) if folder else ()))

    def write(self, name: str, data: bytes) -> None:
        self._put(name, data, temporary_name(name))

    def append(self, name: str, data: bytes) -> None:
        self._put(name, data, None)

    def _put(self, name: str, data: bytes, tmp: str | None) -> None:
        """Write ``data`` to ``tmp``, flushed to the disk, then rename it ``name``; or append it to ``name`` (no ``tmp``)."""
        self._parts(name)
        try:
            flags = CREATE if tmp else os.O_WRONLY | os.O_APPEND | os.O_CREAT
            with os.fdopen(self._tree.open(tmp or name, flags, create_folders=True), "wb") as f:
                f.write(data)
                if tmp:
                    f.flush()
                    os.fsync(f.fileno())
            if tmp:
                self._tree.replace(tmp, name)
                folder = self._tree.folder(self._parts(name)[:-1])
                if folder is not None:  # made by the open above
                    os.fsync(folder)
        except IobundleError:
            raise
        except OSError as exc:
            with contextlib.suppress(OSError, IobundleError):
                if tmp:
                    self._tree.unlink(tmp, missing_ok=True)
            raise BundleWriteError(f"Cannot write {self.path / name}: {exc.strerror or exc}.") from exc
        finally:
            self._tree.close()

    def prune(self, names: Iterable[str]) -> None:
        """Remove the folders of the members ``names`` that are left empty, deepest first (never the root)."""
        try:
            for parts in sorted({self._parts(n)[:-1] for n in names}, key=len, reverse=True):
                while parts and self._tree.rmdir(parts):  # only when empty
                    parts = parts[:-1]
        finally:
            self._tree.close()

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        self._parts(name)
        try:
            self._tree.unlink(name, missing_ok=missing_ok)
        finally:
            self._tree.close()
