"""The one interface to a bundle's bytes: :class:`Store`, one backend per place a bundle lives.

:class:`LocalStore` (a directory), :class:`TarStore` (a packed file, local or at a URL:
:func:`open_archive`), :class:`FsspecStore` (a directory at a URL), :class:`MemoryStore`. Every
read of a bundle's member goes through :meth:`Store.open` (the name's rule, no link, a regular
file, its size); tests/store runs one suite against every backend.
"""

from __future__ import annotations

from iobundle._store._base import Store, check_member_name
from iobundle._store._fsspec import FsspecStore
from iobundle._store._local import LocalStore, open_regular
from iobundle._store._memory import MemoryStore
from iobundle._store._tar import MAX_ARCHIVE_MEMBERS, TarStore, open_archive, read_index

__all__ = [
    "MAX_ARCHIVE_MEMBERS",
    "FsspecStore",
    "LocalStore",
    "MemoryStore",
    "Store",
    "TarStore",
    "check_member_name",
    "open_archive",
    "open_regular",
    "read_index",
]
