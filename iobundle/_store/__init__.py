"""The one interface to a bundle's bytes: :class:`Store`, one backend per place a bundle lives.

:class:`LocalStore` (a directory), :class:`TarStore` (a packed file, local or at a URL:
:func:`open_archive`), :class:`FsspecStore` (a directory at a URL), :class:`MemoryStore`. Every
read of a bundle's member goes through :meth:`Store.open` (the name's rule, no link, a regular
file, its size); removing a bundle, or what a killed writer left, is :func:`clear_bundle` and
:func:`remove_leftovers` for every store. tests/store runs one suite against every backend.
"""

from __future__ import annotations

from iobundle._store._base import Store
from iobundle._store._fsspec import FsspecStore, join_url, open_filesystem
from iobundle._store._leftovers import clear_bundle, remove_leftovers, unlisted_files
from iobundle._store._local import LocalStore, open_regular
from iobundle._store._memory import MemoryStore
from iobundle._store._open import open_store
from iobundle._store._tar import TarStore, open_archive

__all__ = [
    "FsspecStore",
    "LocalStore",
    "MemoryStore",
    "Store",
    "TarStore",
    "clear_bundle",
    "join_url",
    "open_archive",
    "open_filesystem",
    "open_regular",
    "open_store",
    "remove_leftovers",
    "unlisted_files",
]
