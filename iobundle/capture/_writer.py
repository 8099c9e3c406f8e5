"""Write recorded calls as a bundle: tensor files and segments first, ``manifest.json`` last.

A tensor that extends one written recently (a growing KV cache, a growing mask) is written as its
new part only, with a reference to the tensor it extends (``TensorEntry.extends``, format
version 2), once :class:`iobundle.calls.DeltaIndex` has checked the shared part byte for byte.

Where a call's tensors go (format version 6): each tensor whose stored bytes are under
:data:`SEGMENT_TENSOR_BYTES` is appended, with the call's other small ones, as one range of the
current segment (``calls/segment-NNNNNN.bin``, :class:`iobundle.calls.SegmentWriter`), named
``callNNNNNN/PATH`` there (:func:`iobundle.calls.call_paths`); the others go to the call's own
safetensors file (``calls/NNNNNN.safetensors``), memory-mapped when read. A decode step's few KiB
thus create no file. A new segment starts when the current one would pass
:data:`SEGMENT_MAX_BYTES` or its header would outgrow the region reserved for it, or when a small
tensor extends a tensor of a call's own file written after the current segment began (the
manifest lists an extended tensor before its extension, and lists each file's tensors together); a
small tensor that extends one of its own call's file goes to that file. A segment is sealed (its
safetensors header written) when the next one starts and when the writer closes it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from iobundle._atomic import fsync_dir, fsync_files, write_atomically
from iobundle._paths import FILE, LINK, Tree, link_message
from iobundle._progress import ProgressCallback, notify
from iobundle._remote import clear_local_bundle
from iobundle._store import LocalStore, remove_leftovers
from iobundle._version import __version__
from iobundle.calls import (
    DeltaIndex,
    PinnedStager,
    RecordedCalls,
    SegmentWriter,
    call_paths,
    dtype_name,
    seal_segment,
    segment_header_entry,
    tensor_bytes,
    tensor_keys,
    write_tensor_file,
)
from iobundle.capture._entries import TensorRow, call_keys, row_entry, unpack_answer
from iobundle.errors import BundleExistsError, BundleWriteError, IobundleError, UnsupportedInputError
from iobundle.schema import (
    DTYPE_ITEMSIZES,
    JOURNAL_FILENAME,
    MANIFEST_FILENAME,
    MISSING_VALUES_FILE,
    SEGMENT_FILE_NAME,
    CallEntry,
    Extension,
    FileEntry,
    Manifest,
    MissingValueEntry,
    Producer,
    TensorEntry,
    call_file_name,
    journal_call_line,
    journal_head_line,
    segment_file_name,
    write_manifest,
)

__all__ = ["BundleWriter", "save_recorded_calls"]

logger = logging.getLogger(__name__)

TensorGetter = Callable[[str], torch.Tensor]

CALLS_DIR = "calls"

SEGMENT_TENSOR_BYTES = 64 * 1024
"""A tensor whose stored bytes are fewer goes to a segment; a larger one to its call's own file."""

SEGMENT_MAX_BYTES = 16 * 1024**2
"""A segment is not grown past this size (unless one call's small tensors alone exceed it)."""

SEGMENT_HEADER_BYTES = (4096, 65536)
"""The header region a writer's first segment reserves (its data starts at 4 KiB), and the most any
later one does: each reserves twice the one before, so a few calls make a small file and a long
stream few files (and more when one call's tensors alone need more)."""


def _producer(devices: Iterable[str]) -> Producer:
    transformers = sys.modules.get("transformers")
    return Producer(
        iobundle=__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        transformers=getattr(transformers, "__version__", None),
        devices=sorted(set(devices)),
    )


