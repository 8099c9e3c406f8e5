"""Removing a bundle, and what a killed writer left in one: by exact name, never anything else, in any store.

A writer killed mid-file leaves its temporary file (``calls/.NNNNNN.safetensors.tmp``,
``.manifest.json.tmp``, ``.journal.jsonl.tmp``), and may leave complete files that nothing lists
yet: a call's own file renamed into place before its journal line, a segment created before its
first range was listed, a journal beside the manifest that replaced it. Every such file has a name
the writers give (:func:`iobundle.schema.is_writer_file`), in the bundle's root or in ``calls/``:
:func:`remove_leftovers` removes those and nothing else, never a link (nor anything through one).
:func:`clear_bundle` is the one overwrite rule: the old manifest, the files it lists, the leftovers.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from iobundle._paths import DIR, FILE, LINK, link_message
from iobundle._store._base import Store
from iobundle._store._names import (
    JOURNAL_FILENAME,
    MANIFEST_FILENAME,
    MAX_MANIFEST_BYTES,
    is_member_name,
    is_writer_file,
)
from iobundle.errors import BundleExistsError, BundleWriteError, TensorFileError, UnsafeBundleError

__all__ = ["clear_bundle", "make_room", "remove_leftovers", "unlisted_files"]


def _entries(store: Store, root: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(member name, kind)`` of each entry of the root (listed as ``root``) and of ``calls/`` (a folder, not a link)."""
    root = store.list() if root is None else root
    calls = store.list("calls") if root.get("calls") == DIR else {}
    return [*root.items(), *((f"calls/{name}", kind) for name, kind in calls.items())]


def remove_leftovers(store: Store, keep: Collection[str] = ()) -> list[str]:
    """Remove the regular files of ``store`` whose names a writer gives (but those of ``keep``); return their names."""
    removed = []
    for member, kind in _entries(store):
        if kind == FILE and member not in keep and is_writer_file(member):
            store.remove(member, missing_ok=True)
            removed.append(member)
    return removed


def unlisted_files(store: Store, listed: Collection[str]) -> tuple[list[tuple[str, str, bool]], bool]:
    """``(member name, kind, whether a writer gives that name)`` of what ``store`` holds besides ``listed``, and
    whether the bundle is closed (it has a ``manifest.json``; else its journal lists its calls).

    Looked at: the root's files a writer names (others beside a bundle are the user's business) and
    every entry of ``calls/``, the writers' folder.
    """
    root = store.list()
    closed = root.get(MANIFEST_FILENAME) == FILE
    listed = {*listed, MANIFEST_FILENAME if closed else JOURNAL_FILENAME}
    found = []
    for member, kind in _entries(store, root):
        if member in listed or (kind == DIR and "/" not in member):
            continue
        writer = is_writer_file(member)
        if writer or member.startswith("calls/"):
            found.append((member, kind, writer))
    return found, closed


def clear_bundle(store: Store) -> list[str]:
    """Delete the bundle ``store`` holds: the one overwrite rule. Returns the names removed.

    Every listed file is checked first (a link on the way, or a folder where a file is listed,
    refuses the whole: BundleExistsError, as an unreadable old manifest or one naming a file outside).
    ``manifest.json`` goes first (what remains is never taken for a bundle), then each file it lists,
    then what a killed writer left (:func:`remove_leftovers`), then the folders left empty; nothing
    else. BundleWriteError when a file cannot be removed.
    """
    again = "Remove the bundle yourself, or choose another path."
    try:
        try:
            data = json.loads(store.read(MANIFEST_FILENAME, MAX_MANIFEST_BYTES))
            names = [MANIFEST_FILENAME, *(data.get("files") or {}), *((data.get("model") or {}).get("files") or {})]
        except (ValueError, AttributeError, TypeError) as exc:
            raise BundleExistsError(f"'{store.path}' holds no readable bundle manifest ({exc}). {again}") from exc
        if not all(map(is_member_name, names)):
            bad = next(n for n in names if not is_member_name(n))
            raise BundleExistsError(f"'{store.path}': the manifest lists {bad!r}, not inside the bundle. {again}")
        names = list(dict.fromkeys(names))
        listings: dict[str, dict[str, str]] = {}
        for name in names:  # all checked first: a refusal removes nothing
            folder, _, base = name.rpartition("/")
            if folder not in listings:
                listings[folder] = store.list(folder)
            kind = listings[folder].get(base, FILE)  # missing is no refusal: nothing to remove
            if kind != FILE:
                where = store.describe(name)
                raise BundleExistsError(
                    f"Cannot replace the bundle in '{store.path}': "
                    + (link_message(where) if kind == LINK else f"'{where}' is not a regular file.")
                    + f" {again}"
                )
        for name in names:
            store.remove(name, missing_ok=True)  # missing: a file the old manifest listed but nobody wrote
        names += remove_leftovers(store)
        store.prune(names)
        return names
    except (BundleExistsError, BundleWriteError):
        raise  # OSErrors too, but their messages say what to do already
    except (UnsafeBundleError, TensorFileError) as exc:
        raise BundleExistsError(f"Cannot replace the bundle in '{store.path}': {exc} {again}") from exc
    except OSError as exc:
        raise BundleWriteError(
            f"Cannot remove {exc.filename or store.path} of the bundle being replaced: {exc.strerror or exc}. {again}"
        ) from exc


def make_room(store: Store, *, overwrite: bool) -> None:
    """Make room for a bundle in ``store``: it is empty, or (``overwrite``) the bundle it holds is cleared.

    Raises BundleExistsError when it holds files and not ``overwrite``, or holds no bundle (nothing is deleted).
    """
    entries = store.list()
    if entries and not overwrite:
        raise BundleExistsError(
            f"'{store.path}' already exists and is not empty. Pass overwrite=True (--overwrite on the command "
            "line) to replace it, or choose another path."
        )
    if entries and entries.get(MANIFEST_FILENAME) != FILE:
        raise BundleExistsError(
            f"'{store.path}' is not a bundle (no {MANIFEST_FILENAME}); refusing to replace what it holds."
        )
    if entries:
        clear_bundle(store)
