"""The one interface to a bundle's bytes (:class:`Store`), one backend per place a bundle lives.

:class:`LocalStore` (a directory), :class:`TarStore` (a packed file, local or at a URL),
:class:`FsspecStore` (a directory at a URL), :class:`MemoryStore`; :func:`open_store` picks one.
tests/store runs one suite against every backend.
"""

from __future__ import annotations

import os

from iobundle._locations import local_path
from iobundle._store._base import Store
from iobundle._store._fsspec import FsspecStore, join_url, open_filesystem
from iobundle._store._leftovers import clear_bundle, make_room, remove_leftovers, unlisted_files
from iobundle._store._local import LocalStore, open_regular
from iobundle._store._memory import MemoryStore
from iobundle._store._tar import TarStore, open_archive
from iobundle.errors import BundleNotFoundError

__all__ = [
    "FsspecStore",
    "LocalStore",
    "MemoryStore",
    "Store",
    "TarStore",
    "clear_bundle",
    "join_url",
    "make_room",
    "open_archive",
    "open_filesystem",
    "open_regular",
    "open_store",
    "remove_leftovers",
    "unlisted_files",
]


def open_store(location: str | os.PathLike[str]) -> Store:
    """The store of the bundle at ``location`` (a local path, a ``file://`` URL, or a URL of fsspec).

    Raises BundleNotFoundError (nothing at a URL, no manifest in a packed file), ArchiveError (an invalid
    packed file) or MissingDependencyError (a URL, and fsspec or its filesystem is not installed).
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
