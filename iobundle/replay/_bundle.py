"""``Bundle``: a bundle opened from disk, without the model, with the same inference API as ``InputObserver``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iobundle._collector import collector_paused
from iobundle._paths import DIR, FILE, LINK
from iobundle._progress import BYTES, ProgressCallback, notify
from iobundle._store import LocalStore, Store, TarStore, open_store, unlisted_files
from iobundle.calls import (
    BundleTensorStore,
    RecordedCalls,
    build_value,
    check_file,
    check_file_header,
    check_segment_member,
    collect_tensor_keys,
    iter_tensor_nodes,
    listed_files,
)
from iobundle.errors import IobundleError, UnsafeBundleError
from iobundle.replay._api import RecordedCallsAPI
from iobundle.replay.infer import call_shape
from iobundle.schema import (
    JOURNAL_FILENAME,
    MANIFEST_FILENAME,
    CallEntry,
    Manifest,
    deferred_calls,
    deferred_keys,
    load_manifest,
    manifest_trees,
    parse_manifest,
    tensor_rows,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Bundle", "load_bundle"]

logger = logging.getLogger(__name__)


class Bundle(RecordedCallsAPI):
    """A bundle read from disk: its manifest, its calls, lazily loaded tensors.

    Use :meth:`load` (or :func:`iobundle.load_bundle`). Loading never imports or
    unpickles anything named by the bundle; tensors are memory-mapped on first use and
    their file's hash checked then (unless ``verify=False``). Tensors stored as extensions of
    others (format version 2) are rebuilt on each read; shapes never read the files.
    """

    def __init__(
        self, path: Path | str, manifest: Manifest, *, verify: bool = True, source: Store | None = None
    ) -> None:
        self.path = path
        self.manifest = manifest
        self._store = BundleTensorStore(path, manifest, verify=verify, bundle_root=source)
        self._rc = RecordedCalls(
            signature=manifest.signature,
            calls=list(deferred_calls(manifest)),  # format version 3: trees built when a call is read
            store=self._store,
            value_if_missing=list(manifest.value_if_missing),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
        """Open the bundle at ``path``.

        ``path`` is a bundle directory, a bundle packed into one file by ``iobundle pack`` (read in
        place: its tensor members are memory-mapped where they lie in the archive), or, with fsspec
        installed, a URL of either (``s3://bucket/run.iobundle``, ``memory://run.iobundle.tar``),
        whose files are read rather than memory-mapped. ``path`` is then a ``str``.

        Args:
            path: The bundle directory, packed file or URL.
            verify: Check each tensor file's hash the first time it is read.

        Raises:
            BundleNotFoundError: ``path`` is not a bundle.
            ManifestError: The manifest is invalid, names unsafe paths, or refers to missing tensors.
            ArchiveError: A packed bundle is not a valid archive, or holds an entry a bundle may not.
            MissingDependencyError: ``path`` is a URL and fsspec (``iobundle[remote]``) is not installed.
        """
        with collector_paused(promote=True):
            return cls._load(path, verify=verify)

    @classmethod
    def _load(cls, path: str | os.PathLike[str], *, verify: bool) -> Bundle:
        store = open_store(path)
        if isinstance(store, LocalStore):  # a directory: its manifest, or the journal of a stream not closed
            manifest = load_manifest(store.path)
        else:
            manifest = parse_manifest(store.read_manifest(), source=store.describe(MANIFEST_FILENAME))
        bundle = cls(store.path, manifest, verify=verify, source=store)
        _check_references(bundle._store, manifest)
        return bundle

    def _recorded(self) -> RecordedCalls:
        return self._rc

    @property
    def root(self) -> Store:
        """Where the bundle's files lie (a directory, a packed file or a URL), read through every check."""
        return self._store.bundle_root

    @property
    def packed(self) -> bool:
        """True when the bundle is one file written by ``iobundle pack`` (read in place), False for a directory."""
        return isinstance(self.root, TarStore)

    @property
    def remote(self) -> bool:
        """True when the bundle was opened from a URL (through fsspec), False for a local path."""
        return isinstance(self.path, str)

    @property
    def calls(self) -> list[CallEntry]:
        """Every recorded call, failed ones included."""
        return list(self._rc.calls)

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key`` (memory-mapped, read-only use)."""
        return self._store.get(key)

    def outputs(self, index: int) -> Any:
        """The recorded outputs of ok call ``index``, rebuilt as Python values."""
        call = self._rc.ok_calls[index]
        return None if call.outputs is None else build_value(call.outputs, self._store.get)

    def verify(self, *, hashes: bool = True, on_progress: ProgressCallback | None = None) -> list[str]:
        """Check every file the manifest lists: size and hash (the algorithm the manifest names), and each tensor file's header.

        The stored model's files (``manifest.model.files``: config and weights) are checked too.

        Args:
            hashes: Hash each file; False checks only that it is there with its size and header
                (what ``iobundle inspect`` does: no file is read past its header).
            on_progress: Called with a :class:`~iobundle.replay.ProgressEvent` (task ``"verify"``,
                counted in bytes) before the first file and after each one, the file's name as detail.

        Files the manifest does not list are not checked (nothing reads them), but each one that
        :meth:`unlisted_files` reports is logged as a warning: a killed writer's leftovers, say.

        Returns:
            One message per bad file, naming it (empty when every file is good).
        """
        for message in self.unlisted_files():
            logger.warning("%s", message)
        problems = []
        files = listed_files(self.manifest)
        total = sum(entry.size for entry in files.values())
        done = 0
        notify(on_progress, "verify", 0, total, unit=BYTES)
        for name, entry in files.items():
            try:
                segment = entry.ranges is not None  # a segment's header is checked against its ranges
                if not hashes and name in self.manifest.files and not segment:  # one open: its size, then its header
                    check_file_header(self.root, name, self._store.file_entries(name), size=entry.size)
                else:
                    check_file(self.root, name, entry, hash_check=hashes)
                    if segment:
                        check_segment_member(self.root, name, entry, self._store.file_entries(name))
                    elif name in self.manifest.files:
                        check_file_header(self.root, name, self._store.file_entries(name))
            except IobundleError as exc:
                problems.append(str(exc))
            done += entry.size
            notify(on_progress, "verify", done, total, name, unit=BYTES)
        return problems

    def unlisted_files(self) -> list[str]:
        """One message per file of the bundle directory that the manifest does not list, naming it.

        Reported: every file of a name iobundle's writers give (what a writer killed mid-write
        left: ``calls/.NNNNNN.safetensors.tmp``, a call file or segment renamed or created before
        its journal line, a journal beside the manifest), and any other entry of ``calls/``. Other
        files beside the bundle are the user's and not reported. Nothing reads such files; the
        writers' ones are removed when the bundle is replaced (``overwrite=True``, ``--overwrite``)
        or when a stream to it is closed, the others never. A bundle opened from a packed file or a
        URL reports none (a packed bundle holds only the files it lists).
        """
        if not isinstance(self.path, Path) or self.packed or not self.path.is_dir():
            return []
        found, closed = unlisted_files(LocalStore(self.path), listed_files(self.manifest))
        messages = []
        for name, kind, writer in sorted(found):
            where = self.path / name
            if writer and kind == FILE:
                who = (
                    "a writer killed while writing the bundle left it"
                    if closed
                    else f"the stream's writer is writing it, or was killed while writing it ({JOURNAL_FILENAME}, "
                    "no manifest yet)"
                )
                messages.append(
                    f"{where}: not listed by the manifest; {who}. "
                    "Nothing reads it; replacing the bundle (overwrite=True, --overwrite) removes it."
                )
            else:
                what = {FILE: "a file", LINK: "a symbolic link", DIR: "a folder"}.get(kind, "a special file")
                messages.append(
                    f"{where}: {what} the manifest does not list, among the bundle's tensor files. Nothing reads "
                    "it and iobundle never removes it: move it out of the bundle if it is yours."
                )
        return messages


def _check_references(store: BundleTensorStore, manifest: Manifest) -> None:
    """Check what the manifest points at before anything is read: file names, tensor keys, tensor sizes.

    One pass over the files, one over the tensors and one over the trees, each a dict or set
    lookup per item; the messages of the failures are worked out only when one is found.

    Raises:
        UnsafeBundleError: A file name leaves the bundle, a tensor lives in an unlisted file or needs
            more bytes than its file has, or a tree refers to a tensor the manifest does not list.
    """
    store.bundle_root.check_all(manifest.files)
    if type(manifest) is Manifest:  # format version 1 or 2: a compact manifest's rows were checked when read
        store.check_sizes()
    keys: list[str] = []
    for e in manifest.value_if_missing:
        collect_tensor_keys(e.value, keys)
    for call in deferred_calls(manifest):
        listed = deferred_keys(call)  # format version 3: the keys of the row, no tree walked
        if listed is not None:
            keys += listed
            continue
        keys += call_shape(call).keys  # the inputs' keys (inference reuses the walk)
        for tree in (call.outputs, call.state):
            if tree is not None:
                collect_tensor_keys(tree, keys)
    if not all(map(tensor_rows(manifest).__contains__, keys)):
        _report_unknown_key(manifest)


def _report_unknown_key(manifest: Manifest) -> None:
    """Raise for the first tree (in manifest order) that refers to a tensor the manifest does not list."""
    for where, tree in manifest_trees(manifest):
        for node in iter_tensor_nodes(tree):
            if node.key not in manifest.tensors:
                raise UnsafeBundleError(
                    f"{where} refers to tensor {node.key!r}, which the manifest's tensors do not list."
                )


def load_bundle(path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
    """Open the bundle at ``path``; same as :meth:`Bundle.load`."""
    return Bundle.load(path, verify=verify)
