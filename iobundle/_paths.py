"""Names resolved under a checked directory, no link followed on any component. Stdlib only.

Every file the project reads from a bundle, an archive's folder or a program index, and every
file it writes or removes in a bundle directory, is reached through a :class:`Tree`: the root
directory is opened once (the caller's own path: links above and at the root are the user's
choice), and every folder below it is opened from its parent's descriptor with ``O_NOFOLLOW``
(``openat``), once per folder. A component that is a symbolic link is refused with an error
naming its path: a link may lead anywhere, and a bundle never needs one. Files are judged by
one listing of their folder (``scandir`` of the descriptor), not by a ``stat`` or ``realpath``
each, so opening a bundle of thousands of calls costs one listing of ``calls/``. Writes and
removals (:meth:`Tree.open`, :meth:`Tree.unlink`, :meth:`Tree.rmdir`, :meth:`Tree.replace`) act
on the folder's descriptor, so a folder swapped for a link after the check is never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from iobundle.errors import IobundleError, UnsafeBundleError

__all__ = [
    "CLOEXEC",
    "CREATE",
    "DIR",
    "FILE",
    "LINK",
    "MISSING",
    "NOFOLLOW",
    "OTHER",
    "Tree",
    "link_message",
]

FILE, DIR, LINK, OTHER, MISSING = "file", "dir", "link", "other", "missing"
"""What a listing says an entry is (never following a link)."""

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""The open flags of every file of a bundle: never through a link, never inherited by a child process."""
CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW | CLOEXEC | getattr(os, "O_BINARY", 0)
"""How a file is (re)made, a temporary file first: never through a link planted at its name."""
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC


def link_message(path: object) -> str:
    """The reason every refusal of a link gives."""
    return (
        f"'{path}' is a symbolic link; iobundle never follows a link inside a bundle or an index's folder "
        "(one may lead outside it). Replace the link by a copy of what it points to."
    )


