"""One suite for every backend of the store (the way zarr-python's ``StoreTests`` runs against each of its stores).

Each test builds the same members in each place a bundle lives (a directory, a packed tar file,
fsspec over the local disk and over its in-memory filesystem, memory) and reads them back through
:class:`iobundle._store.Store`, including the hostile cases: links, names that leave the bundle,
members shorter or longer than the manifest says, a member that is a folder.
"""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

from two_calls import record  # noqa: E402

from iobundle import InputObserver  # noqa: E402
from iobundle._paths import DIR, FILE  # noqa: E402
from iobundle._store import FsspecStore, LocalStore, MemoryStore, Store, TarStore, open_archive, open_store  # noqa: E402
from iobundle.calls import BundleTensorStore, check_file, read_member  # noqa: E402
from iobundle.errors import (  # noqa: E402
    ArchiveError,
    BundleNotFoundError,
    BundleWriteError,
    IntegrityError,
    TensorFileError,
    UnsafeBundleError,
)
from iobundle.schema import FileEntry, load_manifest  # noqa: E402

BACKENDS = ["local", "tar", "fsspec-file", "fsspec-memory", "memory"]
LINKS = {"local", "fsspec-file"}  # where a link can be made and must be refused when read
WRITABLE = {"local", "fsspec-file", "fsspec-memory", "memory"}

FILES = {
    "manifest.json": b'{"format_version": 6}',
    "calls/000000.safetensors": bytes(range(256)) * 3,
    "calls/segment-000000.bin": b"\x00" * 8 + b"abcdefgh",
    "model/config.json": b"{}",
}


class Place:
    """A folder of the disk (or of fsspec's memory) into which one test's members are made, then a store of them."""

    def __init__(self, backend: str, tmp_path: Path) -> None:
        self.backend = backend
        self.root = tmp_path / "bundle"
        self.memory_root = f"/iobundle-store-{uuid.uuid4().hex}"
        self.files: dict[str, bytes] = {}
        self.folders: list[str] = []
        self.links: dict[str, str] = {}
        self.tmp = tmp_path

    def store(self) -> Store:
        if self.backend in ("local", "fsspec-file"):
            for name, data in self.files.items():
                (self.root / name).parent.mkdir(parents=True, exist_ok=True)
                (self.root / name).write_bytes(data)
            for name in self.folders:
                (self.root / name).mkdir(parents=True, exist_ok=True)
            for name, target in self.links.items():
                (self.root / name).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target, self.root / name)
            self.root.mkdir(exist_ok=True)
            if self.backend == "local":
                return LocalStore(self.root)
            return FsspecStore(str(self.root), fs=fsspec.filesystem("file"), inner=str(self.root))
        if self.backend == "fsspec-memory":
            fs = fsspec.filesystem("memory")
            fs.makedirs(self.memory_root, exist_ok=True)
            for name, data in self.files.items():
                fs.pipe_file(f"{self.memory_root}/{name}", data)
            for name in self.folders:
                fs.makedirs(f"{self.memory_root}/{name}", exist_ok=True)
            return FsspecStore(f"memory://{self.memory_root}")
        if self.backend == "memory":
            assert not self.folders and not self.links
            return MemoryStore(self.files)
        path = self.tmp / "bundle.tar"
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in self.files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for name in self.folders:
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            for name, target in self.links.items():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
        return open_archive(path)

    def cleanup(self) -> None:
        fs = fsspec.filesystem("memory")
        if fs.exists(self.memory_root):
            fs.rm(self.memory_root, recursive=True)


@pytest.fixture(params=BACKENDS)
def place(request, tmp_path):
    made = Place(request.param, tmp_path)
    made.files.update(FILES)
    yield made
    made.cleanup()


def entry(data: bytes, **kwargs) -> FileEntry:
    import xxhash

    if "ranges" in kwargs:
        return FileEntry(size=len(data), hash="xxh3-128", **kwargs)
    return FileEntry(size=len(data), hash="xxh3-128", digest=xxhash.xxh3_128_hexdigest(data))


