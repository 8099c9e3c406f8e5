"""What every backend of the store does: :class:`Store`, and the rule for a member's name.

A bundle's files are *members*, named relative to the bundle (``manifest.json``,
``calls/000003.safetensors``). Every read is :meth:`Store.open`, which refuses, in this order, a
name that leaves the bundle (:func:`check_member_name`), a link on any component of it (where the
backend can tell), and anything but a regular file; it gives the member's size, which callers
compare with the manifest's before reading a byte. Writers use :meth:`Store.write` (atomic: a
reader sees the old member or the whole new one), :meth:`Store.append` and :meth:`Store.remove`;
a read-only store (a packed file) refuses them.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

from iobundle._paths import DIR, FILE
from iobundle.errors import BundleNotFoundError, BundleWriteError, TensorFileError, UnsafeBundleError
from iobundle.schema import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, MEMBER_NAME_RULE, is_member_name

if TYPE_CHECKING:
    import torch

__all__ = ["Store", "check_member_name", "folder_listing"]

PLAIN_MEMBER = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/)*[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A relative path of plain components: no ``.`` or ``..``, no separator but ``/``, no colon or control
character; such a name needs no further check of its text (:func:`check_member_name`)."""


def check_member_name(name: str) -> PurePosixPath:
    """``name`` as a path, when it stays inside the bundle.

    Raises:
        UnsafeBundleError: ``name`` is empty, not a string, absolute, or has ``..``, a backslash,
            a colon or a control character.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeBundleError(f"File name {name!r} in the manifest is empty or not a string.")
    if not is_member_name(name):
        raise UnsafeBundleError(
            f"File name {name!r} in the manifest is not a plain relative path inside the bundle "
            f"(it must be {MEMBER_NAME_RULE}); refusing to open it."
        )
    return PurePosixPath(name)


class Store(ABC):
    """A bundle's members, wherever they lie.

    Attributes:
        path: Where the bundle lies (a directory, a packed file, a URL), as messages name it.
        read_only: Whether :meth:`write`, :meth:`append` and :meth:`remove` are refused.
    """

    path: Path | str
    read_only = False

    def describe(self, name: str) -> str:
        """How messages name the member ``name``."""
        return f"{self.path}/{name}"

    def check(self, name: str) -> None:
        """Refuse the member name ``name`` when it leaves the bundle or leads through a link.

        Raises:
            UnsafeBundleError: See :func:`check_member_name`; or a component is a link.
        """
        check_member_name(name)

    def check_all(self, names: Iterable[str]) -> None:
        """:meth:`check` each of ``names`` (a backend may do it in bulk)."""
        for name in names:
            self.check(name)

    @abstractmethod
    def open(self, name: str) -> tuple[BinaryIO, int]:
        """The member ``name`` opened for reading, at its first byte, and its size.

        Raises:
            UnsafeBundleError: See :meth:`check`.
            TensorFileError: It is missing, unreadable, or not a regular file.
        """

    def map(self, name: str, size: int) -> torch.Tensor | None:
        """The first ``size`` bytes of member ``name`` (checked by :meth:`open` to have them) as a uint8
        tensor viewing a memory mapping, or None where the store cannot map (the caller reads them)."""
        return None

    @abstractmethod
    def list(self, folder: str = "") -> dict[str, str]:
        """What the folder ``folder`` (``""``: the root) holds: name -> kind (``iobundle._paths.FILE``, ``DIR``,
        ``LINK``, ``OTHER``), empty when it does not exist.

        Raises:
            UnsafeBundleError: ``folder`` leaves the bundle or leads through a link.
        """

    def read(self, name: str, limit: int) -> bytes:
        """The whole member ``name``, refused over ``limit`` bytes.

        Raises:
            UnsafeBundleError: It is over ``limit`` (or see :meth:`open`).
            TensorFileError: See :meth:`open`; or it was cut short.
        """
        f, size = self.open(name)
        with f:
            if size > limit:
                raise UnsafeBundleError(
                    f"{self.describe(name)}: {size} bytes, over the limit of {limit} bytes. The file is corrupt or hostile."
                )
            try:
                data = f.read(size + 1)
            except OSError as exc:
                raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
        if len(data) != size:
            raise TensorFileError(f"{self.describe(name)}: {len(data)} bytes read, {size} expected; it was changed.")
        return bytes(data)

    def read_manifest(self) -> bytes:
        """The bytes of ``manifest.json``, refused over :data:`iobundle.schema.MAX_MANIFEST_BYTES`.

        Raises:
            BundleNotFoundError: There is none.
            UnsafeBundleError: It is over the limit.
        """
        try:
            return self.read(MANIFEST_FILENAME, MAX_MANIFEST_BYTES)
        except TensorFileError as exc:
            raise BundleNotFoundError(
                f"No {MANIFEST_FILENAME} at '{self.path}'. Is it a bundle saved with observer.save()? ({exc})"
            ) from exc

    def write(self, name: str, data: bytes) -> None:
        """Make the member ``name`` hold ``data``, atomically: a reader sees the old member or the new one.

        Raises:
            BundleWriteError: It cannot be written, or the store is read-only.
        """
        self._refuse_write(name)

    def append(self, name: str, data: bytes) -> None:
        """Add ``data`` at the end of member ``name`` (created when missing).

        Raises:
            BundleWriteError: It cannot be written, or the store is read-only.
        """
        self._refuse_write(name)

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove the member ``name`` (a regular file, never through a link).

        Raises:
            FileNotFoundError: It is missing and not ``missing_ok``.
            UnsafeBundleError: It, or a folder above it, is a link, or it is not a regular file.
            BundleWriteError: It cannot be removed, or the store is read-only.
        """
        self._refuse_write(name)

    def _refuse_write(self, name: str) -> None:
        raise BundleWriteError(f"{self.describe(name)}: '{self.path}' is read-only (a packed bundle); unpack it first.")


def folder_listing(names: Iterable[str], folder: str) -> dict[str, str]:
    """What the folder ``folder`` holds, given every file's member name (an index, a dictionary): name -> kind."""
    prefix = f"{check_member_name(folder)}/" if folder else ""
    found: dict[str, str] = {}
    for name in names:
        if name.startswith(prefix):
            first, _, rest = name[len(prefix) :].partition("/")
            found[first] = DIR if rest else FILE
    return found
