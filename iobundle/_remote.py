"""Bundles at URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``, ...) through fsspec. Stdlib only until used.

A string of the form ``scheme://...`` is a URL, never a local path: without fsspec it is a
:class:`~iobundle.errors.MissingDependencyError` naming the extra to install, instead of a local
folder named ``scheme:``. ``file://`` URLs are plain local paths (the fast, memory-mapped path).
Capture writes a bundle to a local staging directory and uploads it (:func:`upload_directory`,
``manifest.json`` last, so a reader never sees a manifest before its files); replay reads the
members of a remote bundle through the filesystem's files (no memory mapping).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from iobundle.errors import BundleExistsError, BundleNotFoundError, BundleWriteError, MissingDependencyError

__all__ = ["REMOTE_EXTRA", "is_url", "join_url", "local_path", "open_filesystem", "remote_kind", "upload_directory"]

REMOTE_EXTRA = "pip install 'iobundle[remote]'"

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (a ``str`` starting with ``scheme://``); ``file://`` counts as one."""
    return isinstance(location, str) and _URL.match(location) is not None


def local_path(location: str | os.PathLike[str]) -> Path | None:
    """``location`` as a local path, or None when it is a URL of another filesystem (``file://x`` is ``x``)."""
    if not is_url(location):
        return Path(location)
    assert isinstance(location, str)
    if location.lower().startswith("file://"):
        return Path(location[len("file://") :])
    return None


def join_url(url: str, name: str) -> str:
    """``url/name`` with exactly one slash between them."""
    return url.rstrip("/") + "/" + name


def open_filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    Raises:
        MissingDependencyError: fsspec (``iobundle[remote]``), or the filesystem's own package
            (``s3fs`` for ``s3://``, ...), is not installed, or the protocol is unknown.
    """
    try:
        import fsspec
    except ImportError as exc:
        raise MissingDependencyError(
            f"'{url}' is a URL: reading and writing bundles at URLs needs fsspec. Install it with "
            f"{REMOTE_EXTRA} (and the filesystem's package, e.g. s3fs for s3://), or pass a local path."
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise MissingDependencyError(
            f"'{url}': fsspec needs another package for this filesystem ({exc}). Install it, then try again."
        ) from exc
    except ValueError as exc:
        raise MissingDependencyError(
            f"'{url}': fsspec does not know this protocol ({exc}). Install the package that provides it "
            "(see fsspec's list of known implementations), or pass a local path."
        ) from exc
    return fs, path


def upload_directory(local: Path, url: str, *, overwrite: bool = False, last: str = "manifest.json") -> None:
    """Copy every file under ``local`` to ``url``, the file ``last`` after all the others.

    An existing non-empty ``url`` is refused without ``overwrite``; with it, a bundle there (it has
    a ``last`` file) is removed, ``last`` first (what remains is never taken for a complete bundle);
    anything else is never deleted.

    Raises:
        BundleExistsError: ``url`` holds files and ``overwrite`` is False, or holds files but no bundle.
        BundleWriteError: A file cannot be written (the message names it and the cause).
        MissingDependencyError: See :func:`open_filesystem`.
    """
    fs, root = open_filesystem(url)
    try:
        exists = fs.exists(root)
        if exists and not fs.isdir(root):
            raise BundleExistsError(f"'{url}' exists and is not a directory. Choose another URL.")
        if exists and fs.ls(root, detail=False):
            if not overwrite:
                raise BundleExistsError(
                    f"'{url}' already exists and is not empty. Pass overwrite=True "
                    "(--overwrite on the command line) to replace it, or choose another URL."
                )
            manifest = join_url(root, last)
            if not fs.exists(manifest):
                raise BundleExistsError(f"'{url}' is not a bundle (no {last}); refusing to replace what it holds.")
            fs.rm(manifest)  # first: what remains is never taken for a complete bundle
            fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.relative_to(local).as_posix() == last)
        for path in files:
            name = path.relative_to(local).as_posix()
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


def remote_kind(url: str) -> str:
    """``"directory"`` or ``"file"``: what ``url`` is.

    Raises:
        BundleNotFoundError: Nothing is at ``url``.
        MissingDependencyError: See :func:`open_filesystem`.
    """
    fs, path = open_filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError as exc:
        raise BundleNotFoundError(f"'{url}' does not exist. Pass the URL a bundle was saved to.") from exc
    except Exception as exc:
        raise BundleNotFoundError(f"'{url}' cannot be read: {type(exc).__name__}: {exc}.") from exc
    return "directory" if info.get("type") == "directory" else "file"
