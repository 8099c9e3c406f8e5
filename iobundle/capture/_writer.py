"""Write recorded calls as a bundle: ``calls/*.safetensors`` first, ``manifest.json`` last."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from iobundle import __version__
from iobundle.capture._calls import RecordedCalls
from iobundle.capture._dtypes import dtype_name
from iobundle.capture._tensorfile import write_tensor_file
from iobundle.capture._tree import tensor_keys
from iobundle.errors import BundleExistsError, BundleWriteError
from iobundle.schema import MANIFEST_FILENAME, CallEntry, FileEntry, Manifest, Producer, TensorEntry, write_manifest

__all__ = ["BundleWriter", "save_recorded_calls"]

CALLS_DIR = "calls"
MISSING_FILE = f"{CALLS_DIR}/value_if_missing.safetensors"


def call_file_name(index: int) -> str:
    return f"{CALLS_DIR}/{index:06d}.safetensors"


def _producer(devices: Iterable[str]) -> Producer:
    transformers = sys.modules.get("transformers")
    return Producer(
        iobundle=__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        transformers=getattr(transformers, "__version__", None),
        devices=sorted(set(devices)),
    )


def call_keys(call: CallEntry) -> list[str]:
    """Every tensor key a call refers to: inputs, then outputs."""
    keys = [k for a in call.args for k in tensor_keys(a)]
    keys += [k for v in call.kwargs.values() for k in tensor_keys(v)]
    if call.outputs is not None:
        keys += tensor_keys(call.outputs)
    return keys


class BundleWriter:
    """Writes a bundle incrementally: one tensor file per call, the manifest rewritten atomically.

    Args:
        path: The bundle directory; created if missing.
        overwrite: Replace what ``path`` holds. Without it a non-empty directory is refused.

    Raises:
        BundleExistsError: ``path`` is not empty and ``overwrite`` is False.
        BundleWriteError: ``path`` cannot be created or cleared.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.path = Path(path)
        try:
            if self.path.exists() and not self.path.is_dir():
                raise BundleExistsError(f"'{self.path}' exists and is not a directory. Choose another path.")
            if self.path.is_dir() and any(self.path.iterdir()):
                if not overwrite:
                    raise BundleExistsError(
                        f"'{self.path}' already exists and is not empty. Pass overwrite=True "
                        "(--overwrite on the command line) to replace it, or choose another path."
                    )
                # The manifest goes first: a directory without one is never taken for a bundle.
                (self.path / MANIFEST_FILENAME).unlink(missing_ok=True)
                shutil.rmtree(self.path / CALLS_DIR, ignore_errors=True)
            (self.path / CALLS_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BundleWriteError(f"Cannot prepare '{self.path}': {exc.strerror or exc}.") from exc
        self.tensors: dict[str, TensorEntry] = {}
        self.files: dict[str, FileEntry] = {}

    def write_tensors(self, file: str, keys: Iterable[str], rc: RecordedCalls) -> None:
        """Write the tensors of ``keys`` not written yet into ``file`` (nothing if all were)."""
        todo = {k: rc.store.get(k) for k in dict.fromkeys(keys) if k not in self.tensors}
        if not todo:
            return
        self.files[file] = write_tensor_file(self.path / file, todo)
        for key, t in todo.items():
            name = dtype_name(t.dtype)
            assert name is not None  # write_tensor_file refused other dtypes
            self.tensors[key] = TensorEntry(file=file, name=key, dtype=name, shape=list(t.shape), device=str(t.device))

    def write_call(self, call: CallEntry, rc: RecordedCalls) -> None:
        self.write_tensors(call_file_name(call.index), call_keys(call), rc)

    def write_missing_values(self, rc: RecordedCalls) -> None:
        self.write_tensors(MISSING_FILE, [k for e in rc.value_if_missing for k in tensor_keys(e.value)], rc)

    def write_manifest(self, rc: RecordedCalls) -> Manifest:
        """Write ``manifest.json`` for the calls written so far (atomically)."""
        manifest = Manifest(
            producer=_producer(e.device for e in self.tensors.values()),
            signature=rc.signature,
            value_if_missing=rc.value_if_missing,
            calls=[c for c in rc.calls if all(k in self.tensors for k in call_keys(c))],
            tensors=self.tensors,
            files=self.files,
        )
        write_manifest(self.path, manifest)
        return manifest


def save_recorded_calls(rc: RecordedCalls, path: str | os.PathLike[str], *, overwrite: bool = False) -> Manifest:
    """Write every call of ``rc`` to the bundle directory ``path`` and return the manifest."""
    writer = BundleWriter(path, overwrite=overwrite)
    writer.write_missing_values(rc)
    for call in rc.calls:
        writer.write_call(call, rc)
    return writer.write_manifest(rc)
