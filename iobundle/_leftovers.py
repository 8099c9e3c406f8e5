"""What a killed writer leaves in a bundle directory, found and removed by exact name, never anything else.

A writer killed mid-file leaves its temporary file (``calls/.NNNNNN.safetensors.tmp``,
``.manifest.json.tmp``, ``.journal.jsonl.tmp``), and may leave complete files that nothing lists
yet: a call's own file renamed into place before its journal line, a segment created before its
first range was listed, a journal beside the manifest that replaced it. Every such file has a name
the writers give (:func:`iobundle.schema.is_writer_file`), in the bundle's root or in ``calls/``:
:func:`remove_leftovers` removes those and nothing else, never a link (nor anything through one:
a linked ``calls/`` is left alone), never a file of another name, never outside the root.
:func:`unlisted_files` lists, for a report, what a folder holds besides the files its manifest lists.
"""

from __future__ import annotations

from collections.abc import Collection

from iobundle._paths import DIR, FILE, Tree
from iobundle.schema import is_writer_file

__all__ = ["remove_leftovers", "unlisted_files"]

_FOLDERS = ((), ("calls",))
"""Where writers put files: the root first (its journal goes before the files it lists), then ``calls/``."""


def _entries(tree: Tree) -> list[tuple[str, str]]:
    """``(member name, kind)`` of each entry of the root and of ``calls/`` (when it is a folder, not a link)."""
    found = []
    for folder in _FOLDERS:
        if folder and tree.kind(folder) != DIR:
            continue
        found += [("/".join((*folder, name)), kind) for name, kind in tree.listing(folder).items()]
    return found


def remove_leftovers(tree: Tree, keep: Collection[str] = ()) -> list[str]:
    """Remove the regular files of ``tree`` whose names a writer gives (but those of ``keep``); return their names.

    Raises:
        OSError: A file cannot be removed (permissions).
    """
    removed = []
    for member, kind in _entries(tree):
        if kind == FILE and member not in keep and is_writer_file(member):
            tree.unlink(member, missing_ok=True)
            removed.append(member)
    return removed


def unlisted_files(tree: Tree, listed: Collection[str]) -> list[tuple[str, str, bool]]:
    """``(member name, kind, whether a writer gives that name)`` of what ``tree`` holds besides ``listed``.

    Looked at: the root's files a writer names (other files beside a bundle are the user's
    business) and every entry of ``calls/``, the writers' folder. Folders of the root
    (``calls/``, ``model/``) are not reported.
    """
    found = []
    for member, kind in _entries(tree):
        if member in listed or (kind == DIR and "/" not in member):
            continue
        writer = is_writer_file(member)
        if writer or member.startswith("calls/"):
            found.append((member, kind, writer))
    return found
