"""Packed bundles: pack/unpack round trips, reading in place (memory-mapped, nothing extracted), hostile archives.

A packed bundle is attached to bug reports like a directory is, so every hostile entry must fail
with an IobundleError naming the archive member, before anything is read or written.
"""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import iobundle._store._tar as archive_module
from iobundle import InputObserver, load_bundle
from iobundle.errors import (
    ArchiveError,
    BundleExistsError,
    BundleNotFoundError,
    BundleWriteError,
    IntegrityError,
    IobundleError,
    TensorFileError,
)
from iobundle.schema import FORMAT_VERSION
from iobundle.travel import pack_bundle, unpack_bundle

BIG = (600, 600)  # 1.4 MB: over READ_WHOLE_BYTES, so its file is memory-mapped, not read whole


pytestmark = pytest.mark.usefixtures("own_files")  # these tests name the calls' safetensors files


class Model(torch.nn.Module):
    def forward(self, x, d=None):
        return x * 2


def make_bundle(path: Path, *, big: bool = False) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(*BIG) if big else torch.randn(4, 3), d={"w": torch.ones(2)})
    observer.save(path)
    return path


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return make_bundle(tmp_path / "run.iobundle")


@pytest.fixture
def packed(tmp_path: Path, bundle: Path) -> Path:
    return pack_bundle(bundle, tmp_path / "run.iobundle.tar").path  # type: ignore[return-value]


def exercise(path: Path | str, *, verify: bool = True) -> None:
    b = load_bundle(path, verify=verify)
    b.infer_dynamic_shapes()
    for i in range(b.num_obs()):
        b.infer_arguments(i)
    for key in b.manifest.tensors:
        b.tensor(key)