class TestReading:
    def test_open_gives_the_bytes_and_the_size(self, place):
        store = place.store()
        for name, data in FILES.items():
            f, size = store.open(name)
            with f:
                assert (size, f.read()) == (len(data), data)

    def test_read_refuses_a_member_over_the_limit(self, place):
        store = place.store()
        assert store.read("model/config.json", 2) == b"{}"
        with pytest.raises(UnsafeBundleError, match=r"calls/000000\.safetensors: 768 bytes, over the limit of 100"):
            store.read("calls/000000.safetensors", 100)

    def test_list_says_files_and_folders(self, place):
        store = place.store()
        assert store.list() == {"manifest.json": FILE, "calls": DIR, "model": DIR}
        assert store.list("calls") == {"000000.safetensors": FILE, "segment-000000.bin": FILE}
        assert store.list("nowhere") == {}

    def test_a_range_of_a_member_is_read_or_viewed(self, place):
        store = place.store()
        name, data = "calls/000000.safetensors", FILES["calls/000000.safetensors"]
        mapped = store.map(name, len(data))
        if mapped is not None:  # a directory and a local packed file are memory-mapped
            assert bytes(mapped[10:20].numpy()) == data[10:20]
        f, _ = store.open(name)
        with f:
            f.read(10)
            assert f.read(10) == data[10:20]

    def test_check_file_compares_size_and_hash(self, place):
        store = place.store()
        data = FILES["calls/000000.safetensors"]
        check_file(store, "calls/000000.safetensors", entry(data))
        assert read_member(store, "calls/000000.safetensors", entry(data)) == data

    def test_missing_member(self, place):
        with pytest.raises(TensorFileError, match=r"calls/nope\.safetensors: missing from the"):
            place.store().open("calls/nope.safetensors")


class TestHostile:
    @pytest.mark.parametrize(
        "name",
        [
            "../outside",
            "/etc/passwd",
            "calls/../manifest.json",
            "calls\\x",
            "c:x",
            "",
            "a\x00b",
            "calls//x",
            "./manifest.json",
        ],
    )
    def test_a_name_that_leaves_the_bundle_is_refused(self, place, name):
        store = place.store()
        with pytest.raises(UnsafeBundleError, match=r"not a plain relative path"):
            store.open(name)
        with pytest.raises(UnsafeBundleError):
            store.check_all([name])
        if place.backend in WRITABLE:
            with pytest.raises(UnsafeBundleError):
                store.write(name, b"x")

    @pytest.mark.parametrize(
        ("link", "member"),
        [("calls/000001.safetensors", "calls/000001.safetensors"), ("data", "data/000000.safetensors")],
    )
    def test_a_link_is_refused_wherever_it_points(self, place, link, member):
        if place.backend not in LINKS | {"tar"}:
            pytest.skip(f"{place.backend} holds no links")
        outside = place.tmp / "outside"
        outside.mkdir()
        (outside / "000000.safetensors").write_bytes(b"secret")
        place.links[link] = str(outside / "000000.safetensors") if link.endswith(".safetensors") else str(outside)
        if place.backend == "tar":
            with pytest.raises(ArchiveError, match="a symbolic link"):
                place.store()
            return
        store = place.store()
        with pytest.raises(UnsafeBundleError, match="symbolic link"):
            store.open(member)
        if link != member or place.backend == "local":  # a remote store leaves the member's own link to open()
            with pytest.raises(UnsafeBundleError, match="symbolic link"):
                store.check_all([member])

    def test_a_member_that_is_a_folder_is_not_read(self, place):
        if place.backend == "memory":
            place.files["calls/x.bin/inner"] = b"1"
        else:
            place.folders.append("calls/x.bin")
        with pytest.raises(TensorFileError, match=r"calls/x\.bin: (not a regular file|missing)"):
            place.store().open("calls/x.bin")

    def test_a_short_member_is_refused(self, place):
        data = FILES["calls/000000.safetensors"]
        place.files["calls/000000.safetensors"] = data[:100]
        store = place.store()
        with pytest.raises(IntegrityError, match=r"100 bytes, the manifest says 768\. The file is truncated"):
            check_file(store, "calls/000000.safetensors", entry(data))
        with pytest.raises(IntegrityError, match="100 bytes, the manifest says 768"):
            read_member(store, "calls/000000.safetensors", entry(data))

    def test_an_oversized_member_is_refused_but_a_segment_may_be_longer(self, place):
        data = FILES["calls/000000.safetensors"]
        place.files["calls/000000.safetensors"] = data + b"more"
        segment = FILES["calls/segment-000000.bin"]
        place.files["calls/segment-000000.bin"] = segment + b"killed writer"
        store = place.store()
        with pytest.raises(IntegrityError, match="772 bytes, the manifest says 768"):
            check_file(store, "calls/000000.safetensors", entry(data))
        ranges = [(0, 8, 8, entry(segment[8:]).digest)]  # call 0: bytes 8-16
        check_file(store, "calls/segment-000000.bin", entry(segment, ranges=ranges))

    def test_a_changed_member_fails_its_hash(self, place):
        data = FILES["calls/000000.safetensors"]
        place.files["calls/000000.safetensors"] = data[:-1] + b"\x00"
        with pytest.raises(IntegrityError, match="differs from the manifest"):
            check_file(place.store(), "calls/000000.safetensors", entry(data))


