"""Open a bundle directory's manifest: ``manifest.json``, or the journal of a stream not yet closed."""

from __future__ import annotations

import os
from pathlib import Path

from iobundle._locations import require_existing
from iobundle.errors import BundleNotFoundError
from iobundle.schema._io import JOURNAL_FILENAME, MANIFEST_FILENAME, parse_manifest, read_member
from iobundle.schema._journal import load_journal
from iobundle.schema._manifest import Manifest

__all__ = ["load_manifest"]


def load_manifest(bundle_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``bundle_dir/manifest.json``.

    A bundle still being streamed, or whose writer was killed, has no ``manifest.json`` yet but a
    ``journal.jsonl``: the manifest is then rebuilt from it (see :func:`iobundle.schema.load_journal`).

    Raises:
        BundleNotFoundError: ``bundle_dir`` or its manifest does not exist.
        ManifestError: The manifest is invalid (see :func:`parse_manifest`).
    """
    root = Path(bundle_dir)
    path = root / MANIFEST_FILENAME
    if not root.is_dir():
        require_existing(bundle_dir)
        raise BundleNotFoundError(f"'{bundle_dir}' is not a directory. Pass the folder written by observer.save().")
    if not path.exists() and not path.is_symlink():
        journal = root / JOURNAL_FILENAME
        if journal.exists() or journal.is_symlink():
            # a stream still open, or whose writer died
            return load_journal(root)
        raise BundleNotFoundError(
            f"No {MANIFEST_FILENAME} in '{bundle_dir}'. Is it a directory written by observer.save()?"
        )
    data = read_member(root, path)
    return parse_manifest(data, source=str(path))
