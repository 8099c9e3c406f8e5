"""A bundle directory at a URL, through fsspec: members are read (not memory-mapped), checked as local ones are.

A filesystem that reports links (``info()["islink"]``, a ``"link"`` type) has them refused on every
component of a member's name; names are checked by :func:`check_member_name` first, so nothing
leaves the directory. Writes go through the filesystem's own calls (``pipe_file`` replaces an
object whole).
"""

from __future__ import annotations

import io
from typing import Any

from iobundle._paths import DIR, FILE, LINK, OTHER, link_message
from iobundle._store._base import Store, check_member_name
from iobundle.errors import BundleWriteError, MissingDependencyError, TensorFileError, UnsafeBundleError

__all__ = ["REMOTE_EXTRA", "FsspecStore", "join_url", "open_filesystem"]

REMOTE_EXTRA = "pip install 'iobundle[remote]'"

# The extra (or package) that brings a filesystem's fsspec implementation, by protocol.
_PROTOCOL_EXTRAS = {
    "s3": "pip install 'iobundle[s3]'",
    "s3a": "pip install 'iobundle[s3]'",
    "gs": "pip install 'iobundle[remote]' gcsfs",
    "gcs": "pip install 'iobundle[remote]' gcsfs",
    "az": "pip install 'iobundle[remote]' adlfs",
    "abfs": "pip install 'iobundle[remote]' adlfs",
    "hf": "pip install 'iobundle[remote]' huggingface_hub",
}


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def join_url(url: str, name: str) -> str:
    """``url/name`` with exactly one slash between them."""
    return url.rstrip("/") + "/" + name


def open_filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    Raises:
        MissingDependencyError: fsspec (``iobundle[remote]``), or the filesystem's own package
            (``s3fs`` for ``s3://``, ...), is not installed, or the protocol is unknown.
    """
    extra = _PROTOCOL_EXTRAS.get(_protocol(url), REMOTE_EXTRA)
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(
            f"'{url}' is a URL: reading and writing bundles at URLs needs fsspec. Install it with "
            f"{extra}, or pass a local path."
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise MissingDependencyError(
            f"'{url}': fsspec needs another package for {_protocol(url)}:// ({exc}). Install it with {extra}, "
            "then try again."
        ) from exc
    except ValueError as exc:
        raise MissingDependencyError(
            f"'{url}': {_protocol(url)}:// is not a protocol fsspec knows ({exc}). Check the URL, or install the "
            f"package that provides it ({REMOTE_EXTRA} brings fsspec; s3:// needs 'iobundle[s3]'), or pass a "
            "local path."
        ) from exc
    return fs, path


def reported_link(info: object) -> bool:
    """Whether an fsspec ``info()`` dictionary says its entry is a symbolic link (where the filesystem can tell)."""
    return isinstance(info, dict) and (info.get("islink") is True or info.get("type") == "link")


class FsspecStore(Store):
    """The bundle directory at ``url`` (or at ``inner`` of the filesystem ``fs``); see :func:`open_filesystem`."""

    path: str

    def __init__(self, url: str, *, fs: Any = None, inner: str | None = None) -> None:
        self.path = url
        self.fs: Any
        self.fs, self.inner = (fs, inner or url) if fs is not None else open_filesystem(url)
        self._folders: set[str] = set()  # folders checked not to be links (one info() each)

    def describe(self, name: str) -> str:
        return join_url(self.path, name)

    def check(self, name: str) -> None:
        """The name's text, then each folder above it: the filesystem must not report one as a link."""
        self._check_folders(name, check_member_name(name).parts[:-1])

    def _check_folders(self, name: str, folders: tuple[str, ...]) -> None:
        for i in range(1, len(folders) + 1):
            folder = "/".join(folders[:i])
            if folder not in self._folders:
                try:
                    info = self.fs.info(join_url(self.inner, folder))
                except Exception:  # missing or unreadable: the member's own open says so
                    info = None
                if reported_link(info):
                    raise UnsafeBundleError(f"File {name!r}: {link_message(join_url(self.path, folder))}")
                self._folders.add(folder)

    def _info(self, name: str) -> dict[str, Any] | None:
        """The checked member's ``info()``, None when missing; a link refused."""
        self.check(name)
        try:
            info = self.fs.info(join_url(self.inner, name))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise TensorFileError(f"{name}: cannot be read from '{self.path}' ({exc}).") from exc
        if reported_link(info):
            raise UnsafeBundleError(f"{name}: {link_message(self.describe(name))}")
        return info

    def open(self, name: str) -> tuple[io.RawIOBase | io.BufferedIOBase, int]:
        info = self._info(name)
        if info is None:
            raise TensorFileError(f"{name}: missing from the bundle '{self.path}'.")
        if info.get("type") != "file":
            raise TensorFileError(f"{name}: not a regular file in '{self.path}'; refusing to read it.")
        try:
            return self.fs.open(join_url(self.inner, name), "rb"), int(info["size"])
        except Exception as exc:
            raise TensorFileError(f"{name}: cannot be opened in '{self.path}' ({exc}).") from exc

    def list(self, folder: str = "") -> dict[str, str]:
        if folder:
            self._check_folders(folder, check_member_name(folder).parts)
        path = join_url(self.inner, folder) if folder else self.inner
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        kinds = {"file": FILE, "directory": DIR}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: LINK if reported_link(e) else kinds.get(e.get("type"), OTHER)
            for e in entries
        }

    def _write(self, name: str, how: str, action: Any) -> None:
        self.check(name)
        path = join_url(self.inner, name)
        try:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            action(path)
        except Exception as exc:
            raise BundleWriteError(f"Cannot {how} {self.describe(name)}: {type(exc).__name__}: {exc}.") from exc

    def write(self, name: str, data: bytes) -> None:
        self._write(name, "write", lambda path: self.fs.pipe_file(path, bytes(data)))

    def append(self, name: str, data: bytes) -> None:
        def append(path: str) -> None:
            with self.fs.open(path, "ab") as f:
                f.write(data)

        self._write(name, "append to", append)

    def remove(self, name: str, *, missing_ok: bool = False) -> None:
        info = self._info(name)
        if info is None:
            if missing_ok:
                return
            raise FileNotFoundError(f"{self.describe(name)}: no such file")
        if info.get("type") != "file":
            raise UnsafeBundleError(f"'{self.describe(name)}' is not a regular file; refusing to remove it.")
        self._write(name, "remove", self.fs.rm_file)
