"""Bundles at URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``, ...) through fsspec. Stdlib only until used.

A string of the form ``scheme://...`` is a URL, never a local path: without fsspec it is a
:class:`~iobundle.errors.MissingDependencyError` naming the extra to install, instead of a local
folder named ``scheme:``. ``file://`` URLs are plain local paths (the fast, memory-mapped path):
``file:///abs`` and ``file://localhost/abs`` are ``/abs``. Every output (a bundle, a packed file, an
ONNX model, converted calls) goes through :func:`resolve_output`.
Capture writes a bundle to a local staging directory and uploads it (:func:`staged`, which
uploads with :func:`upload_directory`, ``manifest.json`` last, so a reader never sees a manifest
before its files); replay reads the
members of a remote bundle through the filesystem's files (no memory mapping).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from iobundle._leftovers import remove_leftovers
from iobundle._locations import is_url, local_path
from iobundle._paths import FILE, LINK, MISSING, Tree, check_relative_name, link_message, reported_link
from iobundle.errors import BundleExistsError, BundleNotFoundError, BundleWriteError, MissingDependencyError
from iobundle.schema import MEMBER_NAME_RULE, is_member_name

__all__ = [
    "MANIFEST_NAME",
    "REMOTE_EXTRA",
    "Staging",
    "clear_bundle",
    "clear_local_bundle",
    "directory_files",
    "is_url",
    "join_url",
    "listed_names",
    "local_path",
    "open_filesystem",
    "remote_kind",
    "resolve_output",
    "staged",
    "upload_directory",
    "upload_file",
]

MANIFEST_NAME = "manifest.json"
"""The manifest's name (``iobundle.schema.MANIFEST_FILENAME``; this module stays stdlib only)."""

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


def listed_names(manifest: bytes, where: str) -> list[str]:
    """The files the bundle manifest ``manifest`` lists besides itself: tensor files, the model's files.

    This is what replacing a bundle deletes (:func:`clear_bundle`). Names are checked to stay inside
    the bundle (relative, no ``..``, no backslash), since the old manifest is not trusted either.

    Raises:
        BundleExistsError: The manifest at ``where`` is not a readable bundle manifest, or names a
            file outside the bundle: nothing is deleted then.
    """
    try:
        data = json.loads(manifest)
        names = list(data.get("files") or {})
        model = data.get("model")
        if isinstance(model, dict):
            names += list(model.get("files") or {})
    except (ValueError, AttributeError, TypeError) as exc:
        raise BundleExistsError(
            f"'{where}' is not a readable bundle manifest ({exc}); refusing to replace what its folder holds. "
            "Remove the folder yourself, or choose another path."
        ) from exc
    for name in names:
        if not is_member_name(name):
            raise BundleExistsError(
                f"'{where}' lists the file {name!r}, which is not inside the bundle ({MEMBER_NAME_RULE} is); "
                "refusing to replace it. "
                "Remove the folder yourself, or choose another path."
            )
    return list(dict.fromkeys(names))


def clear_bundle(
    read: Callable[[str], bytes], remove: Callable[[str], None], *, where: str, missing_ok: type[BaseException]
) -> list[str]:
    """Delete the bundle whose files ``read`` and ``remove`` reach (by member name): the one overwrite rule.

    ``manifest.json`` goes first (what remains is never taken for a complete bundle), then each
    file it lists (:func:`listed_names`); nothing else is deleted, so files beside the bundle stay.
    Folders left empty are the caller's to remove. Returns the names removed.

    Raises:
        BundleExistsError: See :func:`listed_names`.
    """
    names = listed_names(read(MANIFEST_NAME), where)
    remove(MANIFEST_NAME)
    for name in names:
        try:
            remove(name)
        except missing_ok:
            pass  # already gone: a file the old manifest listed but nobody wrote
    return [MANIFEST_NAME, *names]