def _kind(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return LINK
    if entry.is_file(follow_symlinks=False):
        return FILE
    if entry.is_dir(follow_symlinks=False):
        return DIR
    return OTHER


def _kind_of_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return LINK
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISDIR(mode):
        return DIR
    return OTHER


class Tree:
    """A directory whose folders are opened once each, from their parent, never through a link.

    Args:
        root: The directory. It is opened as given (links above it and at it are followed: the
            caller chose the path); nothing below it is.
        error: The error raised for a link (or a component that is not a folder), naming its path.

    Use it as a context manager (or call :meth:`close`): it holds one descriptor per folder opened.
    A missing root is not an error until a folder or file under it is needed.
    """

    def __init__(self, root: str | os.PathLike[str], *, error: type[IobundleError] = UnsafeBundleError) -> None:
        self.path = Path(root)
        self.error = error
        self._fds: dict[tuple[str, ...], int] = {}
        self._listings: dict[tuple[str, ...], dict[str, str]] = {}

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every descriptor held (the listings stay cached)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def _display(self, parts: Iterable[str]) -> Path:
        return self.path.joinpath(*parts)

    def folder(self, parts: tuple[str, ...], *, create: bool = False) -> int | None:
        """The descriptor of folder ``parts`` under the root, or None when it does not exist (and not ``create``).

        Raises:
            IobundleError: (``error``) A component is a link, or not a folder.
            OSError: The folder cannot be opened or created (permissions).
        """
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        if not parts:
            try:
                fd = os.open(self.path, _ROOT_FLAGS)
            except FileNotFoundError:
                if not create:
                    return None
                self.path.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, _ROOT_FLAGS)
            except NotADirectoryError as exc:
                if os.path.lexists(self.path):
                    raise self.error(f"'{self.path}' is not a folder.") from exc
                if not create:
                    return None
                raise  # a component above the root is a file: the root cannot be made (the caller's write error)
            self._fds[parts] = fd
            return fd
        parent = self.folder(parts[:-1], create=create)
        if parent is None:
            return None
        name = parts[-1]
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):  # made meanwhile (or a dangling link: the open below says which)
                os.mkdir(name, 0o777, dir_fd=parent)
            self._listings.pop(parts[:-1], None)
            return self.folder(parts, create=False)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                kind = self._lstat(parent, name)
                if kind == LINK:
                    raise self.error(link_message(self._display(parts))) from exc
                raise self.error(f"'{self._display(parts)}' is not a folder ({kind}).") from exc
            raise
        self._fds[parts] = fd
        return fd

    @staticmethod
    def _lstat(parent: int, name: str) -> str:
        try:
            return _kind_of_mode(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return MISSING

    def listing(self, parts: tuple[str, ...]) -> dict[str, str]:
        """What folder ``parts`` holds, by name (one ``scandir`` per folder, cached); empty when it does not exist."""
        found = self._listings.get(parts)
        if found is None:
            fd = self.folder(parts)
            if fd is None:
                return {}
            with os.scandir(fd) as entries:
                found = self._listings[parts] = {e.name: _kind(e) for e in entries}
        return found

    def kind(self, name: str | tuple[str, ...]) -> str:
        """What the member ``name`` (``/``-separated, relative) is: :data:`FILE`, :data:`DIR`, :data:`LINK`, ...

        Its folders are checked (a link among them raises); the member itself is looked up in its
        folder's listing, and, when the listing lacks it (made since), by one ``lstat`` of that name.
        """
        parts = tuple(name.split("/")) if isinstance(name, str) else name
        folder = parts[:-1]
        kind = self.listing(folder).get(parts[-1])
        if kind is None:
            fd = self.folder(folder)
            kind = MISSING if fd is None else self._lstat(fd, parts[-1])
        return kind

    def check_file(self, name: str | tuple[str, ...], *, where: str | None = None) -> Path:
        """The path of member ``name`` after checking that neither it nor a folder above it is a link.

        A missing member is returned as well (its open says it is missing).

        Raises:
            IobundleError: (``error``) ``name`` or one of its folders is a link.
        """
        parts = tuple(name.split("/")) if isinstance(name, str) else name
        if self.kind(parts) == LINK:
            message = link_message(self._display(parts))
            raise self.error(f"{where}: {message}" if where else message)
        return self._display(parts)

    def open(self, name: str, flags: int, mode: int = 0o644, *, create_folders: bool = False) -> int:
        """``os.open`` of member ``name`` from its folder's descriptor, with ``O_NOFOLLOW``.

        Raises:
            IobundleError: (``error``) A folder on the way, or the member, is a link.
            OSError: As ``os.open`` (missing, permissions, ...).
        """
        *folder, base = name.split("/")
        fd = self.folder(tuple(folder), create=create_folders)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self._display(name.split("/"))))
        try:
            return os.open(base, flags | NOFOLLOW | CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and self._lstat(fd, base) == LINK):
                raise self.error(link_message(self._display(name.split("/")))) from exc
            raise

    def unlink(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove the regular file ``name`` (never through a link: its folders are opened without following one).

        Raises:
            IobundleError: (``error``) ``name`` or a folder above it is a link, or it is not a regular file.
            OSError: It cannot be removed.
        """
        parts = tuple(name.split("/"))
        fd = self.folder(parts[:-1])
        kind = MISSING if fd is None else self._lstat(fd, parts[-1])
        if kind == MISSING:
            if missing_ok:
                return
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self._display(parts)))
        if kind == LINK:
            raise self.error(link_message(self._display(parts)))
        if kind != FILE:
            raise self.error(f"'{self._display(parts)}' is not a regular file ({kind}); refusing to remove it.")
        assert fd is not None
        os.unlink(parts[-1], dir_fd=fd)
        self._listings.pop(parts[:-1], None)

    def rmdir(self, parts: tuple[str, ...]) -> bool:
        """Remove the empty folder ``parts`` (not the root); False when it is not empty or not there."""
        parent = self.folder(parts[:-1])
        if parent is None or self._lstat(parent, parts[-1]) != DIR:
            return False
        fd = self._fds.pop(parts, None)
        if fd is not None:
            os.close(fd)
        try:
            os.rmdir(parts[-1], dir_fd=parent)
        except OSError:
            return False
        self._listings.pop(parts[:-1], None)
        return True

    def replace(self, source: str, target: str) -> None:
        """Rename member ``source`` to ``target``, both in checked folders (``renameat``)."""
        *src_folder, src = source.split("/")
        *dst_folder, dst = target.split("/")
        src_fd = self.folder(tuple(src_folder))
        dst_fd = self.folder(tuple(dst_folder))
        if src_fd is None or dst_fd is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self.path / source))
        os.replace(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        self._listings.pop(tuple(dst_folder), None)