class TestWriting:
    def test_write_append_remove(self, place):
        store = place.store()
        if place.backend not in WRITABLE:
            with pytest.raises(BundleWriteError, match="read-only"):
                store.write("calls/new.bin", b"x")
            with pytest.raises(BundleWriteError, match="read-only"):
                store.remove("manifest.json")
            return
        store.write("calls/new.bin", b"first")
        store.write("calls/new.bin", b"second")  # replaced whole
        store.append("calls/new.bin", b"+more")
        store.append("journal.jsonl", b"line\n")
        assert store.read("calls/new.bin", 100) == b"second+more"
        assert store.read("journal.jsonl", 100) == b"line\n"
        assert store.list("calls")["new.bin"] == FILE
        store.remove("calls/new.bin")
        store.remove("calls/new.bin", missing_ok=True)
        with pytest.raises(FileNotFoundError):
            store.remove("calls/new.bin")
        assert "new.bin" not in store.list("calls")
        assert not [n for n in store.list("calls") if n.endswith(".tmp")]  # no temporary file is left

    def test_remove_refuses_a_link_and_a_folder(self, place):
        if place.backend not in LINKS:
            pytest.skip(f"{place.backend} holds no links")
        outside = place.tmp / "outside.bin"
        outside.write_bytes(b"keep me")
        place.links["calls/link.bin"] = str(outside)
        place.folders.append("calls/folder.bin")
        store = place.store()
        with pytest.raises(UnsafeBundleError):
            store.remove("calls/link.bin")
        with pytest.raises(UnsafeBundleError, match="not a regular file"):
            store.remove("calls/folder.bin")
        assert outside.read_bytes() == b"keep me"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real bundle of two calls, saved by the observer."""
    path = tmp_path_factory.mktemp("saved") / "run.iobundle"
    record(InputObserver()).save(path)
    return path


def test_a_saved_bundle_reads_the_same_through_every_backend(saved, place):
    place.files.clear()
    place.files.update({p.relative_to(saved).as_posix(): p.read_bytes() for p in saved.rglob("*") if p.is_file()})
    manifest = load_manifest(saved)
    reference = BundleTensorStore(saved, manifest)
    store = BundleTensorStore(saved, manifest, bundle_root=place.store())
    assert manifest.tensors
    for key in manifest.tensors:
        assert torch.equal(store.get(key), reference.get(key))


@pytest.mark.parametrize("backend", ["local", "tar", "fsspec-memory"])
def test_open_store_picks_the_backend_of_the_place(tmp_path, backend):
    place = Place(backend, tmp_path)
    place.files.update(FILES)
    try:
        made = place.store()
        location = f"memory://{place.memory_root}" if backend == "fsspec-memory" else made.path
        found = open_store(location)
        assert type(found) is {"local": LocalStore, "tar": TarStore, "fsspec-memory": FsspecStore}[backend]
        assert found.read_manifest() == FILES["manifest.json"]
    finally:
        place.cleanup()
    with pytest.raises(BundleNotFoundError, match="does not exist"):
        open_store(f"memory://{place.memory_root}-nothing")


def test_a_listed_file_that_is_a_link_in_the_root_is_refused_when_the_bundle_is_opened(tmp_path):
    """Checking the manifest's names refuses a link in the root too (its open would refuse it later anyway)."""
    (tmp_path / "outside.bin").write_bytes(b"secret")
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "evil.safetensors").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(UnsafeBundleError, match=r"evil\.safetensors' is a symbolic link"):
        LocalStore(root).check_all(["evil.safetensors"])