class BundleWriter:
    """Writes a bundle incrementally: one tensor file per call, the manifest rewritten atomically.

    A tensor file gets its final name only once complete (temporary name, fsync, rename), and
    the manifest lists only calls whose files are complete, so the directory is a valid bundle
    after every :meth:`write_manifest`, whatever happens next.

    Writes made with ``durable=False`` skip the fsyncs (the renames keep them atomic for every
    process, not across a crash of the machine); :meth:`sync` flushes them to the disk later.

    Args:
        path: The bundle directory; created if missing.
        overwrite: Replace the bundle ``path`` holds: its manifest, then the files it lists, then
            what a killed writer left there (its journal, temporary files, files nothing lists yet),
            each by the exact name a writer gives (:func:`iobundle.schema.is_writer_file`); other
            files, in ``calls/`` or beside it, stay, and no link is followed. A stream killed before
            its manifest (a journal, no manifest) is replaced the same way. Without it a non-empty
            directory is refused, and with it one that holds no bundle.
        retain_all: Every tensor written may be extended by a later one (its memory is held
            anyway, as when saving an in-memory recording); see :class:`iobundle.calls.DeltaIndex`.
        deltas: Store tensors that extend earlier ones as their new part (format version 2).

    Raises:
        BundleExistsError: ``path`` is not empty and ``overwrite`` is False, or holds no bundle.
        BundleWriteError: ``path`` cannot be created or cleared.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        retain_all: bool = False,
        deltas: bool = True,
    ) -> None:
        self.path = Path(path)
        self.created = False
        try:
            if self.path.exists() and not self.path.is_dir():
                raise BundleExistsError(f"'{self.path}' exists and is not a directory. Choose another path.")
            if self.path.is_dir() and any(self.path.iterdir()):
                if not overwrite:
                    raise BundleExistsError(
                        f"'{self.path}' already exists and is not empty. Pass overwrite=True "
                        "(--overwrite on the command line) to replace it, or choose another path."
                    )
                with Tree(self.path, error=BundleExistsError) as tree:
                    journal, manifest = tree.kind(JOURNAL_FILENAME), tree.kind(MANIFEST_FILENAME)
                    calls = tree.kind(CALLS_DIR)
                if LINK in (journal, manifest, calls):
                    name = CALLS_DIR if calls == LINK else JOURNAL_FILENAME if journal == LINK else MANIFEST_FILENAME
                    raise BundleExistsError(
                        f"Cannot replace the bundle in '{self.path}': {link_message(self.path / name)} "
                        "Remove it yourself, or choose another path."
                    )
                if journal == FILE and manifest != FILE:
                    # a stream killed before its manifest: the journal first, then the files its writers named
                    removed = remove_leftovers(LocalStore(self.path, error=BundleExistsError))
                    logger.info("removed what the stream killed in %s left: %s", self.path, removed)
                elif manifest != FILE:
                    raise BundleExistsError(
                        f"'{self.path}' is not a bundle (no {MANIFEST_FILENAME}); refusing to replace what it "
                        "holds. Choose another path, or empty it yourself."
                    )
                else:
                    # its manifest first, then the files it lists and what a killed writer left; nothing else
                    clear_local_bundle(self.path)
            self.created = not self.path.exists()
            with Tree(self.path, error=BundleExistsError) as tree:
                tree.folder((CALLS_DIR,), create=True)  # never a link: the tensor files go inside the bundle
        except IobundleError:
            raise
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot prepare '{self.path}': {exc.strerror or exc}. Check the path, free space and permissions."
            ) from exc
        self._start({}, {}, (), DeltaIndex(retain_all=retain_all) if deltas else None)

    def _start(
        self,
        tensors: dict[str, TensorEntry],
        files: dict[str, FileEntry],
        call_indices: Iterable[int],
        deltas: DeltaIndex | None,
    ) -> None:
        self._tensors = dict(tensors)
        self._rows: list[TensorRow] = []  # adopted from another writer, not made entries yet
        self._packed: list[bytes] = []  # adopted as the writer process answered them: rows and files, pickled
        self._rows_lock = threading.Lock()
        self._files = dict(files)
        self._order = {name: i for i, name in enumerate(files)}  # file -> its position among the files listed
        self._segment: SegmentWriter | None = None  # resumed: a new one, the other writer may append to its own
        self._segments = sum(SEGMENT_FILE_NAME.fullmatch(name) is not None for name in files)
        self._opened = 0  # segments this writer created
        self._sealed: set[str] = set()  # and sealed
        self._unsynced: dict[Path, None] = {}
        self.deltas = deltas
        self.stager: PinnedStager | None = None  # made for the first CUDA tensor
        self._journal: int | None = None  # file descriptor of journal.jsonl while a stream is open
        self._call_indices = set(call_indices)

    @classmethod
    def resume(
        cls,
        path: str | os.PathLike[str],
        tensors: dict[str, TensorEntry],
        files: dict[str, FileEntry],
        call_indices: Iterable[int],
    ) -> BundleWriter:
        """A writer that continues the bundle another writer prepared in ``path`` (nothing is checked or cleared).

        ``tensors``, ``files`` and ``call_indices`` are what that writer wrote so far; tensors written
        before are never extended (the new writer holds none of them).
        """
        self = cls.__new__(cls)
        self.path = Path(path)
        self.created = False
        self._start(tensors, files, call_indices, DeltaIndex())
        return self

    @property
    def call_indices(self) -> frozenset[int]:
        """The indices of the calls written so far (by this writer or adopted)."""
        return frozenset(self._call_indices)

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        """Every tensor written so far, by key (the rows adopted from another writer become entries here)."""
        if self._packed or self._rows:
            with self._rows_lock:
                self._unpack()
                rows, self._rows = self._rows, []
            self._tensors.update((row[0], row_entry(row)) for row in rows)
        return self._tensors

    @property
    def files(self) -> dict[str, FileEntry]:
        """Every file written so far, by name (with those adopted from another writer)."""
        if self._packed:
            with self._rows_lock:
                self._unpack()
        return self._files

    def adopt(self, index: int, rows: list[TensorRow], files: dict[str, FileEntry]) -> None:
        """Take in what another writer of the same bundle wrote for call ``index`` (its files are synced there)."""
        with self._rows_lock:
            self._unpack()  # in the order they were written
            self._call_indices.add(index)
            self._rows.extend(rows)
            self._files.update(files)

    def adopt_packed(self, index: int, packed: bytes) -> None:
        """:meth:`adopt` of ``pickle.dumps((rows, files))`` as the writer process sends it, unpickled when first needed.

        The thread that reads the writer process's answers holds the interpreter lock the model's thread waits
        for: unpickled there, a 32-layer decode call's rows were 130 tuples for the cyclic collector and most of
        that thread's work.
        """
        with self._rows_lock:
            self._call_indices.add(index)
            self._packed.append(packed)

    def _unpack(self) -> None:
        """Make the packed answers rows and files (under ``_rows_lock``)."""
        for packed in self._packed:
            rows, files = unpack_answer(packed)
            self._rows.extend(rows)
            self._files.update(files)
        self._packed = []

    def write_tensors(
        self,
        file: str,
        keys: Iterable[str],
        get: TensorGetter,
        *,
        durable: bool = True,
        on_written: Callable[[str], None] | None = None,
        call: int | None = None,
        paths: dict[str, str] | None = None,
    ) -> list[str]:
        """Write the tensors of ``keys`` not written yet into ``file``; return their keys (none: no file).

        With ``call`` (the index of the call they belong to), the small ones go to the current
        segment instead, as one range (see the module docstring), named after their ``paths`` in the
        call (by key; the key when missing). ``on_written`` is called with each
        key once its bytes are in the file (before the file is complete): its memory may be reused
        from then on.

        Raises:
            BundleWriteError: The file cannot be written (disk full, permission denied).
            UnsupportedInputError: A tensor cannot be stored (its dtype or layout).
        """
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self.tensors]
        deltas = self.deltas
        if deltas is not None:
            deltas.touch(keys)
        if not new:
            return []
        whole = {k: get(k) for k in new}
        todo: dict[str, torch.Tensor] = {}
        extends: dict[str, Extension] = {}
        cuda = [t for t in whole.values() if t.device.type == "cuda"]
        if cuda and self.stager is None:
            self.stager = PinnedStager()
        pinned: list[torch.Tensor] = []
        small: list[str] = []
        own: dict[str, torch.Tensor] = {}
        target = self.path / file
        try:
            # CUDA work (byte comparisons, D2H copies) runs on a side stream: the model's stream never waits
            with self.stager.side_streams(cuda) if cuda and self.stager else contextlib.nullcontext():
                for key, t in whole.items():
                    match = deltas.find(t) if deltas is not None else None
                    if match is None:
                        todo[key] = t
                    else:
                        todo[key] = match.new
                        extends[key] = Extension(key=match.key, dim=match.dim)
                    if deltas is not None:
                        # retained before the write: the stream must not recycle its buffer once written
                        deltas.add(key, t, base=match.key if match else None, retain=deltas.should_retain(t))
                if cuda and self.stager is not None:
                    todo, pinned = self.stager.to_host(todo)
            small, roll = self._segment_keys(todo, extends) if call is not None else ([], False)
            own = {k: t for k, t in todo.items() if k not in small} if small else todo
            if own:
                self.files[file] = write_tensor_file(target, own, durable=durable, on_written=on_written)
            if small:
                assert call is not None
                segment = self._append(call, {k: todo[k] for k in small}, paths or {}, roll=roll, durable=durable)
                if on_written is not None:
                    for k in small:
                        on_written(k)
        except BaseException as exc:
            if own and small and self.files.pop(file, None) is not None:  # the call's own file, of a call not written
                with contextlib.suppress(OSError, IobundleError), Tree(self.path, error=BundleWriteError) as tree:
                    tree.unlink(file)
            if deltas is not None:
                deltas.forget(new)  # never written: no later tensor may extend them
            if isinstance(exc, OSError):
                raise BundleWriteError(
                    f"Cannot write {target}: {exc.strerror or exc}. Check free space and permissions."
                ) from exc
            raise
        finally:
            if pinned and self.stager is not None:
                self.stager.give_back(pinned)
        offsets: dict[str, int] = {}
        if small:
            position = self.files[segment].size - sum(todo[k].numel() * todo[k].element_size() for k in small)
            for k in small:
                offsets[k] = position
                position += todo[k].numel() * todo[k].element_size()
            self._order.setdefault(segment, len(self._order))
        if own:
            self._order.setdefault(file, len(self._order))
        # segment tensors first: a new segment is listed before the call's own file, whose tensors may extend them
        for key in [*small, *(k for k in whole if k not in offsets)]:
            t = whole[key]
            name = dtype_name(t.dtype)
            assert name is not None  # write_tensor_file refused other dtypes
            # built from values checked above (a dtype name, ints, an Extension): no validation needed
            self.tensors[key] = TensorEntry.model_construct(
                file=segment if key in offsets else file,
                name=key,
                dtype=name,
                shape=list(t.shape),
                device=str(t.device),
                extends=extends.get(key),
                offset=offsets.get(key),
            )
        if not durable:
            if own:
                self._unsynced[target] = None
            if small:
                self._unsynced[self.path / segment] = None
        logger.debug("wrote %d tensors to %s, %d to a segment", len(own), target, len(small))
        return new

    def _segment_keys(self, todo: dict[str, torch.Tensor], extends: dict[str, Extension]) -> tuple[list[str], bool]:
        """The keys of ``todo`` (what a call stores) that go to a segment, in order, and whether they start a new one.

        See the module docstring.
        """
        small: list[str] = []
        own: set[str] = set()
        roll = False
        current = self._order.get(segment_file_name(self._segments - 1), -1) if self._segment is not None else -1
        for key, t in todo.items():
            if dtype_name(t.dtype) is None:
                raise UnsupportedInputError(f"Tensor {key!r} has dtype {t.dtype}, which a bundle cannot store.")
            ext = extends.get(key)
            # complex128 (C128), which the safetensors library cannot read, keeps its call's file: segments stay readable
            big = t.numel() * t.element_size() >= SEGMENT_TENSOR_BYTES or t.dtype == torch.complex128
            if big or (ext is not None and ext.key in own):
                own.add(key)
                continue
            if ext is not None and ext.key not in small:
                base_file = self.tensors[ext.key].file
                base = self.files[base_file]
                if base.ranges is None and self._order.get(base_file, -1) > current:
                    roll = True  # a new segment, listed after that file
            small.append(key)
        return small, roll

    def _append(
        self, call: int, tensors: dict[str, torch.Tensor], paths: dict[str, str], *, roll: bool, durable: bool
    ) -> str:
        """Append ``tensors`` as call ``call``'s range of the current segment (a new one if needed); return its name."""
        parts = [tensor_bytes(t) for t in tensors.values()]
        length = sum(p.nbytes for p in parts)

        def entries(start: int) -> list[tuple[bytes, bytes]]:
            out = []
            for (key, t), part in zip(tensors.items(), parts):
                name = f"call{call:06d}/{paths.get(key, key)}"
                out.append(
                    segment_header_entry(name, key, str(dtype_name(t.dtype)), t.shape, start, start + part.nbytes)
                )
                start += part.nbytes
            return out

        segment = self._segment
        if segment is not None:
            added = entries(segment.size - segment.data_start)
            full = segment.size > segment.data_start and segment.size + length > SEGMENT_MAX_BYTES
            if roll or full or not segment.fits(added):
                self.close_segment(durable=durable)
                segment = None
        if segment is None:
            added = entries(0)
            first, most = SEGMENT_HEADER_BYTES
            need = sum(len(m) + len(t) for m, t in added) + 64
            reserve = max(min(first << self._opened, most), -(-need // first) * first) - 8
        while segment is None:
            name = segment_file_name(self._segments)
            self._segments += 1
            try:
                segment = self._segment = SegmentWriter(self.path / name, reserve)
            except FileExistsError:  # written by another writer of this bundle (a writer process): the next name
                continue
            self._opened += 1
            if durable:
                fsync_dir(self.path / CALLS_DIR)
        name = segment_file_name(self._segments - 1)
        segment.append(call, parts, added, durable=durable)
        self.files[name] = segment.entry()
        return name

    def write_call(
        self,
        call: CallEntry,
        get: TensorGetter,
        *,
        durable: bool = True,
        on_written: Callable[[str], None] | None = None,
    ) -> list[str]:
        """Write the tensors of ``call`` not written yet to ``calls/NNNNNN.safetensors``; return their keys.

        Raises:
            BundleWriteError: A call with the same index was written before (its file would be replaced).
        """
        if call.index in self._call_indices:
            raise BundleWriteError(
                f"Call {call.index} is written twice into '{self.path}': its file {call_file_name(call.index)} "
                "would replace the first one's. Each call of a bundle needs its own index."
            )
        self._call_indices.add(call.index)
        try:
            return self.write_tensors(
                call_file_name(call.index),
                call_keys(call),
                get,
                durable=durable,
                on_written=on_written,
                call=call.index,
                paths=_stored_names(call),
            )
        finally:
            if self.deltas is not None:
                self.deltas.end_call()

    def write_missing_values(
        self, entries: Iterable[MissingValueEntry], get: TensorGetter, *, durable: bool = True
    ) -> list[str]:
        """Write the tensors of ``value_if_missing`` to their own file."""
        return self.write_tensors(
            MISSING_VALUES_FILE, [k for e in entries for k in tensor_keys(e.value)], get, durable=durable
        )

    def close_segment(self, *, durable: bool = True) -> None:
        """Seal and close the segment being appended to (the next small call starts a new one).

        Raises:
            BundleWriteError: Its header cannot be written (its ranges stand; the journal reads them).
        """
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close(durable=durable)
            self._sealed.add(f"{CALLS_DIR}/{segment.path.name}")

    def sync(self) -> None:
        """fsync the files written with ``durable=False`` so far, their directories and the bundle's.

        Raises:
            BundleWriteError: A file cannot be flushed to the disk.
        """
        paths = list(self._unsynced)
        fsync_files(paths)
        fsync_dir(self.path)
        for path in paths:
            self._unsynced.pop(path, None)

    def manifest(self, rc: RecordedCalls, calls: Iterable[CallEntry] | None = None) -> Manifest:
        """The manifest of ``calls`` (default: ``rc.calls``), keeping only those whose tensors are written."""
        return Manifest(
            producer=_producer(e.device for e in self.tensors.values()),
            signature=rc.signature,
            value_if_missing=rc.value_if_missing,
            calls=[c for c in (rc.calls if calls is None else calls) if all(k in self.tensors for k in call_keys(c))],
            tensors=self.tensors,
            files=self.files,
        )

    def write_manifest(
        self, rc: RecordedCalls, calls: Iterable[CallEntry] | None = None, *, durable: bool = True
    ) -> Manifest:
        """Write ``manifest.json`` for ``calls`` (default: ``rc.calls``) atomically; see :meth:`manifest`.

        Raises:
            BundleWriteError: The manifest cannot be written; the previous one, if any, is left in place.
        """
        manifest = self.manifest(rc, calls)
        write_manifest(self.path, manifest, durable=durable)
        return manifest

    # -- the journal of a stream -------------------------------------------------------------

    def start_journal(self, rc: RecordedCalls, calls: Iterable[CallEntry], *, durable: bool = True) -> None:
        """Start ``journal.jsonl`` with what is written so far (``calls``), then remove ``manifest.json``.

        From then on each call is one appended line (:meth:`append_call`) and :meth:`finish_journal`
        writes the manifest once. Readers prefer ``manifest.json`` while both exist (they agree).

        Raises:
            BundleWriteError: The journal cannot be written.
        """
        path = self.path / JOURNAL_FILENAME
        write_atomically(path, [journal_head_line(self.manifest(rc, calls))], durable=durable)
        try:
            with Tree(self.path, error=BundleWriteError) as tree:
                tree.unlink(MANIFEST_FILENAME, missing_ok=True)
        except BundleWriteError:
            raise  # a link at manifest.json: the message names it
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot open {path}: {exc.strerror or exc}. Check free space and permissions."
            ) from exc
        self.open_journal()

    def open_journal(self) -> None:
        """Open the journal :meth:`start_journal` wrote, for appending (a writer that continues another's).

        Raises:
            BundleWriteError: The journal cannot be opened.
        """
        path = self.path / JOURNAL_FILENAME
        try:
            flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            self._journal = os.open(path, flags)  # never through a link swapped in after the atomic write
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot open {path}: {exc.strerror or exc}. Check free space and permissions."
            ) from exc

    def close_journal(self) -> None:
        """Close the journal and the segment without writing the manifest (another writer finishes it)."""
        self.close_segment()
        fd, self._journal = self._journal, None
        if fd is not None:
            os.close(fd)

    def append_call(self, call: CallEntry, keys: Iterable[str], *, durable: bool = True) -> None:
        """Append the line of ``call`` (whose new tensors ``keys`` are in a complete file) to the journal.

        Raises:
            BundleWriteError: The line cannot be written.
        """
        fd = self._journal
        assert fd is not None, "start_journal() first"
        tensors = {k: self.tensors[k] for k in keys}
        files = {e.file: self.files[e.file] for e in tensors.values()}
        for name, entry in files.items():
            if entry.ranges is not None:  # the line names the range this call appended, not the segment's others
                files[name] = FileEntry.model_construct(size=entry.size, hash=entry.hash, ranges=entry.ranges[-1:])
        line = journal_call_line(call, tensors, files)
        try:
            _write_all(fd, line)
            if durable:
                os.fsync(fd)
        except OSError as exc:
            raise BundleWriteError(
                f"Cannot append to {self.path / JOURNAL_FILENAME}: {exc.strerror or exc}. Check free space."
            ) from exc

    def finish_journal(self, rc: RecordedCalls, calls: Iterable[CallEntry]) -> Manifest:
        """Write ``manifest.json`` (with fsync), then close and remove the journal, then what a dead writer left.

        Every writer of the stream has stopped by now: a file of a name the writers give that the
        manifest does not list was left by a writer process that died (a temporary file, a call's
        file renamed before its journal line, a segment before its first range was listed), and is
        removed (:func:`iobundle._store.remove_leftovers`; best effort: one that cannot be
        removed stays, and replacing the bundle removes it).

        Raises:
            BundleWriteError: The manifest cannot be written (the journal is kept: the bundle still opens).
        """
        self.close_segment()
        manifest = self.manifest(rc, calls)
        self._seal_others(manifest)
        write_manifest(self.path, manifest, durable=True)
        fd, self._journal = self._journal, None
        if fd is not None:
            os.close(fd)
        try:
            with Tree(self.path, error=BundleWriteError) as tree:
                tree.unlink(JOURNAL_FILENAME, missing_ok=True)
                fsync_dir(self.path)
                removed = remove_leftovers(
                    LocalStore(self.path, error=BundleWriteError), keep={MANIFEST_FILENAME, *manifest.files}
                )
        except (OSError, BundleWriteError) as exc:
            logger.debug("what a dead writer left in %s is kept: %s", self.path, exc)
        else:
            if removed:
                logger.info("removed %d files a dead writer left in %s: %s", len(removed), self.path, removed)
        return manifest

    def _seal_others(self, manifest: Manifest) -> None:
        """Seal the segments ``manifest`` lists that a writer process left unsealed (it died), from the manifest.

        Raises:
            BundleWriteError: One cannot be sealed (the journal is kept: the bundle still opens).
        """
        calls = {c.index: c for c in manifest.calls}
        names: dict[int, dict[str, str]] = {}
        by_file: dict[str, list[tuple[int, str, TensorEntry]]] = {}
        for key, t in manifest.tensors.items():
            if t.offset is not None and t.file not in self._sealed:
                by_file.setdefault(t.file, []).append((t.offset, key, t))

        def header(
            rows: list[tuple[int, str, TensorEntry]], ranges: list[tuple[int, int, int, str]], start: int
        ) -> list[tuple[bytes, bytes]]:
            entries, j = [], 0
            for offset, key, t in sorted(rows, key=lambda r: r[0]):
                while ranges[j][1] + ranges[j][2] <= offset and j + 1 < len(ranges):
                    j += 1
                call = ranges[j][0]
                if call not in names:
                    names[call] = _stored_names(calls[call]) if call in calls else {}
                shape = list(t.shape)
                if t.extends is not None:
                    shape[t.extends.dim] -= manifest.tensors[t.extends.key].shape[t.extends.dim]
                nbytes = math.prod(shape) * DTYPE_ITEMSIZES[t.dtype]
                path = names[call].get(key, key)
                entries.append(
                    segment_header_entry(
                        f"call{call:06d}/{path}", key, t.dtype, shape, offset - start, offset - start + nbytes
                    )
                )
            return entries

        for name, rows in by_file.items():
            entry = manifest.files[name]
            ranges, start = entry.ranges or [], (entry.ranges or [(0, 0, 0, "")])[0][1]
            if not start:
                continue  # a version-4 segment: no header region
            # the header is worked out only for a segment left unsealed: a stream's close checks every one
            if seal_segment(self.path / name, entry, functools.partial(header, rows, ranges, start), durable=True):
                logger.info("sealed %s, which a writer process left unsealed", name)

    def discard(self) -> None:
        """Remove what this writer wrote (best effort), so no half-written bundle is left behind.

        Once the writer prepared its directory, every file there of a name the writers give is its
        own (what it replaced went first): those go, by exact name, then ``calls/`` if it is left
        empty, and the directory itself if this writer made it and it is left empty; other files stay.
        """
        with contextlib.suppress(IobundleError):
            self.close_segment(durable=False)
        try:
            with Tree(self.path, error=BundleWriteError) as tree:
                remove_leftovers(LocalStore(self.path, error=BundleWriteError))
                tree.rmdir((CALLS_DIR,))  # only when empty
        except (OSError, IobundleError) as exc:
            logger.debug("what the failed write left in %s is kept: %s", self.path, exc)
        if self.created:
            try:
                self.path.rmdir()
            except OSError:
                pass


