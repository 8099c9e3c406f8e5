"""What every backend of the store does (:class:`Store`), and the rule for a member's name.

A bundle's files are *members*, named relative to the bundle (``manifest.json``,
``calls/000003.safetensors``). Every read is :meth:`Store.open`, which refuses, in this order, a
name that leaves the bundle (:func:`check_member_name`), a link on any component of it (where the
backend can tell), and anything but a regular file; it gives the member's size, which callers
compare with the manifest's before reading a byte. Writers use :meth:`Store.write` (atomic),
:meth:`Store.append` and :meth:`Store.remove`; a packed file refuses them.
"""

from __future__ import annotations

import io
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from iobundle._paths import DIR, FILE
from iobundle._store._names import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, MEMBER_NAME_RULE, is_member_name
from iobundle.errors import BundleNotFoundError, BundleWriteError, TensorFileError, UnsafeBundleError

if TYPE_CHECKING:
    import torch

__all__ = ["Store", "check_member_name", "folder_listing"]

PLAIN_MEMBER = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/)*[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A relative path of plain components, which needs no further check (:func:`check_member_name`)."""


def check_member_name(name: str) -> PurePosixPath:
    """``name`` as a path, when it stays inside the bundle (:func:`iobundle.schema.is_member_name`); else UnsafeBundleError."""
    if not is_member_name(name):
        raise UnsafeBundleError(
            f"File name {name!r} in the manifest is not a plain relative path inside the bundle "
            f"(it must be {MEMBER_NAME_RULE}); refusing to open it."
        )
    return PurePosixPath(name)


class Store(ABC):
    """A bundle's members, wherever they lie; :attr:`path` is where (a directory, a packed file, a URL).

    Errors: a name that leaves the bundle, or a link, is an UnsafeBundleError; a member that is
    missing, unreadable or not a regular file a TensorFileError; a failed write a BundleWriteError.
    """

    path: Path | str

    def describe(self, name: str) -> str:
        """How messages name the member ``name``."""
        return f"{self.path}/{name}"

    def check(self, name: str) -> None:
        """Refuse ``name`` when it leaves the bundle or leads through a folder that is a link."""
        check_member_name(name)

    def check_all(self, names: Iterable[str]) -> None:
        """:meth:`check` each of ``names`` (a backend may do it in bulk)."""
        for name in names:
            self.check(name)

    @abstractmethod
    def open(self, name: str) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        """The member ``name`` opened for reading at its first byte, and its size (every check made)."""

    def map(self, name: str, size: int) -> torch.Tensor | None:
        """The first ``size`` bytes of ``name`` (which :meth:`open` said it has) as a uint8 tensor viewing a
        memory mapping, or None where the store cannot map (the caller reads them)."""
        return None

    @abstractmethod
    def list(self, folder: str = "") -> dict[str, str]:
        """What ``folder`` (``""``: the root) holds: name -> kind (``iobundle._paths.FILE``, ``DIR``, ``LINK``,
        ``OTHER``); empty when it does not exist."""

    def read(self, name: str, limit: int, *, appended: bool = False) -> bytes:
        """The whole member ``name``, refused (UnsafeBundleError) over ``limit`` bytes.

        ``appended``: a file a live writer appends to (a journal): its bytes as long as it was when opened.
        """
        f, size = self.open(name)
        with f:
            if size > limit:
                raise UnsafeBundleError(
                    f"{self.describe(name)}: {size} bytes, over the limit of {limit} bytes. The file is corrupt or hostile."
                )
            try:
                data = f.read(size if appended else size + 1)
            except OSError as exc:
                raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
        if len(data) != size:
            raise TensorFileError(f"{self.describe(name)}: {len(data)} bytes read, {size} expected; it was changed.")
        return bytes(data)

    def read_manifest(self) -> bytes:
        """The bytes of ``manifest.json`` (at most MAX_MANIFEST_BYTES); BundleNotFoundError when there is none."""
        try:
            return self.read(MANIFEST_FILENAME, MAX_MANIFEST_BYTES)
        except TensorFileError as exc:
            raise BundleNotFoundError(
                f"No {MANIFEST_FILENAME} at '{self.path}'. Is it a bundle saved with observer.save()? ({exc})"
            ) from exc

    def write(self, name: str, data: bytes) -> None:
        """Make member ``name`` hold ``data``, atomically: a reader sees the old member or the new one."""
        self._refuse_write(name)

    def append(self, name: str, data: bytes) -> None:
        """Add ``data`` at the end of member ``name`` (created when missing)."""
        self._refuse_write(name)

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove the regular file ``name``, never through a link (FileNotFoundError when missing, unless ``missing_ok``)."""
        self._refuse_write(name)

    def prune(self, names: Iterable[str]) -> None:  # noqa: B027 (most stores have no folders of their own)
        """Remove the folders of the members ``names`` left empty (where a store has folders of its own)."""

    def _refuse_write(self, name: str) -> None:
        raise BundleWriteError(f"{self.describe(name)}: '{self.path}' is read-only (a packed bundle); unpack it first.")


def folder_listing(names: Iterable[str], folder: str) -> dict[str, str]:
    """What ``folder`` holds, given every file's member name (an index, a dictionary): name -> kind."""
    prefix = f"{check_member_name(folder)}/" if folder else ""
    found: dict[str, str] = {}
    for name in names:
        if name.startswith(prefix):
            first, _, rest = name[len(prefix) :].partition("/")
            found[first] = DIR if rest else FILE
    return found
