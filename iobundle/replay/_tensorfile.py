"""Read tensors from a bundle's safetensors files, treating every byte as untrusted.

Sizes are checked against the manifest and the header before anything is memory-mapped
(a truncated mmap is a SIGBUS, not an exception), and a file's sha256 is checked the first
time it is read unless verification is off.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
from pathlib import Path, PurePosixPath

import torch

from iobundle.capture._dtypes import NAME_TO_DTYPE
from iobundle.errors import IntegrityError, TensorFileError, UnsafeBundleError
from iobundle.schema import FileEntry, Manifest, TensorEntry

__all__ = ["MAX_HEADER_BYTES", "BundleTensorStore", "safe_member_path"]

MAX_HEADER_BYTES = 100 * 1024**2
_CHUNK = 1 << 22


def safe_member_path(root: Path, name: str) -> Path:
    """Resolve the bundle member ``name`` under ``root``, refusing anything that leaves it.

    Raises:
        UnsafeBundleError: ``name`` is absolute, contains ``..``, or resolves (through a symlink) outside ``root``.
    """
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or "\\" in name or ".." in pure.parts or name.startswith("/") or ":" in name:
        raise UnsafeBundleError(f"File name {name!r} in the manifest is not a plain relative path inside the bundle.")
    path = root / pure
    try:
        resolved = path.resolve()
        root_resolved = root.resolve()
    except (OSError, RuntimeError) as exc:
        raise UnsafeBundleError(f"File {name!r} cannot be resolved inside the bundle: {exc}.") from exc
    if not resolved.is_relative_to(root_resolved):
        raise UnsafeBundleError(
            f"File {name!r} leads outside the bundle directory (to {resolved}); refusing to read it."
        )
    return path


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of ``path``, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def check_file(root: Path, name: str, entry: FileEntry, *, hash_check: bool = True) -> None:
    """Check that bundle member ``name`` exists and has the recorded size (and sha256).

    Raises:
        TensorFileError: The file is missing or unreadable.
        IntegrityError: Its size or hash differs from the manifest.
    """
    path = safe_member_path(root, name)
    try:
        size = path.stat().st_size
        if size != entry.size:
            raise IntegrityError(
                f"{name}: {size} bytes, the manifest says {entry.size}. The file is truncated or was changed."
            )
        if hash_check:
            _, digest = sha256_file(path)
            if digest != entry.sha256:
                raise IntegrityError(
                    f"{name}: sha256 {digest} differs from the manifest ({entry.sha256}). The file is corrupt."
                )
    except FileNotFoundError as exc:
        raise TensorFileError(f"{name}: missing from the bundle.") from exc
    except OSError as exc:
        raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc


class _OpenFile:
    def __init__(self, name: str, path: Path, entries: dict[str, TensorEntry]) -> None:
        self.name = name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise TensorFileError(f"{name}: {size} bytes, too short for a safetensors header.")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                    raise TensorFileError(
                        f"{name}: header length {header_len} is past the end of the file ({size} bytes) or over the limit."
                    )
                header_bytes = f.read(header_len)
                self.data_start = 8 + header_len
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > self.data_start else None
        except OSError as exc:
            raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
        try:
            header = json.loads(header_bytes)
        except (ValueError, RecursionError) as exc:
            raise TensorFileError(f"{name}: the safetensors header is not valid JSON.") from exc
        if not isinstance(header, dict):
            raise TensorFileError(f"{name}: the safetensors header is not a JSON object.")
        data_len = size - self.data_start
        self.spans: dict[str, tuple[int, int]] = {}
        for key, entry in entries.items():
            info = header.get(entry.name)
            if not isinstance(info, dict):
                raise TensorFileError(f"{name}: tensor {entry.name!r} (key {key}) is not in the file.")
            offsets = info.get("data_offsets")
            if info.get("dtype") != entry.dtype or info.get("shape") != entry.shape:
                raise TensorFileError(
                    f"{name}: tensor {entry.name!r} is {info.get('dtype')} {info.get('shape')} in the file, "
                    f"{entry.dtype} {entry.shape} in the manifest."
                )
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            ):
                raise TensorFileError(f"{name}: tensor {entry.name!r} has invalid data_offsets {offsets!r}.")
            begin, end = offsets
            dtype = NAME_TO_DTYPE[entry.dtype]
            numel = 1
            for d in entry.shape:
                numel *= d
            expected = numel * dtype.itemsize
            if not 0 <= begin <= end <= data_len or end - begin != expected:
                raise TensorFileError(
                    f"{name}: tensor {entry.name!r} spans bytes [{begin}, {end}) but needs {expected} bytes "
                    f"inside a data area of {data_len} bytes."
                )
            self.spans[key] = (begin, end)

    def tensor(self, entry: TensorEntry, key: str) -> torch.Tensor:
        begin, end = self.spans[key]
        dtype = NAME_TO_DTYPE[entry.dtype]
        if end == begin or self.mmap is None:
            return torch.empty(entry.shape, dtype=dtype)
        flat = torch.frombuffer(self.mmap, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin)
        if (self.data_start + begin) % dtype.itemsize:
            flat = flat.clone()  # unaligned (not written by iobundle): copy instead of viewing
        return flat.view(dtype).reshape(entry.shape)


class BundleTensorStore:
    """Tensors of a bundle, read lazily (memory-mapped) and checked on first use.

    Args:
        root: The bundle directory.
        manifest: Its validated manifest.
        verify: Check each file's sha256 the first time it is read.
    """

    def __init__(self, root: Path, manifest: Manifest, *, verify: bool = True) -> None:
        self.root = root
        self.manifest = manifest
        self.verify = verify
        self._files: dict[str, _OpenFile] = {}
        self._cache: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise TensorFileError(
                f"Tensor {key!r} is referenced by a call but missing from the manifest's tensors."
            ) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key).shape)

    def dtype(self, key: str) -> torch.dtype:
        return NAME_TO_DTYPE[self._entry(key).dtype]

    def _open(self, name: str) -> _OpenFile:
        opened = self._files.get(name)
        if opened is None:
            entry = self.manifest.files.get(name)
            if entry is None:
                raise TensorFileError(f"File {name!r} is used by a tensor but not listed in the manifest's files.")
            check_file(self.root, name, entry, hash_check=self.verify)
            entries = {k: e for k, e in self.manifest.tensors.items() if e.file == name}
            opened = self._files[name] = _OpenFile(name, safe_member_path(self.root, name), entries)
        return opened

    def get(self, key: str) -> torch.Tensor:
        tensor = self._cache.get(key)
        if tensor is None:
            entry = self._entry(key)
            with self._lock:
                tensor = self._cache[key] = self._open(entry.file).tensor(entry, key)
        return tensor