def members(bundle: Path) -> list[tuple[str, bytes]]:
    names = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    names.sort(key=lambda n: n != "manifest.json")
    return [(n, (bundle / n).read_bytes()) for n in names]


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def write_tar(path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def entries_of(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [regular(n, d) for n, d in members(bundle)]


# --------------------------------------------------------------------------- round trips


class TestPackUnpack:
    def test_packed_bundle_loads_like_the_directory(self, bundle, packed):
        a, b = load_bundle(bundle), load_bundle(packed)
        assert b.manifest == a.manifest
        assert b.infer_dynamic_shapes() == a.infer_dynamic_shapes()
        for key in a.manifest.tensors:
            assert torch.equal(a.tensor(key), b.tensor(key))
        assert b.verify() == []

    def test_pack_writes_a_plain_tar_with_the_manifest_first(self, bundle, packed):
        with tarfile.open(packed) as tar:
            names = tar.getnames()
            assert all(m.isreg() for m in tar.getmembers())
        assert names[0] == "manifest.json"
        assert sorted(names) == sorted(n for n, _ in members(bundle))

    def test_journal_only_bundle_packs_with_the_manifest_its_journal_describes(self, tmp_path):
        # a stream killed before its end leaves journal.jsonl and no manifest.json (the golden "journal" bundle)
        killed = tmp_path / "killed.iobundle"
        shutil.copytree(Path(__file__).parents[1] / "data" / "bundles" / "journal", killed)
        assert not (killed / "manifest.json").exists()
        packed = pack_bundle(killed, tmp_path / "killed.iobundle.tar").path
        with tarfile.open(packed) as tar:
            assert tar.getnames()[0] == "manifest.json"
            assert "journal.jsonl" not in tar.getnames()
        directory, archive = load_bundle(killed), load_bundle(packed)
        # the manifest is written as the newest format; what it says is the journal's
        assert archive.manifest.format_version == FORMAT_VERSION
        assert archive.manifest == directory.manifest.model_copy(update={"format_version": FORMAT_VERSION})
        for key in directory.manifest.tensors:
            assert torch.equal(archive.tensor(key), directory.tensor(key))

    def test_pack_is_deterministic(self, tmp_path, bundle, packed):
        again = pack_bundle(bundle, tmp_path / "again.tar").path
        assert Path(again).read_bytes() == packed.read_bytes()

    def test_unpack_restores_every_file(self, tmp_path, bundle, packed):
        result = unpack_bundle(packed, tmp_path / "out")
        assert members(tmp_path / "out") == members(bundle)
        assert result.files == len(members(bundle))
        assert result.bytes == sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) > 0
        assert load_bundle(tmp_path / "out").verify() == []

    def test_a_failed_unpack_removes_what_it_wrote_and_nothing_else(self, tmp_path, packed, monkeypatch):
        """The folder it made goes with the members it wrote; a file someone put there meanwhile stays."""
        from iobundle.travel import _pack

        target, real, copies = tmp_path / "out", _pack._kernel_copy, []

        def full_at_the_second_member(src: int, offset: int, dst: int, size: int) -> bool:
            copies.append(size)
            if len(copies) == 2:
                (target / "notes.txt").write_text("not the unpack's")
                raise OSError(28, "No space left on device")
            return real(src, offset, dst, size)

        monkeypatch.setattr(_pack, "_kernel_copy", full_at_the_second_member)
        with pytest.raises(BundleWriteError, match="No space left"):
            unpack_bundle(packed, target)
        assert {p.relative_to(target).as_posix() for p in target.rglob("*")} == {"notes.txt"}

    def test_pack_reports_bytes_per_member_up_to_the_total(self, tmp_path, bundle):
        events = []
        result = pack_bundle(bundle, tmp_path / "b.tar", on_progress=events.append)
        assert {(e.task, e.unit, e.total) for e in events} == {("pack", "bytes", result.bytes)}
        done = [e.done for e in events]
        assert done[0] == 0 and done[-1] == result.bytes == sum(len(d) for _, d in members(bundle))
        assert done == sorted(done) and len(done) == result.files + 1
        assert [e.detail for e in events[1:]] == [n for n, _ in members(bundle)]

    def test_unpack_reports_the_check_then_the_copy_in_bytes(self, tmp_path, bundle, packed):
        events = []
        result = unpack_bundle(packed, tmp_path / "out", on_progress=events.append)
        tasks = list(dict.fromkeys(e.task for e in events))
        assert tasks == ["verify", "unpack"] and all(e.unit == "bytes" for e in events)
        copy = [e for e in events if e.task == "unpack"]
        assert [e.done for e in copy] == sorted(e.done for e in copy) and copy[0].done == 0
        assert copy[-1].done == copy[-1].total == result.bytes == sum(len(d) for _, d in members(bundle))
        assert len(copy) == result.files + 1 and copy[-1].detail == "manifest.json"
        check = [e for e in events if e.task == "verify"]
        assert check[0].done == 0 and check[-1].done == check[-1].total == sum(
            f.size for f in load_bundle(bundle).manifest.files.values()
        )

    def test_unpack_without_verify_reports_the_copy_only(self, tmp_path, packed):
        events = []
        unpack_bundle(packed, tmp_path / "out", verify=False, on_progress=events.append)
        assert {e.task for e in events} == {"unpack"}

    def test_pack_refuses_an_existing_file(self, tmp_path, bundle, packed):
        with pytest.raises(BundleExistsError, match="overwrite"):
            pack_bundle(bundle, packed)
        pack_bundle(bundle, packed, overwrite=True)

    def test_overwrite_keeps_files_beside_the_bundle(self, tmp_path, bundle, packed):
        out = tmp_path / "out"
        unpack_bundle(packed, out)
        (out / "notes.txt").write_text("keep me")
        (out / "calls" / "README").write_text("keep me too")
        unpack_bundle(packed, out, overwrite=True)
        assert (out / "notes.txt").read_text() == "keep me" and (out / "calls" / "README").read_text() == "keep me too"
        assert load_bundle(out).verify() == []
        model, record = Model(), InputObserver()  # a local save(overwrite=True) follows the same rule
        with record(model):
            model(torch.randn(2, 3))  # one call: the old bundle's second tensor file must go
        record.save(out, overwrite=True)
        assert (out / "notes.txt").read_text() == "keep me" and (out / "calls" / "README").read_text() == "keep me too"
        left = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        assert left == {"manifest.json", "notes.txt", "calls/README", *load_bundle(out).manifest.files}

    def test_unpack_refuses_a_non_empty_directory_and_never_deletes_a_non_bundle(self, tmp_path, packed):
        out = tmp_path / "out"
        out.mkdir()
        (out / "precious.txt").write_text("keep me")
        with pytest.raises(BundleExistsError, match="not empty"):
            unpack_bundle(packed, out)
        with pytest.raises(BundleExistsError, match="not a bundle"):
            unpack_bundle(packed, out, overwrite=True)
        assert (out / "precious.txt").read_text() == "keep me"

    def test_pack_refuses_what_is_not_a_bundle_directory(self, tmp_path, packed):
        with pytest.raises(BundleNotFoundError, match="not a bundle directory"):
            pack_bundle(packed, tmp_path / "x.tar")

    def test_archive_made_by_tar_of_the_directory_loads(self, tmp_path, bundle):
        path = tmp_path / "by-tar.tar"
        with tarfile.open(path, "w") as tar:
            tar.add(bundle, arcname=".")  # what `tar cf by-tar.tar -C run.iobundle .` writes
        exercise(path)


@pytest.mark.usefixtures("tensor_file_paths")  # small members read whole, and every member mapped
class TestReadInPlace:
    def test_tensors_view_one_mapping_of_the_archive(self, tmp_path):
        bundle = make_bundle(tmp_path / "big.iobundle", big=True)
        packed = Path(pack_bundle(bundle, tmp_path / "big.tar").path)
        b = load_bundle(packed)
        key = next(k for k, e in b.manifest.tensors.items() if e.shape == list(BIG))
        t = b.tensor(key)
        # The tensor's storage is the whole archive, mapped: nothing was copied or extracted.
        assert t.untyped_storage().nbytes() == packed.stat().st_size
        maps = Path("/proc/self/maps")
        if maps.exists():
            assert str(packed.resolve()) in maps.read_text()
        assert t.data_ptr() % 8 == 0
        assert torch.equal(t, load_bundle(bundle).tensor(key))

    def test_tampered_member_fails_its_hash(self, tmp_path):
        bundle = make_bundle(tmp_path / "big.iobundle", big=True)
        packed = Path(pack_bundle(bundle, tmp_path / "big.tar").path)
        data = bytearray(packed.read_bytes())
        data[-4096] ^= 0xFF  # inside the last tensor member
        packed.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match=r"calls/000001\.safetensors: xxh3-128"):
            exercise(packed)

    def test_member_missing_from_the_archive_is_named(self, tmp_path, bundle):
        entries = [e for e in entries_of(bundle) if e[0].name != "calls/000001.safetensors"]
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(TensorFileError, match=r"calls/000001\.safetensors: missing from the packed bundle"):
            exercise(path)


