"""Bundle directories at URLs, read through fsspec: members are read (not memory-mapped), checked as local ones are."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle._paths import link_message, reported_link
from iobundle._remote import join_url, open_filesystem
from iobundle.calls import check_member_name
from iobundle.errors import BundleNotFoundError, ManifestError, TensorFileError, UnsafeBundleError
from iobundle.schema import MANIFEST_FILENAME, MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["RemoteRoot"]


class _RemoteMember:
    """A file of a bundle directory at a URL; see :class:`iobundle.calls._tensorfile_read.MemberHandle`."""

    def __init__(self, root: RemoteRoot, name: str) -> None:
        self.root = root
        self.name = name
        self.path = join_url(root.inner, name)

    def __str__(self) -> str:
        return join_url(self.root.path, self.name)

    def open(self) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        fs = self.root.fs
        try:
            info = fs.info(self.path)
        except FileNotFoundError as exc:
            raise TensorFileError(f"{self.name}: missing from the bundle '{self.root.path}'.") from exc
        except Exception as exc:
            raise TensorFileError(f"{self.name}: cannot be read from '{self.root.path}' ({exc}).") from exc
        if reported_link(info):
            raise UnsafeBundleError(f"{self.name}: {link_message(self)}")
        if info.get("type") != "file":
            raise TensorFileError(f"{self.name}: not a regular file in '{self.root.path}'; refusing to read it.")
        try:
            return fs.open(self.path, "rb"), int(info["size"])
        except Exception as exc:
            raise TensorFileError(f"{self.name}: cannot be opened in '{self.root.path}' ({exc}).") from exc

    def map(self, size: int) -> torch.Tensor | None:
        return None  # remote bytes are read, then viewed


class RemoteRoot:
    """A bundle directory at ``url``, whose members are read through fsspec."""

    def __init__(self, url: str) -> None:
        self.path = url
        self.fs: Any
        self.fs, self.inner = open_filesystem(url)
        self._folders: set[str] = set()  # folders checked not to be links (one info() each)

    def member(self, name: str) -> _RemoteMember:
        """The member ``name``: a plain relative name whose folders the filesystem does not report as links."""
        parts = check_member_name(name).parts
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder not in self._folders:
                try:
                    info = self.fs.info(join_url(self.inner, folder))
                except Exception:  # missing or unreadable: the member's own open says so
                    info = None
                if reported_link(info):
                    raise UnsafeBundleError(f"File {name!r}: {link_message(join_url(self.path, folder))}")
                self._folders.add(folder)
        return _RemoteMember(self, name)

    def read_manifest(self) -> bytes:
        """The bytes of ``manifest.json``, refused over the size limit.

        Raises:
            BundleNotFoundError: ``url`` holds no manifest.
            UnsafeBundleError: The manifest is over :data:`iobundle.schema.MAX_MANIFEST_BYTES`.
        """
        member = self.member(MANIFEST_FILENAME)
        try:
            f, size = member.open()
        except TensorFileError as exc:
            raise BundleNotFoundError(
                f"No {MANIFEST_FILENAME} at '{self.path}'. Is it a bundle saved with observer.save()? ({exc})"
            ) from exc
        with f:
            if size > MAX_MANIFEST_BYTES:
                raise UnsafeBundleError(
                    f"{member}: {size} bytes, over the limit of {MAX_MANIFEST_BYTES} bytes (MAX_MANIFEST_BYTES)."
                )
            try:
                return bytes(f.read(MAX_MANIFEST_BYTES + 1))
            except Exception as exc:
                raise ManifestError(f"{member}: cannot be read ({exc}).") from exc
