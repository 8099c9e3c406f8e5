"""``write_atomically``: hashing beside the writes for large files, errors end as BundleWriteError."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from iobundle import _atomic
from iobundle._atomic import CHUNK_BYTES, CONCURRENT_HASH_MIN_BYTES, atomic_file, write_atomically
from iobundle.errors import BundleWriteError

SMALL = [b"header", os.urandom(1000), b""]
LARGE = [b"header", os.urandom(CONCURRENT_HASH_MIN_BYTES // 2 + 3), b"", os.urandom(CONCURRENT_HASH_MIN_BYTES // 2)]


@pytest.mark.parametrize("parts", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("durable", [True, False])
def test_writes_and_hashes_every_byte(tmp_path: Path, parts: list[bytes], durable: bool) -> None:
    digest, done, threads = hashlib.sha256(), [], set()

    def on_part(index: int) -> None:
        done.append(index)
        threads.add(threading.current_thread().name)

    size = write_atomically(tmp_path / "f", parts, on_chunk=digest.update, on_part=on_part, durable=durable)
    data = b"".join(parts)
    assert size == len(data) and (tmp_path / "f").read_bytes() == data
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert done == list(range(len(parts)))
    assert threads == ({"iobundle-hash"} if len(data) >= CONCURRENT_HASH_MIN_BYTES else {"MainThread"})
    assert list(tmp_path.iterdir()) == [tmp_path / "f"]


def test_chunks_are_handed_over_after_they_are_written(tmp_path: Path) -> None:
    seen: list[int] = []
    write_atomically(tmp_path / "f", LARGE, on_chunk=lambda c: seen.append(len(c)))
    assert max(seen) == CHUNK_BYTES and sum(seen) == sum(len(p) for p in LARGE)


@pytest.mark.parametrize("parts", [SMALL, LARGE], ids=["small", "large"])
def test_a_failing_callback_is_a_bundle_write_error(tmp_path: Path, parts: list[bytes]) -> None:
    (tmp_path / "f").write_bytes(b"old")
    calls = {"n": 0}

    def on_chunk(chunk: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("hash exploded")

    before = threading.active_count()
    with pytest.raises(BundleWriteError, match="hash exploded"):
        write_atomically(tmp_path / "f", parts, on_chunk=on_chunk)
    assert (tmp_path / "f").read_bytes() == b"old"  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temporary file
    assert threading.active_count() == before


class _FullDisk(io.BytesIO):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def write(self, data: Any) -> int:
        self.after -= 1
        if self.after < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)

    def fileno(self) -> int:
        raise AssertionError("never fsynced")


@pytest.mark.parametrize("parts", [SMALL, LARGE], ids=["small", "large"])
def test_a_failing_write_is_a_bundle_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: list[bytes]
) -> None:
    real_open_tmp = _atomic._open_tmp
    opened: list[Path] = []

    def fake_open_tmp(path: Path) -> Any:
        real_open_tmp(path).close()  # the temporary file exists, as after a real failed write
        opened.append(Path(path))
        return _FullDisk(after=1)

    monkeypatch.setattr(_atomic, "_open_tmp", fake_open_tmp)
    hashed: list[int] = []
    before = threading.active_count()
    with pytest.raises(BundleWriteError, match="No space left on device") as info:
        write_atomically(tmp_path / "f", parts, on_chunk=lambda c: hashed.append(len(c)))
    assert isinstance(info.value.__cause__, OSError)
    assert opened and not opened[0].exists() and not (tmp_path / "f").exists()
    assert threading.active_count() == before


def test_without_durable_nothing_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync called")

    monkeypatch.setattr(os, "fsync", no_fsync)
    write_atomically(tmp_path / "f", LARGE, on_chunk=hashlib.sha256().update, durable=False)
    assert (tmp_path / "f").stat().st_size == sum(len(p) for p in LARGE)
    with pytest.raises(BundleWriteError, match="fsync called"):
        write_atomically(tmp_path / "g", SMALL, durable=True)
    assert not (tmp_path / "g").exists() and not (tmp_path / ".g.tmp").exists()


class TestAtomicFile:
    def test_the_bytes_appear_only_once_the_block_completes(self, tmp_path):
        path = tmp_path / "out.bin"
        path.write_bytes(b"old")
        with atomic_file(path) as f:
            f.write(b"new bytes")
            f.flush()
            assert path.read_bytes() == b"old"
            assert (tmp_path / ".out.bin.tmp").read_bytes() == b"new bytes"
        assert path.read_bytes() == b"new bytes"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]

    def test_an_error_leaves_the_old_file_and_no_temporary(self, tmp_path):
        path = tmp_path / "out.bin"
        path.write_bytes(b"old")
        with pytest.raises(RuntimeError, match="boom"), atomic_file(path) as f:
            f.write(b"half")
            raise RuntimeError("boom")
        assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]

    def test_an_os_error_becomes_a_bundle_write_error_naming_the_file(self, tmp_path):
        path = tmp_path / "missing-dir" / "out.bin"
        with pytest.raises(BundleWriteError, match=r"out\.bin"), atomic_file(path) as f:
            f.write(b"x")


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"mine")
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / ".f.tmp").symlink_to(outside)
    with pytest.raises(BundleWriteError, match="Cannot write"):
        write_atomically(folder / "f", [b"new bytes"])
    assert outside.read_bytes() == b"mine" and not (folder / "f").exists()