def _stored_names(call: CallEntry) -> dict[str, str]:
    """Per key of ``call``, its first stored path (:func:`iobundle.calls.call_paths`), unique in the call.

    Two tensors whose paths escape alike (dict keys ``1`` and ``"1"``) are told apart by ``~KEY``.
    """
    names: dict[str, str] = {}
    taken: set[str] = set()
    for path, key in call_paths(call):
        if key not in names:
            names[key] = path if path not in taken else f"{path}~{key}"
            taken.add(names[key])
    return names


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (one write normally; a killed writer may leave a prefix)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def save_recorded_calls(
    rc: RecordedCalls,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> Manifest:
    """Write every call of ``rc`` to the bundle directory ``path`` and return the manifest.

    On failure the files written so far are removed: ``path`` holds no manifest, so it is never
    taken for a complete bundle. ``on_progress`` is called with an ``iobundle.replay.ProgressEvent``
    (task ``"write"``) before the first call and after each one.

    Raises:
        BundleExistsError: ``path`` is not empty and ``overwrite`` is False.
        BundleWriteError: Writing failed (disk full, permission denied); the message names the file.
    """
    # retain_all=False: a streamed observer's store reads tensors back from its bundle, and holding
    # every one read as a possible base would hold the whole bundle in memory
    writer = BundleWriter(path, overwrite=overwrite)
    try:
        notify(on_progress, "write", 0, len(rc.calls))
        writer.write_missing_values(rc.value_if_missing, rc.store.get)
        for done, call in enumerate(rc.calls, start=1):
            writer.write_call(call, rc.store.get)
            notify(on_progress, "write", done, len(rc.calls), f"call {call.index}")
        writer.close_segment()
        return writer.write_manifest(rc)
    except BaseException:
        try:
            writer.discard()
        except OSError:
            pass
        raise
