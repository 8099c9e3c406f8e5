"""Pack a bundle into one tar file and unpack it back: a bundle leaving the machine.

``pack_bundle`` writes ``manifest.json`` first (a streaming reader finds it at once), then every
file the manifest lists (tensor files, the stored model's files; nothing else the directory may
hold), with zeroed times and owners: the same bundle always packs to the same bytes.
``unpack_bundle`` writes the members back to a directory, ``manifest.json`` last. Reading a packed
bundle (untrusted bytes) is replay's: :func:`iobundle.replay.load_bundle` opens one in place.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from iobundle._atomic import atomic_file
from iobundle._paths import Tree
from iobundle._progress import BYTES, ProgressCallback, notify
from iobundle._remote import is_url, local_path, staged
from iobundle._store import LocalStore, TarStore, make_room, open_regular
from iobundle.calls import check_file, listed_files
from iobundle.errors import (
    ArchiveError,
    BundleExistsError,
    BundleNotFoundError,
    BundleWriteError,
    IntegrityError,
    IobundleError,
    TensorFileError,
)
from iobundle.replay import Bundle
from iobundle.schema import MANIFEST_FILENAME, dump_manifest

__all__ = ["PackResult", "pack_bundle", "unpack_bundle"]

logger = logging.getLogger(__name__)

_BLOCK = tarfile.BLOCKSIZE
_COPY = 4 * 1024**2


@dataclass
class PackResult:
    """What :func:`pack_bundle` or :func:`unpack_bundle` wrote."""

    path: Path | str
    files: int
    bytes: int
    seconds: float


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _copy(src: io.RawIOBase | io.BufferedIOBase, dst: BinaryIO, size: int, name: str) -> None:
    left = size
    buffer = memoryview(bytearray(min(_COPY, max(size, 1))))
    while left:
        n = src.readinto(buffer[: min(left, len(buffer))])
        if not n:
            raise TensorFileError(f"{name}: changed while it was being copied (cut short).")
        dst.write(buffer[:n])
        left -= n


def _remove_written(target: Path, names: list[str]) -> None:
    """Remove the members ``names`` an unpack wrote into the folder ``target`` it made, the folders left empty, then it.

    By name, never through a link (best effort): a file that someone else put there meanwhile stays.
    """
    store = LocalStore(target, error=BundleExistsError)
    for name in names:
        with contextlib.suppress(OSError, IobundleError):
            store.remove(name, missing_ok=True)
    with contextlib.suppress(OSError, IobundleError):
        store.prune(names)
    with contextlib.suppress(OSError):
        target.rmdir()


def _kernel_copy(src: int, offset: int, dst: int, size: int) -> bool:
    """Copy ``size`` bytes of file descriptor ``src`` from ``offset`` to ``dst``'s position in the kernel.

    False (nothing copied) where the system cannot; the caller then copies through Python.
    """
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    done = 0
    while done < size:
        try:
            n = copy(src, dst, size - done, offset + done)
        except OSError:
            if done:
                raise
            return False
        if n == 0:
            raise TensorFileError(f"changed while it was being copied (cut short after {done} of {size} bytes).")
        done += n
    return True


def _check_target(target: Path, *, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        raise BundleExistsError(f"'{target}' already exists. Pass overwrite=True (--overwrite) or choose another path.")


PACK_TASK = "pack"
UNPACK_TASK = "unpack"


def pack_bundle(
    bundle: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> PackResult:
    """Pack the bundle directory ``bundle`` into the single file ``output`` (an uncompressed tar).

    ``load_bundle``, and every ``iobundle`` command, read the packed file in place. ``output`` may
    be a URL (with fsspec installed): the file is written locally beside nothing, then uploaded.
    A bundle a killed stream left (``journal.jsonl``, no ``manifest.json``) packs too: the archive's
    ``manifest.json`` is the manifest its journal describes (every complete call).

    ``on_progress`` is called with a :class:`~iobundle.replay.ProgressEvent` (task ``"pack"``,
    counted in bytes) before the first member and after each one, the member's name as detail.

    Raises:
        BundleNotFoundError: ``bundle`` is not a bundle directory.
        BundleExistsError: ``output`` exists and ``overwrite`` is False.
        UnsafeBundleError: A file of the bundle leads outside it (a symlink).
        BundleWriteError: ``output`` cannot be written.

    Example:
        >>> pack_bundle("run.iobundle", "run.iobundle.tar").files
        3
    """
    import time

    begin = time.perf_counter()
    source = local_path(bundle)
    if source is None or not source.is_dir():
        raise BundleNotFoundError(f"'{bundle}' is not a bundle directory. Pass the folder written by observer.save().")
    manifest = Bundle.load(source).manifest  # a bundle, with a valid manifest whose file names stay inside it
    root = LocalStore(source)
    names = [MANIFEST_FILENAME, *sorted(listed_files(manifest))]
    # A stream killed before its end left journal.jsonl and no manifest.json: the archive holds the manifest
    # the journal describes (every complete call), so it opens as any saved bundle does.
    inline = {} if (source / MANIFEST_FILENAME).is_file() else {MANIFEST_FILENAME: dump_manifest(manifest).encode()}
    # a segment's bytes past its size (a call a killed stream was appending) are no part of the bundle
    segments = {n: e.size for n, e in listed_files(manifest).items() if e.ranges is not None}
    expected = sum(
        len(inline[n])
        if n in inline
        else min(os.lstat(source.joinpath(*PurePosixPath(n).parts)).st_size, segments.get(n, 1 << 62))
        for n in names
    )
    remote = is_url(output) and local_path(output) is None
    target: Path | None = None
    if remote:
        with staged(str(output), overwrite=overwrite, prefix="iobundle-pack-") as staging:
            total = _write_tar(root, names, inline, staging, segments, expected=expected, on_progress=on_progress)
    else:
        target = local_path(output)
        assert target is not None
        _check_target(target, overwrite=overwrite)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BundleWriteError(f"Cannot create {target.parent}: {exc.strerror or exc}.") from exc
        total = _write_tar(root, names, inline, target, segments, expected=expected, on_progress=on_progress)
    logger.info("packed %d files (%d bytes) into %s", len(names), total, output)
    return PackResult(path=target or str(output), files=len(names), bytes=total, seconds=time.perf_counter() - begin)


def _write_tar(
    root: LocalStore,
    names: list[str],
    inline: dict[str, bytes],
    target: Path,
    segments: dict[str, int],
    *,
    expected: int,
    on_progress: ProgressCallback | None,
) -> int:
    """Write the members ``names`` of ``root`` as a tar file at ``target`` atomically; return their bytes.

    A name in ``inline`` is written with those bytes instead of the file of that name; a name in
    ``segments`` with its first ``segments[name]`` bytes only (its manifest size).
    """
    total = 0
    notify(on_progress, PACK_TASK, 0, expected, unit=BYTES)
    with atomic_file(target) as out:
        for name in names:
            if name in inline:
                data = inline[name]
                out.write(_tar_header(name, len(data)) + data + b"\x00" * (-len(data) % _BLOCK))
                total += len(data)
                notify(on_progress, PACK_TASK, total, max(expected, total), name, unit=BYTES)
                continue
            f, size = root.open(name)
            size = min(size, segments.get(name, size))
            with f:
                out.write(_tar_header(name, size))
                out.flush()
                if not _kernel_copy(f.fileno(), 0, out.fileno(), size):
                    _copy(f, out, size, name)
                else:
                    out.seek(0, os.SEEK_END)
            out.write(b"\x00" * (-size % _BLOCK))
            total += size
            notify(on_progress, PACK_TASK, total, max(expected, total), name, unit=BYTES)
        if total != expected:  # the manifest is not counted in advance: end the bar at what was copied
            notify(on_progress, PACK_TASK, total, total, unit=BYTES)
        out.write(b"\x00" * (2 * _BLOCK))
    return total


def unpack_bundle(
    archive: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    verify: bool = True,
    on_progress: ProgressCallback | None = None,
) -> PackResult:
    """Write the members of the packed bundle ``archive`` to the directory ``output``, ``manifest.json`` last.

    The archive is checked first (its index, its manifest, every listed file's size, and with
    ``verify`` its hash), so nothing is written from a hostile or damaged archive. Only the files
    the manifest lists (tensor files, the stored model's files) are written: an archive holding any
    other member is refused.

    ``on_progress`` is called with a :class:`~iobundle.replay.ProgressEvent` for the check
    (task ``"verify"``, with ``verify``) and the copy (task ``"unpack"``), both counted in bytes,
    before the first file and after each one, the file's name as detail.

    Raises:
        BundleNotFoundError: ``archive`` is not a packed bundle.
        ArchiveError: The archive is invalid or hostile, or holds a member the manifest does not list.
        IntegrityError: A member differs from the manifest (its size; its hash with ``verify``).
        BundleExistsError: ``output`` is not empty and ``overwrite`` is False, or it is not a bundle
            (it is never deleted then).
        BundleWriteError: ``output`` cannot be written.
    """
    import time

    begin = time.perf_counter()
    bundle = Bundle.load(archive, verify=verify)
    root = bundle.root
    if not isinstance(root, TarStore):
        raise BundleNotFoundError(f"'{archive}' is a bundle directory, not a packed bundle; nothing to unpack.")
    listed = listed_files(bundle.manifest)
    for name in root.members:
        if name != MANIFEST_FILENAME and name not in listed:
            raise ArchiveError(
                f"'{archive}': member {name!r} is not a file the manifest lists (tensor or model file); "
                "refusing to unpack an archive that holds unchecked files. Repack it with iobundle pack.",
                member=name,
            )
    if verify:
        problems = bundle.verify(on_progress=on_progress)
        if problems:
            raise IntegrityError(f"'{archive}': {len(problems)} damaged member(s): " + "; ".join(problems[:3]))
    else:
        for name, entry in listed.items():
            check_file(root, name, entry, hash_check=False)  # present, with the size the manifest records
    target = local_path(output)
    if target is None:
        raise BundleWriteError(f"'{output}': unpack writes to a local directory. Upload the directory afterwards.")
    if target.exists() and (not target.is_dir() or target.is_symlink()):
        raise BundleExistsError(f"'{target}' exists and is not a directory. Choose another path.")
    make_room(LocalStore(target, error=BundleExistsError), overwrite=overwrite)  # only an old bundle's own files
    names = [*sorted(listed), MANIFEST_FILENAME]
    created = not target.exists()
    total = 0
    expected = sum(size for _, size in root.members.values())
    notify(on_progress, UNPACK_TASK, 0, expected, unit=BYTES)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    tree = Tree(target, error=BundleExistsError)  # every file opened from its folder's descriptor, no link followed
    try:
        tree.folder((), create=True)
        for name in names:
            offset, size = root.members[name]
            fd = tree.open(name, flags, 0o644, create_folders=True)
            with os.fdopen(fd, "wb") as out:
                copied = False
                if root.local is not None:
                    src, _ = open_regular(root.local, str(root.local), link_ok=True)
                    try:
                        copied = _kernel_copy(src, offset, fd, size)
                    finally:
                        os.close(src)
                if not copied:
                    with root.open_slice(offset, size, name) as f:
                        _copy(f, out, size, name)
            total += size
            notify(on_progress, UNPACK_TASK, total, expected, name, unit=BYTES)
    except (OSError, IobundleError) as exc:
        tree.close()
        if created:  # what was written is no bundle (manifest.json comes last): leave nothing of it behind
            _remove_written(target, names)
        if isinstance(exc, IobundleError):
            raise
        raise BundleWriteError(
            f"Cannot write into {target}: {exc.strerror or exc}. Check free space and permissions."
        ) from exc
    tree.close()
    logger.info("unpacked %d files (%d bytes) into %s", len(names), total, target)
    return PackResult(path=target, files=len(names), bytes=total, seconds=time.perf_counter() - begin)