def clear_local_bundle(root: Path) -> None:
    """:func:`clear_bundle` for the local bundle directory ``root``, what a killed writer left, then its folders left empty.

    Every file is reached from ``root``'s descriptor without following a link (:class:`iobundle._paths.Tree`),
    and every listed file is checked before anything is removed: a bundle whose ``calls/`` (or any
    listed file, or the manifest) is a link, or whose listed name is a folder, is refused whole, so
    nothing outside ``root`` is ever removed. The files a killed writer left unlisted go too (a journal,
    temporary files, call files and segments: :func:`iobundle._leftovers.remove_leftovers`, by exact
    name); no other file the manifest does not list is removed.

    Raises:
        BundleExistsError: See :func:`listed_names`; or a listed file or a folder above it is a link
            or not a regular file (nothing is removed then).
        BundleWriteError: A listed file cannot be removed (permissions).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    with Tree(root, error=BundleExistsError) as tree:

        def read(name: str) -> bytes:
            fd = tree.open(name, flags)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise BundleExistsError(f"'{root / name}' is not a regular file; refusing to replace the bundle.")
                return f.read()

        def check_then_remove(names: list[str]) -> None:
            for name in names:  # all checked first: a refusal removes nothing
                kind = tree.kind(name)
                if kind not in (FILE, MISSING):
                    raise BundleExistsError(
                        f"Cannot replace the bundle in '{root}': "
                        + (link_message(root / name) if kind == LINK else f"'{root / name}' is not a regular file.")
                        + " Remove the bundle yourself, or choose another path."
                    )

        def remove(name: str) -> None:
            if name == MANIFEST_NAME:
                check_then_remove([MANIFEST_NAME, *listed])
            tree.unlink(name)

        try:
            listed = listed_names(read(MANIFEST_NAME), str(root / MANIFEST_NAME))
            removed = clear_bundle(read, remove, where=str(root / MANIFEST_NAME), missing_ok=FileNotFoundError)
            removed += remove_leftovers(tree)
        except BundleExistsError:
            raise  # an OSError too (FileExistsError), but the message says what to do already
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot remove {exc.filename or root} of the bundle being replaced: {exc.strerror or exc}. "
                "Remove the bundle yourself, or choose another path."
            ) from exc
        folders = {tuple(n.split("/"))[:-1] for n in removed}
        for parts in sorted(folders, key=len, reverse=True):
            while parts and tree.rmdir(parts):  # only when empty
                parts = parts[:-1]


def upload_directory(local: Path, url: str, *, overwrite: bool = False, last: str = MANIFEST_NAME) -> None:
    """Copy every file under ``local`` (but writers' ``.*.tmp`` files) to ``url``, ``last`` after all the others.

    An existing non-empty ``url`` is refused without ``overwrite``; with it, the bundle there (it has
    a ``last`` file) is removed by :func:`clear_bundle`: its manifest, then the files it lists;
    anything else (files beside the bundle) is never deleted.

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
            listed = listed_names(fs.cat_file(manifest), manifest)
            _refuse_remote_links(fs, root, [last, *listed], url)  # all checked first: a refusal removes nothing
            clear_bundle(
                lambda n: fs.cat_file(join_url(root, n)),
                lambda n: fs.rm_file(join_url(root, n)),
                where=manifest,
                missing_ok=FileNotFoundError,
            )
        fs.makedirs(root, exist_ok=True)
        names = directory_files(local)
        names.sort(key=lambda n: n == last)
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


def _refuse_remote_links(fs: Any, root: str, names: list[str], url: str) -> None:
    """Refuse to replace the bundle at ``url`` when the filesystem reports a listed file, or a folder above one, as a link."""
    seen: set[str] = set()
    for name in names:
        parts = check_relative_name(name, f"'{url}'", error=BundleExistsError)
        for i in range(1, len(parts) + 1):
            path = join_url(root, "/".join(parts[:i]))
            if path in seen:
                continue
            seen.add(path)
            try:
                info = fs.info(path)
            except FileNotFoundError:
                break
            if reported_link(info):
                raise BundleExistsError(
                    f"Cannot replace the bundle at '{url}': {link_message(path)} Remove it yourself, or choose another URL."
                )


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
