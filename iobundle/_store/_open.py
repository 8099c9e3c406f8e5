"""Which backend holds the bundle at a location: a directory, a packed file (local or at a URL), a directory at a URL."""

from __future__ import annotations

import os

from iobundle._locations import local_path
from iobundle._store._base import Store
from iobundle._store._fsspec import FsspecStore, open_filesystem
from iobundle._store._local import LocalStore
from iobundle._store._tar import open_archive
from iobundle.errors import BundleNotFoundError

__all__ = ["open_store"]


def open_store(location: str | os.PathLike[str]) -> Store:
    """The store of the bundle at ``location`` (a local path, a ``file://`` URL, or a URL of fsspec).

    Raises:
        BundleNotFoundError: Nothing is at a URL ``location``, or a packed file holds no manifest.
        ArchiveError: A packed file is not a valid archive (:func:`iobundle._store.open_archive`).
        MissingDependencyError: ``location`` is a URL and fsspec, or its filesystem, is not installed.
    """
    local = local_path(location)
    if local is not None:
        return open_archive(local) if local.is_file() else LocalStore(local)
    url = str(location)
    fs, inner = open_filesystem(url)
    try:
        info = fs.info(inner)
    except FileNotFoundError as exc:
        raise BundleNotFoundError(f"'{url}' does not exist. Pass the URL a bundle was saved to.") from exc
    except Exception as exc:
        raise BundleNotFoundError(f"'{url}' cannot be read: {type(exc).__name__}: {exc}.") from exc
    return FsspecStore(url, fs=fs, inner=inner) if info.get("type") == "directory" else open_archive(url)
