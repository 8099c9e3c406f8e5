"""Read tensors from a bundle's safetensors files, treating every byte as untrusted.

The order of the checks is what makes reading a hostile file safe:

1. the file name stays inside the bundle (no absolute path, no ``..``, no control character) and no
   component of it is a symbolic link; and
2. the file is a regular file (a FIFO or a device would block or never end), opened without
   blocking (both :meth:`iobundle._store.Store.open`, for every place a bundle lives), and its size
   is the one the manifest records. Only then is it read: whole when small,
   else memory-mapped (a mapping past the end of a file is a SIGBUS, not an exception, so nothing
   is mapped before the size check). Its hash (the algorithm the manifest names: XXH3-128 in
   format version 2, sha256 in version 1) is checked on those bytes, the first time it is read,
   unless verification is off: each file is read once;
3. the header length fits in the file and under
   :data:`iobundle.calls._tensorfile_write.MAX_HEADER_BYTES`, the header is a JSON object, and every
   tensor the manifest puts in this file is there with the manifest's dtype and shape and a byte
   span inside the data area of exactly the right length (the checks
   :mod:`iobundle.calls._tensorfile_write` shares with the streaming observer's read-back);
4. only then do tensors view the bytes.

A segment (``FileEntry.ranges``) gets steps 1, 2 and 4, its tensors' spans from the manifest
(``TensorEntry.offset``); it may be longer than its size (a killed writer's bytes, never read), its
hash is checked range by range, and a sealed header (version 6) must agree with the manifest
(:func:`check_segment_header`).

A tensor stored as an extension of another (format version 2, ``TensorEntry.extends``) is rebuilt
on each read: its chain of parts (which the manifest checks bounded and acyclic) is read, each part
checked as above, and concatenated once. Shapes never need the bytes.

Mappings are made by ``torch.from_file``, which closes its file descriptor once the file is
mapped: a bundle of many thousands of calls can be read without running out of descriptors.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle._store import LocalStore, Store
from iobundle.calls._delta import rebuild
from iobundle.calls._dtypes import NAME_TO_DTYPE
from iobundle.calls._hashing import new_hasher
from iobundle.calls._tensorfile_write import parse_header, read_exactly, tensor_span
from iobundle.errors import IntegrityError, TensorFileError, UnsafeBundleError
from iobundle.schema import DTYPE_ITEMSIZES, FileEntry, Manifest, TensorInfo, tensor_rows

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = [
    "BundleTensorStore",
    "check_file",
    "check_segment_header",
    "check_segment_member",
    "check_file_header",
    "listed_files",
    "read_member",
]

_CHUNK = 1 << 22

READ_WHOLE_BYTES = 1 << 20
"""Tensor files up to this size are read whole, once: size, hash and header are checked on
those bytes and the tensors view them (four opens and a memory mapping cost more than the read)."""


def _check_ranges(name: str, entry: FileEntry, chunks: Iterable[memoryview]) -> None:
    """Hash the first ``entry.size`` bytes of segment ``name``, given as consecutive ``chunks``, range by range.

    Raises:
        IntegrityError: A range's digest differs from the manifest's.
    """
    ranges = entry.ranges or []
    j, position = 0, 0
    skip = ranges[0][1] if ranges else 0  # the header region (format version 6) is no range's
    hasher = new_hasher(entry.algorithm)
    for chunk in chunks:
        if position < skip:
            take = min(len(chunk), skip - position)
            chunk, position = chunk[take:], position + take
        while j < len(ranges):
            call, start, length, digest = ranges[j]
            take = min(len(chunk), start + length - position)
            hasher.update(chunk[:take])
            chunk, position = chunk[take:], position + take
            if position < start + length:
                break
            found = hasher.hexdigest()
            if found != digest:
                raise IntegrityError(
                    f"{name}: ranges[{j}] (call {call}, bytes {start}-{start + length}): {entry.algorithm} {found} "
                    f"differs from the manifest ({digest}). The file is corrupt or was changed."
                )
            j, hasher = j + 1, new_hasher(entry.algorithm)


def _hash_file(f: io.RawIOBase | io.BufferedIOBase, name: str, entry: FileEntry) -> None:
    """Check the digest of member ``name`` (a segment: each range's, over its first ``entry.size`` bytes), read from
    ``f`` in chunks; IntegrityError when one differs from the manifest's, or the file changed while it was read."""
    segment = entry.ranges is not None
    buffer = memoryview(bytearray(max(1, min(_CHUNK, entry.size + 1))))  # + 1: EOF in the same read

    def chunks() -> Iterable[memoryview]:
        done = 0
        while n := f.readinto(buffer[: min(entry.size - done, len(buffer))] if segment else buffer):
            done += n
            yield buffer[:n]
        if done != entry.size:
            raise IntegrityError(f"{name}: changed while it was being read ({done} bytes, expected {entry.size}).")

    try:
        if segment:
            _check_ranges(name, entry, chunks())
            return
        hasher = new_hasher(entry.algorithm)
        for chunk in chunks():
            hasher.update(chunk)
    except OSError as exc:
        raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
    check_digest(name, entry, hasher.hexdigest())


def _size_problem(name: str, size: int, entry: FileEntry) -> IntegrityError | None:
    """The error for a member of ``size`` bytes whose manifest entry is ``entry``, or None if the size is good.

    A segment may be longer than its entry (bytes a killed writer appended past the last call it listed).
    """
    if size == entry.size or (entry.ranges is not None and size > entry.size):
        return None
    expected = f"at least {entry.size}" if entry.ranges is not None else str(entry.size)
    return IntegrityError(f"{name}: {size} bytes, the manifest says {expected}. The file is truncated or was changed.")


def listed_files(manifest: Manifest) -> dict[str, FileEntry]:
    """Every file ``manifest`` lists besides itself: its tensor files, then the stored model's files."""
    files = dict(manifest.files)
    if manifest.model is not None:
        files.update(manifest.model.files)
    return files


def check_file(store: Store, name: str, entry: FileEntry, *, hash_check: bool = True) -> None:
    """Check that bundle member ``name`` exists and has the recorded size (and hash), reading it once.

    Raises UnsafeBundleError (a name leading outside, a link), TensorFileError (missing, unreadable,
    not a regular file) or IntegrityError (its size or hash differs from the manifest).
    """
    f, size = store.open(name)
    with f:
        problem = _size_problem(name, size, entry)
        if problem is not None:
            raise problem
        if hash_check:
            _hash_file(f, name, entry)


def check_digest(name: str, entry: FileEntry, digest: str) -> None:
    """Compare the ``digest`` of bundle member ``name`` (hashed with ``entry.algorithm``) with the manifest's.

    Raises:
        IntegrityError: They differ.
    """
    if digest != entry.hexdigest:
        raise IntegrityError(
            f"{name}: {entry.algorithm} {digest} differs from the manifest ({entry.hexdigest}). "
            "The file is corrupt or was changed."
        )


def _read_header(store: Store, name: str, expected: int | None = None) -> tuple[dict[str, Any], int, int]:
    """Return ``(header, data_start, file_size)`` of a safetensors file, reading nothing past the header.

    Raises:
        IntegrityError: ``expected`` is given and is not the file's size.
    """
    f, size = store.open(name)
    if expected is not None and size != expected:
        f.close()
        raise IntegrityError(
            f"{name}: {size} bytes, the manifest says {expected}. The file is truncated or was changed."
        )
    try:
        with f:
            header, data_start = parse_header(name, size, f.read)
    except OSError as exc:
        raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
    return header, data_start, size


def read_member(store: Store, name: str, entry: FileEntry, *, hash_check: bool = True) -> bytearray:
    """The whole bundle member ``name`` (small, or not mappable), checked as :func:`check_file` does, read once."""
    f, size = store.open(name)
    problem = _size_problem(name, size, entry)
    if problem is not None:
        f.close()
        raise problem
    if entry.ranges is not None:
        size = entry.size  # a segment's bytes past its size are no part of the bundle
    data = bytearray(size + 1)  # + 1: a file that grew is seen
    view, done = memoryview(data), 0
    try:
        with f:
            while done <= size and (n := f.readinto(view[done:])):
                done += n
    except OSError as exc:
        raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
    finally:
        view.release()
    if done != entry.size and (entry.ranges is None or done < entry.size):
        raise IntegrityError(f"{name}: changed while it was being read ({done} bytes, expected {entry.size}).")
    del data[size:]
    if hash_check:
        check_bytes(name, entry, data)
    return data


def check_segment_header(name: str, head: bytes, entry: FileEntry, entries: dict[str, TensorInfo]) -> None:
    """Check the header of segment ``name`` (its first bytes ``head``, up to its first range) against the manifest.

    ``entries`` are the segment's tensors as stored (:meth:`BundleTensorStore.file_entries`). A
    header of length 0 is an unsealed segment's, which claims nothing (format version 4 and 5
    segments have no header region, nothing to check).

    Raises:
        TensorFileError: The header is unreadable or disagrees with the manifest (its length, a
            tensor's name, key, dtype, stored shape or data_offsets, a tensor too many or missing).
    """
    start = entry.ranges[0][1] if entry.ranges else 0
    if start == 0 or not any(head[:8]):
        return
    header, data_start = parse_header(name, len(head), io.BytesIO(head).read)
    if data_start != start:
        raise TensorFileError(
            f"{name}: the header ends at byte {data_start}, but the manifest's first range starts at {start}. "
            "The file was changed or is not this bundle's."
        )
    meta = header.pop("__metadata__", None)
    keys: dict[str, str] = {}
    for tensor in header:
        key = meta.get(tensor) if isinstance(meta, dict) else None
        if type(key) is not str or key not in entries:
            raise TensorFileError(
                f"{name}: tensor {tensor!r} of the header is {_key_problem(key)}. The file disagrees with the manifest."
            )
        keys[tensor] = key
    if len(set(keys.values())) != len(entries):
        missing = sorted(entries.keys() - set(keys.values()))
        raise TensorFileError(
            f"{name}: the header lists {len(keys)} tensors, the manifest {len(entries)} "
            f"(missing: {', '.join(map(repr, missing[:5]))}). The file disagrees with the manifest."
        )
    for tensor, key in keys.items():
        e = entries[key]
        begin, _ = tensor_span(name, header, tensor, dtype=e.dtype, shape=e.shape, data_len=entry.size - start, key=key)
        if e.offset is not None and begin != e.offset - start:
            raise TensorFileError(
                f"{name}: tensor {tensor!r} (key {key!r}) starts at byte {begin} of the data, "
                f"the manifest says {e.offset - start}. The file disagrees with the manifest."
            )


def check_segment_member(store: Store, name: str, entry: FileEntry, entries: dict[str, TensorInfo]) -> None:
    """:func:`check_segment_header` on the header region of the segment ``name`` (read from the file)."""
    if entry.ranges and entry.ranges[0][1]:
        f, _ = store.open(name)
        try:
            with f:
                head = read_exactly(f, entry.ranges[0][1], name)
        except OSError as exc:
            raise TensorFileError(f"{name}: cannot be read ({exc.strerror or exc}).") from exc
        check_segment_header(name, head, entry, entries)


def _key_problem(key: object) -> str:
    if type(key) is not str:
        return "named by no key of __metadata__"
    return f"key {key[:80]!r} in __metadata__, which the manifest does not put in this file"


def check_bytes(name: str, entry: FileEntry, data: Any) -> None:
    """Check the digest (a segment: each range's) of member ``name`` on its bytes as read (a buffer); IntegrityError if not."""
    with memoryview(data) as view:
        if entry.ranges is not None:
            _check_ranges(name, entry, [view[: entry.size]])
            return
        hasher = new_hasher(entry.algorithm)
        hasher.update(view)
    check_digest(name, entry, hasher.hexdigest())


def _tensor_span(name: str, header: dict[str, Any], entry: TensorInfo, key: str, data_len: int) -> tuple[int, int]:
    """Check one tensor of the header against its manifest entry; return its byte span in the data area."""
    return tensor_span(name, header, entry.name, dtype=entry.dtype, shape=entry.shape, data_len=data_len, key=key)


def check_file_header(
    store: Store, name: str, entries: dict[str, TensorInfo], *, size: int | None = None
) -> tuple[dict[str, tuple[int, int]], int, int]:
    """Check the header of bundle member ``name`` against the manifest entries of the tensors it holds.

    With ``size`` (the manifest's), the file's size is checked first, on the same open file.

    Returns:
        ``(spans, data_start, file_size)``: per tensor key, its ``[begin, end)`` span in the data area.

    Raises:
        TensorFileError: The header is unreadable, or disagrees with the manifest.
        IntegrityError: The file does not have ``size`` bytes.
    """
    header, data_start, size = _read_header(store, name, size)
    spans = {key: _tensor_span(name, header, entry, key, size - data_start) for key, entry in entries.items()}
    return spans, data_start, size


@dataclass
class _OpenFile:
    """A tensor file of the bundle, open: where each tensor's bytes are (``spans``, from ``data_start``) in ``data``."""

    name: str
    data_start: int
    spans: dict[str, tuple[int, int]]
    data: torch.Tensor | None

    @classmethod
    def from_bytes(cls, name: str, data: bytearray | torch.Tensor, entries: dict[str, TensorInfo]) -> _OpenFile:
        """The file whose whole content is ``data`` (read by :func:`read_member`, or mapped); tensors view it."""
        view, position = data.numpy().data if isinstance(data, torch.Tensor) else memoryview(data), 0

        def read(n: int) -> bytes:
            nonlocal position
            position += n
            return bytes(view[position - n : position])

        header, data_start = parse_header(name, len(view), read)
        size = len(view)
        spans = {key: _tensor_span(name, header, e, key, size - data_start) for key, e in entries.items()}
        if not any(end > begin for begin, end in spans.values()):
            return cls(name, data_start, spans, None)
        tensor = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
        return cls(name, data_start, spans, tensor)

    @classmethod
    def segment(cls, name: str, data: torch.Tensor | None, entries: dict[str, TensorInfo]) -> _OpenFile:
        """The segment whose bytes ``data`` holds (read whole, or mapped); spans from the entries' offsets.

        The offsets were checked against the ranges when the manifest was read (and ``data`` holds them all).
        """
        spans = {}
        for key, e in entries.items():
            begin = e.offset if e.offset is not None else 0
            spans[key] = (begin, begin + math.prod(e.shape) * DTYPE_ITEMSIZES[e.dtype])
        return cls(name, 0, spans, data)

    def tensor(self, entry: TensorInfo, key: str) -> torch.Tensor:
        begin, end = self.spans[key]
        dtype = NAME_TO_DTYPE[entry.dtype]
        if end == begin or self.data is None:
            return torch.empty(entry.shape, dtype=dtype)
        flat = self.data[self.data_start + begin : self.data_start + end]
        if (self.data_start + begin) % dtype.itemsize:
            flat = flat.clone()  # unaligned (not written by iobundle): copy instead of viewing
        return flat.view(dtype).reshape(entry.shape)


class BundleTensorStore:
    """Tensors of a bundle, read lazily (memory-mapped) and checked on first use.

    Args:
        root: The bundle directory (or packed file, or URL).
        manifest: Its validated manifest (whose references :func:`iobundle.replay._bundle._check_references` checked).
        verify: Check each file's hash the first time it is read. Sizes and headers are always checked.
        bundle_root: Where its members are read, when not the directory ``root``.
    """

    def __init__(
        self, root: Path | str, manifest: Manifest, *, verify: bool = True, bundle_root: Store | None = None
    ) -> None:
        self.root = root
        self.bundle_root: Store = LocalStore(root) if bundle_root is None else bundle_root
        self.manifest = manifest
        self.verify = verify
        self._rows = tensor_rows(manifest)  # the compact rows opening kept: no TensorEntry is built
        self._files: dict[str, _OpenFile] = {}
        self._by_file: dict[str, dict[str, TensorInfo]] | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _entry(self, key: str) -> TensorInfo:
        try:
            return self._rows[key]
        except (KeyError, TypeError):
            raise TensorFileError(
                f"Tensor {key!r} is referenced by a call but missing from the manifest's tensors."
            ) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return NAME_TO_DTYPE[self._entry(key).dtype]

    def device(self, key: str) -> torch.device:
        """Where :meth:`get` puts ``key`` (the CPU), known without reading it."""
        self._entry(key)
        return torch.device("cpu")

    def safetensors_dtype(self, key: str) -> str:
        """The manifest's dtype name of ``key`` (``"F32"``): :meth:`dtype` without torch."""
        return self._entry(key).dtype

    def shapes(self, keys: list[str]) -> list[tuple[int, ...]]:
        """``[shape(key) for key in keys]``, looked up in one pass (what inference compares across calls)."""
        try:
            return [row.shape for row in map(self._rows.__getitem__, keys)]
        except (KeyError, TypeError):
            return [self.shape(key) for key in keys]  # raises for an unknown key

    def check_sizes(self) -> None:
        """Check that every tensor lives in a listed file that is large enough for what it stores.

        An extension (format version 2) stores the part past the tensor it extends. Nothing is
        read: the sizes are the manifest's, and each file's real size is checked when it is opened.

        Raises:
            UnsafeBundleError: A tensor lives in an unlisted file or needs more bytes than its file has.
        """
        rows = self._rows
        sizes = {name: file.size for name, file in self.manifest.files.items()}
        itemsize = DTYPE_ITEMSIZES
        prod = math.prod
        for key, (file, _, dtype, shape, _, extends, offset) in rows.items():
            size = sizes.get(file)
            if size is None:
                raise UnsafeBundleError(f"tensors[{key!r}].file: {file!r} is not listed in the manifest's files.")
            nbytes = prod(shape) * itemsize[dtype]
            if extends is not None and nbytes and (base := rows.get(extends[0])) is not None:
                dim = extends[1]
                length = shape[dim]  # the manifest's checks: the base is no longer along dim
                nbytes = nbytes // length * (length - base.shape[dim])
            if nbytes > size or (offset is not None and offset + nbytes > size):
                raise UnsafeBundleError(
                    f"tensors[{key!r}]: {dtype} {list(shape)} needs {nbytes} bytes but its file {file!r} has {size}."
                )

    def file_entries(self, name: str) -> dict[str, TensorInfo]:
        """The tensors stored in file ``name`` as the file holds them (indexed once).

        An extension's row gets the shape of its stored part (and no ``extends``).
        """
        by_file = self._by_file
        if by_file is None:
            by_file = {}
            rows, new = self._rows, tuple.__new__  # a namedtuple's _replace is Python code: one call per row
            for key, row in rows.items():
                file, name_in_file, dtype, shape, device, extends, offset = row
                if extends is not None:  # the part past the base along dim
                    dim = extends[1]
                    shape = (*shape[:dim], shape[dim] - rows[extends[0]].shape[dim], *shape[dim + 1 :])
                    row = new(TensorInfo, (file, name_in_file, dtype, shape, device, None, offset))
                by_file.setdefault(file, {})[key] = row
            self._by_file = by_file
        return by_file.get(name, {})

    def _open(self, name: str) -> _OpenFile:
        opened = self._files.get(name)
        if opened is None:
            entry = self.manifest.files.get(name)
            if entry is None:
                raise TensorFileError(f"File {name!r} is used by a tensor but not listed in the manifest's files.")
            try:
                data: Any = self._bytes(name, entry)
                if entry.ranges is None:
                    opened = _OpenFile.from_bytes(name, data, self.file_entries(name))
                else:  # a segment: its spans are the manifest's offsets, its sealed header checked against them
                    if isinstance(data, bytearray):
                        data = torch.frombuffer(data, dtype=torch.uint8) if data else None
                    if data is not None and entry.ranges:
                        head = data[: entry.ranges[0][1]].numpy().tobytes()
                        check_segment_header(name, head, entry, self.file_entries(name))
                    opened = _OpenFile.segment(name, data, self.file_entries(name))
            except TensorFileError as exc:  # say which bundle: a command may read two (diff)
                raise type(exc)(f"{exc} (bundle '{self.root}')") from exc
            self._files[name] = opened
        return opened

    def _bytes(self, name: str, entry: FileEntry) -> bytearray | torch.Tensor:
        """The first ``entry.size`` bytes of member ``name``, read whole (small, or not mappable) or memory-mapped,
        hashed as read when verifying: one read of the file."""
        data = None
        if entry.size > READ_WHOLE_BYTES:
            check_file(self.bundle_root, name, entry, hash_check=False)  # its size, before anything is mapped
            try:
                data = self.bundle_root.map(name, entry.size)
            except (RuntimeError, OSError, ValueError) as exc:
                raise TensorFileError(f"{name}: cannot be memory-mapped ({exc}).") from exc
        if data is None:
            return read_member(self.bundle_root, name, entry, hash_check=self.verify)
        if self.verify:
            check_bytes(name, entry, data.numpy())
        return data

    def _stored(self, key: str) -> torch.Tensor:
        """What the file holds for ``key``: the tensor, or its new part if it is an extension (cached views)."""
        tensor = self._cache.get(key)
        if tensor is None:
            entry = self._entry(key)
            with self._lock:
                tensor = self._cache.get(key)
                if tensor is None:
                    stored = self.file_entries(entry.file).get(key, entry)
                    tensor = self._cache[key] = self._open(entry.file).tensor(stored, key)
        return tensor

    def get(self, key: str) -> torch.Tensor:
        entry = self._entry(key)
        if entry.extends is None:
            return self._stored(key)
        parts = []
        while entry.extends is not None:  # the manifest's checks bound the chain and rule out cycles
            parts.append((self._stored(key), entry.extends[1]))
            key = entry.extends[0]
            entry = self._entry(key)
        return rebuild(self._stored(key), parts[::-1])
