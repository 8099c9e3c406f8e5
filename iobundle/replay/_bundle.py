"""``Bundle``: a bundle opened from disk, without the model, with the same inference API as ``InputObserver``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from iobundle.capture._api import RecordedCallsAPI
from iobundle.capture._calls import RecordedCalls
from iobundle.capture._tree import build_value, iter_tensor_nodes
from iobundle.errors import IobundleError, UnsafeBundleError
from iobundle.replay._tensorfile import BundleTensorStore, check_file, safe_member_path
from iobundle.schema import CallEntry, Manifest, load_manifest

__all__ = ["Bundle", "load_bundle"]


class Bundle(RecordedCallsAPI):
    """A bundle read from disk: its manifest, its calls, lazily loaded tensors.

    Use :meth:`load` (or :func:`iobundle.load_bundle`). Loading never imports or
    unpickles anything named by the bundle; tensors are memory-mapped on first use and
    their file's sha256 checked then (unless ``verify=False``).
    """

    def __init__(self, path: Path, manifest: Manifest, *, verify: bool = True) -> None:
        self.path = path
        self.manifest = manifest
        self._store = BundleTensorStore(path, manifest, verify=verify)
        self._rc = RecordedCalls(
            signature=manifest.signature,
            calls=list(manifest.calls),
            store=self._store,
            value_if_missing=list(manifest.value_if_missing),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
        """Open the bundle at ``path``.

        Args:
            path: The bundle directory.
            verify: Check each tensor file's sha256 the first time it is read.

        Raises:
            BundleNotFoundError: ``path`` is not a bundle.
            ManifestError: The manifest is invalid, names unsafe paths, or refers to missing tensors.
        """
        root = Path(path)
        manifest = load_manifest(root)
        _check_references(root, manifest)
        return cls(root, manifest, verify=verify)

    def _recorded(self) -> RecordedCalls:
        return self._rc

    @property
    def calls(self) -> list[CallEntry]:
        """Every recorded call, failed ones included."""
        return list(self._rc.calls)

    def tensor(self, key: str) -> Any:
        """The tensor stored under ``key`` (memory-mapped, read-only use)."""
        return self._store.get(key)

    def outputs(self, index: int) -> Any:
        """The recorded outputs of ok call ``index``, rebuilt as Python values."""
        call = self._rc.ok_calls[index]
        return None if call.outputs is None else build_value(call.outputs, self._store.get)

    def verify(self) -> list[str]:
        """Check every tensor file's size and sha256; return one message per bad file (empty if all good)."""
        problems = []
        for name, entry in self.manifest.files.items():
            try:
                check_file(self.path, name, entry, hash_check=True)
            except IobundleError as exc:
                problems.append(str(exc))
        return problems


def _check_references(root: Path, manifest: Manifest) -> None:
    for name in manifest.files:
        safe_member_path(root, name)
    for key, entry in manifest.tensors.items():
        if entry.file not in manifest.files:
            raise UnsafeBundleError(f"Tensor {key!r} lives in {entry.file!r}, which the manifest's files do not list.")
    nodes = [n for e in manifest.value_if_missing for n in iter_tensor_nodes(e.value)]
    for call in manifest.calls:
        for node in [*call.args, *call.kwargs.values(), *([call.outputs] if call.outputs else [])]:
            nodes.extend(iter_tensor_nodes(node))
    for node in nodes:
        if node.key not in manifest.tensors:
            raise UnsafeBundleError(f"A call refers to tensor {node.key!r}, which the manifest's tensors do not list.")


def load_bundle(path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
    """Open the bundle at ``path``; same as :meth:`Bundle.load`."""
    return Bundle.load(path, verify=verify)
