"""A bundle held in memory: member name -> bytes. No links exist; a folder is a prefix of names."""

from __future__ import annotations

import io

from iobundle._store._base import Store, check_member_name, folder_listing
from iobundle.errors import TensorFileError, UnsafeBundleError

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """The members ``files`` (name -> bytes), named ``path`` in messages."""

    def __init__(self, files: dict[str, bytes] | None = None, *, path: str = "memory") -> None:
        self.path = path
        self.files = dict(files or {})

    def _folder(self, name: str) -> bool:
        return any(n.startswith(f"{name}/") for n in self.files)

    def open(self, name: str) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        check_member_name(name)
        data = self.files.get(name)
        if data is None:
            if self._folder(name):
                raise TensorFileError(f"{name}: not a regular file (a folder) in '{self.path}'; refusing to read it.")
            raise TensorFileError(f"{name}: missing from the bundle '{self.path}'.")
        return io.BytesIO(data), len(data)

    def list(self, folder: str = "") -> dict[str, str]:
        return folder_listing(self.files, folder)

    def write(self, name: str, data: bytes) -> None:
        check_member_name(name)
        self.files[name] = bytes(data)

    def append(self, name: str, data: bytes) -> None:
        check_member_name(name)
        self.files[name] = self.files.get(name, b"") + bytes(data)

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        check_member_name(name)
        if name not in self.files:
            if self._folder(name):
                raise UnsafeBundleError(f"'{self.describe(name)}' is not a regular file; refusing to remove it.")
            if not missing_ok:
                raise FileNotFoundError(f"{self.describe(name)}: no such file")
            return
        del self.files[name]
