"""Outputs at URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``, ...) through fsspec: staging folders and uploads.

A ``scheme://`` string is a URL, never a local path (``file://`` URLs are local paths). Every output
(a bundle, a packed file, an ONNX model, converted calls) goes through :func:`resolve_output`.
Capture writes a bundle to a local staging directory and uploads it (:func:`staged`, then
:func:`upload_directory`, ``manifest.json`` last, so a reader never sees a manifest before its files);
reading a bundle at a URL is the store's (:class:`iobundle._store.FsspecStore`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from iobundle._locations import is_url, local_path
from iobundle._store import FsspecStore, LocalStore, clear_bundle, join_url, make_room, open_filesystem
from iobundle.errors import BundleExistsError, BundleWriteError, MissingDependencyError
from iobundle.schema import MANIFEST_FILENAME

__all__ = [
    "Staging",
    "clear_local_bundle",
    "directory_files",
    "is_url",
    "join_url",
    "local_path",
    "open_filesystem",
    "resolve_output",
    "staged",
    "upload_directory",
    "upload_file",
]


def resolve_output(location: str | os.PathLike[str], *, remote: bool, what: str = "this output") -> Path | str:
    """Where an output goes: a local :class:`~pathlib.Path`, or a URL (a ``str``) whose filesystem is installed.

    A ``scheme://`` string is never taken for a local path (no folder ``scheme:`` is ever made).

    Args:
        location: A path, a ``file://`` URL, or a URL of another filesystem.
        remote: Whether the writer can upload (pack, redact, save); when False a URL of another
            filesystem is refused.
        what: How messages name the output (``"export -o"``).

    Raises:
        BundleWriteError: ``location`` is a URL of another filesystem and the writer writes local files only.
        MissingDependencyError: fsspec, or the filesystem's implementation, is not installed, or the
            protocol is unknown (the message names what to install).
    """
    local = local_path(location)
    if local is not None:
        return local
    url = str(location)
    if not remote:
        raise BundleWriteError(
            f"'{url}': {what} writes local files only. Give a local path (or a file:// URL), then upload "
            "what it writes."
        )
    open_filesystem(url)
    return url


def clear_local_bundle(root: Path) -> None:
    """:func:`iobundle._store.clear_bundle` for the local bundle directory ``root``, then its folders left empty.

    Raises:
        BundleExistsError, BundleWriteError: See :func:`iobundle._store.clear_bundle`.
    """
    clear_bundle(LocalStore(root, error=BundleExistsError))


def upload_directory(local: Path, url: str, *, overwrite: bool = False) -> None:
    """Copy every file under ``local`` (but writers' ``.*.tmp`` files) to ``url``, ``manifest.json`` last.

    What is at ``url`` is replaced as :func:`iobundle._store.make_room` says: only an old bundle,
    only with ``overwrite``, and only its own files.

    Raises:
        BundleExistsError: ``url`` holds files and ``overwrite`` is False, or holds files but no bundle.
        BundleWriteError: A file cannot be written (the message names it and the cause).
        MissingDependencyError: See :func:`open_filesystem`.
    """
    fs, root = open_filesystem(url)
    try:
        if fs.exists(root) and not fs.isdir(root):
            raise BundleExistsError(f"'{url}' exists and is not a directory. Choose another URL.")
        make_room(FsspecStore(url, fs=fs, inner=root), overwrite=overwrite)
        fs.makedirs(root, exist_ok=True)
        names = directory_files(local)
        names.sort(key=lambda n: n == MANIFEST_FILENAME)
        for name in names:
            path = local.joinpath(*name.split("/"))
            target = join_url(root, name)
            parent = target.rsplit("/", 1)[0]
            if parent != root.rstrip("/"):
                fs.makedirs(parent, exist_ok=True)
            fs.put_file(str(path), target)
    except (BundleExistsError, MissingDependencyError):
        raise
    except Exception as exc:
        raise BundleWriteError(
            f"Cannot upload the bundle to '{url}': {type(exc).__name__}: {exc}. Check the URL, "
            "the credentials and the permissions."
        ) from exc


def directory_files(root: Path) -> list[str]:
    """The files under ``root`` as sorted ``/``-separated names, without writers' temporary ``.*.tmp`` files."""
    names = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for file in files:
            if file.startswith(".") and file.endswith(".tmp"):
                continue  # a writer's temporary file, never part of the bundle
            names.append(Path(directory, file).relative_to(root).as_posix())
    return sorted(names)


def upload_file(path: Path, url: str, *, overwrite: bool = False) -> None:
    """Copy the local file ``path`` to ``url`` (a packed bundle, say).

    Raises:
        BundleExistsError: ``url`` exists and ``overwrite`` is False.
        BundleWriteError: The file cannot be uploaded (the message names the URL and the cause).
        MissingDependencyError: See :func:`open_filesystem`.
    """
    fs, inner = open_filesystem(url)
    try:
        if fs.exists(inner) and not overwrite:
            raise BundleExistsError(f"'{url}' already exists. Pass overwrite=True (--overwrite) or choose another URL.")
        parent = inner.rsplit("/", 1)[0]
        if parent and parent != inner:
            fs.makedirs(parent, exist_ok=True)
        fs.put_file(str(path), inner)
    except BundleExistsError:
        raise
    except Exception as exc:
        raise BundleWriteError(f"Cannot upload to '{url}': {type(exc).__name__}: {exc}.") from exc


class Staging:
    """A local temporary folder for what is bound for ``url``: write :attr:`path`, :meth:`upload`, :meth:`close`.

    :attr:`path` (``<folder>/bundle``) does not exist yet: make it a bundle directory, or a file.
    Use :func:`staged` unless the staging outlives one block (a stream kept across blocks).

    Raises:
        MissingDependencyError: See :func:`open_filesystem` (checked before anything is made).
    """

    def __init__(self, url: str, *, prefix: str = "iobundle-") -> None:
        open_filesystem(url)  # MissingDependencyError without fsspec, before anything is written
        self.url = url
        self.folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.path = self.folder / "bundle"

    def upload(self, *, overwrite: bool = False) -> None:
        """Upload :attr:`path` to the URL: a directory by :func:`upload_directory`, a file by :func:`upload_file`."""
        if self.path.is_dir():
            upload_directory(self.path, self.url, overwrite=overwrite)
        else:
            upload_file(self.path, self.url, overwrite=overwrite)

    def close(self) -> None:
        """Remove the staging folder (idempotent)."""
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def staged(url: str, *, overwrite: bool = False, prefix: str = "iobundle-") -> Iterator[Path]:
    """A local path to write what goes to ``url``; uploaded when the block completes, removed in any case.

    Example:
        >>> with staged("s3://bucket/run.iobundle", overwrite=True) as local:
        ...     save_recorded_calls(rc, local)

    Raises:
        BundleExistsError, BundleWriteError, MissingDependencyError: See :meth:`Staging.upload`.
    """
    staging = Staging(url, prefix=prefix)
    try:
        yield staging.path
        staging.upload(overwrite=overwrite)
    finally:
        staging.close()