# --------------------------------------------------------------------------- hostile archives


@pytest.mark.usefixtures("tensor_file_paths")
class TestHostileArchive:
    @pytest.mark.parametrize(
        ("kind", "what"),
        [
            (tarfile.SYMTYPE, "a symbolic link"),
            (tarfile.LNKTYPE, "a hard link"),
            (tarfile.CHRTYPE, "a character device"),
            (tarfile.BLKTYPE, "a block device"),
            (tarfile.FIFOTYPE, "a FIFO"),
        ],
    )
    def test_links_and_devices_are_refused(self, tmp_path, bundle, kind, what):
        entries = entries_of(bundle)
        entries[1] = special(entries[1][0].name, kind, linkname="/etc/passwd")
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(ArchiveError, match=rf"member 'calls/000000\.safetensors' is {what}") as info:
            load_bundle(path)
        assert info.value.member == "calls/000000.safetensors"

    @pytest.mark.parametrize("name", ["/etc/evil", "../evil", "calls/../../evil", "a\\b", "c:evil", "bad\x01name"])
    def test_names_leaving_the_root_are_refused(self, tmp_path, bundle, name):
        path = write_tar(tmp_path / "x.tar", [*entries_of(bundle), regular(name, b"x")])
        with pytest.raises(ArchiveError, match="not a plain relative path") as info:
            load_bundle(path)
        assert info.value.member == name

    def test_non_canonical_name_is_refused(self, tmp_path, bundle):
        path = write_tar(tmp_path / "x.tar", [*entries_of(bundle), regular("calls//x", b"x")])
        with pytest.raises(ArchiveError, match=r"member 'calls//x': .* not a plain relative path"):
            load_bundle(path)

    def test_duplicate_member_is_refused(self, tmp_path, bundle):
        entries = entries_of(bundle)
        path = write_tar(tmp_path / "x.tar", [*entries, regular(entries[1][0].name, b"other bytes")])
        with pytest.raises(ArchiveError, match=r"member 'calls/000000\.safetensors' appears twice"):
            load_bundle(path)

    def test_file_used_as_a_directory_is_refused(self, tmp_path, bundle):
        path = write_tar(tmp_path / "x.tar", [*entries_of(bundle), regular("calls/000000.safetensors/x", b"x")])
        with pytest.raises(ArchiveError, match=r"lies under 'calls/000000\.safetensors', which is a file"):
            load_bundle(path)

    def test_member_past_the_end_is_refused(self, tmp_path, bundle):
        path = write_tar(tmp_path / "x.tar", entries_of(bundle))
        with tarfile.open(path) as tar:
            last = tar.getmembers()[-1]
        with open(path, "r+b") as f:
            f.truncate(last.offset_data + last.size // 2)
        with pytest.raises(ArchiveError, match=rf"member '{last.name}': .* run past the end of the archive"):
            load_bundle(path)

    def test_absurd_member_size_is_refused(self, tmp_path, bundle):
        info = tarfile.TarInfo("calls/huge.safetensors")
        info.size = 2**50  # a pax size header: no data follows
        path = write_tar(tmp_path / "x.tar", [*entries_of(bundle), (info, None)])  # no data follows the header
        with pytest.raises(ArchiveError, match=r"member 'calls/huge\.safetensors': 1125899906842624 bytes"):
            load_bundle(path)

    def test_too_many_members_are_refused(self, tmp_path, bundle, monkeypatch):
        monkeypatch.setattr(archive_module, "MAX_ARCHIVE_MEMBERS", 2)
        path = write_tar(tmp_path / "x.tar", entries_of(bundle))
        with pytest.raises(ArchiveError, match="more than 2 entries"):
            load_bundle(path)

    def test_garbage_after_the_last_member_is_refused(self, tmp_path, packed):
        data = packed.read_bytes()
        packed.write_bytes(data[:-1024] + b"\x07" * 1024)  # the end-of-archive blocks become junk
        with pytest.raises(ArchiveError, match="neither a tar header nor the end of the archive"):
            load_bundle(packed)

    def test_compressed_archive_is_refused_with_the_fix(self, tmp_path, packed):
        path = tmp_path / "x.tar.gz"
        path.write_bytes(gzip.compress(packed.read_bytes()))
        with pytest.raises(ArchiveError, match="compressed archive"):
            load_bundle(path)

    def test_file_that_is_not_an_archive_is_refused(self, tmp_path):
        path = tmp_path / "notes.txt"
        path.write_bytes(b"hello " * 200)
        with pytest.raises(ArchiveError, match="not a tar archive"):
            load_bundle(path)

    def test_archive_without_manifest_is_not_a_bundle(self, tmp_path, bundle):
        entries = [e for e in entries_of(bundle) if e[0].name != "manifest.json"]
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(BundleNotFoundError, match=r"without manifest\.json"):
            load_bundle(path)

    def test_unpack_writes_nothing_from_a_hostile_archive(self, tmp_path, bundle):
        entries = entries_of(bundle)
        entries.append(special("calls/evil", tarfile.SYMTYPE, linkname="/etc/passwd"))
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(ArchiveError, match="symbolic link"):
            unpack_bundle(path, tmp_path / "out")
        assert not (tmp_path / "out").exists()

    @pytest.mark.parametrize("verify", [True, False])
    def test_unpack_refuses_a_member_the_manifest_does_not_list(self, tmp_path, bundle, verify):
        entries = [*entries_of(bundle), regular("calls/extra.sh", b"#!/bin/sh\nrm -rf ~\n")]
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(ArchiveError, match=r"'calls/extra\.sh' is not a file the manifest lists") as info:
            unpack_bundle(path, tmp_path / "out", verify=verify)
        assert info.value.member == "calls/extra.sh"
        assert not (tmp_path / "out").exists()

    def test_unpack_without_verify_still_checks_sizes(self, tmp_path, bundle):
        entries = entries_of(bundle)
        name, data = entries[1][0].name, entries[1][1]
        entries[1] = regular(name, data + b"\x00" * 8)  # type: ignore[operator]
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(IntegrityError, match="bytes, the manifest says"):
            unpack_bundle(path, tmp_path / "out", verify=False)
        assert not (tmp_path / "out").exists()

    def test_pack_leaves_out_files_the_manifest_does_not_list(self, tmp_path, bundle):
        (bundle / "notes.txt").write_text("not part of the bundle")
        (bundle / "calls" / ".call_000009.safetensors.tmp").write_bytes(b"half written")
        result = pack_bundle(bundle, tmp_path / "x.tar")
        with tarfile.open(result.path) as tar:
            names = tar.getnames()
        assert "notes.txt" not in names and not any(n.endswith(".tmp") for n in names)
        assert unpack_bundle(result.path, tmp_path / "out").files == len(names)

    def test_unpack_writes_nothing_from_a_damaged_archive(self, tmp_path, bundle):
        entries = entries_of(bundle)
        name, data = entries[1][0].name, bytearray(entries[1][1])  # type: ignore[arg-type]
        data[-1] ^= 0xFF
        entries[1] = regular(name, bytes(data))
        path = write_tar(tmp_path / "x.tar", entries)
        with pytest.raises(IntegrityError, match="damaged member"):
            unpack_bundle(path, tmp_path / "out")
        assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- mutation fuzz


_FUZZ_BASE: dict[str, bytes] = {}


def _fuzz_base() -> bytes:
    if "tar" not in _FUZZ_BASE:
        with tempfile.TemporaryDirectory() as tmp:
            bundle = make_bundle(Path(tmp) / "b")
            _FUZZ_BASE["tar"] = Path(pack_bundle(bundle, Path(tmp) / "b.tar").path).read_bytes()
    return _FUZZ_BASE["tar"]


def _header_offsets() -> list[int]:
    with tarfile.open(fileobj=io.BytesIO(_fuzz_base())) as tar:
        return [m.offset for m in tar.getmembers()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), max_size=6),
    header_flips=st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=511), st.integers(1, 255)), max_size=4
    ),
    cut=st.one_of(st.none(), st.integers(min_value=0)),
    verify=st.booleans(),
)
def test_mutated_archive_loads_or_fails_with_an_iobundle_error(flips, header_flips, cut, verify):
    """Random bytes anywhere, and bytes of the tar headers (names, sizes, types, checksums), flipped."""
    data = bytearray(_fuzz_base())
    offsets = _header_offsets()
    for member, position, xor in header_flips:
        data[(offsets[member % len(offsets)] + position) % len(data)] ^= xor
    for position, xor in flips:
        data[position % len(data)] ^= xor
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.tar"
        path.write_bytes(bytes(data))
        try:
            exercise(path, verify=verify)
        except IobundleError:
            pass


def test_unmutated_fuzz_base_loads():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.tar"
        path.write_bytes(_fuzz_base())
        exercise(path)


def test_model_stored_in_a_packed_bundle_is_rebuilt(tmp_path):
    transformers = pytest.importorskip("transformers")
    from iobundle.replay import load_bundle_model

    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32
    )
    config.vocab_size = 50
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=2):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    observer.save(tmp_path / "llama", include_model=True)
    packed = Path(pack_bundle(tmp_path / "llama", tmp_path / "llama.tar").path)
    rebuilt = load_bundle_model(load_bundle(packed))
    assert torch.equal(rebuilt.lm_head.weight, model.lm_head.weight)
    unpacked = unpack_bundle(packed, tmp_path / "out")
    assert unpacked.files == 1 + len(load_bundle(packed).manifest.files) + 2  # manifest, tensors, config, weights


def test_verify_checks_the_stored_model_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32
    )
    config.vocab_size = 50
    model = transformers.LlamaForCausalLM(config).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=1):
        model(torch.tensor([[3, 4, 5]]))
    manifest = observer.save(tmp_path / "llama", include_model=True)
    assert manifest.model is not None and load_bundle(tmp_path / "llama").verify() == []
    weights = tmp_path / "llama" / manifest.model.weights_file
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    problems = load_bundle(tmp_path / "llama").verify()
    assert len(problems) == 1 and manifest.model.weights_file in problems[0]
    packed = pack_bundle(tmp_path / "llama", tmp_path / "llama.tar").path
    with pytest.raises(IntegrityError, match="damaged"):
        unpack_bundle(packed, tmp_path / "out")
