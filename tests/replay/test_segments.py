"""Segments (format version 4 on): many calls' small tensors in one file, one hashed range per call.

A decoder loop in miniature (a growing cache, a token per step) plus one call with a tensor too large
for a segment. The hostile edits change the version-4 manifest as the writer wrote it; every failure
is an ``IobundleError`` naming the file, the call or the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from iobundle import InputObserver, load_bundle  # noqa: E402
from iobundle.errors import IntegrityError, ManifestError, TensorFileError, UnsafeBundleError  # noqa: E402
from iobundle.replay import diff_bundles  # noqa: E402
from iobundle.travel import convert_to_npz, pack_bundle, unpack_bundle  # noqa: E402

SEGMENT = "calls/segment-000000.bin"
BIG = 20_000  # float32: 80 000 bytes, over SEGMENT_TENSOR_BYTES


class Step(torch.nn.Module):
    def forward(self, token, past):
        return token * 2, torch.cat([past, token.reshape(1, 1, -1).float()], dim=1)


def record(path: Path, *, big: bool = True) -> tuple[Path, list[Any]]:
    """Save 4 decode steps (and, with ``big``, a fifth call whose token is too large for a segment)."""
    torch.manual_seed(0)
    model, observer, outputs = Step(), InputObserver(), []
    past = torch.zeros(1, 0, 3)
    with observer(model, store_n_calls=10):
        for _ in range(4):
            out, past = model(torch.randint(0, 9, (3,)), past)
            outputs.append((out, past))
        if big:
            outputs.append(model(torch.randn(BIG), torch.zeros(1, 0, BIG)))
    observer.save(path)
    return path, outputs


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return record(tmp_path / "run", big=False)[0]


def raw(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text("utf-8"))


def edit(path: Path, change: Any) -> None:
    manifest = raw(path)
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def test_decode_steps_share_one_segment_and_a_large_tensor_keeps_its_own_file(tmp_path: Path) -> None:
    path, outputs = record(tmp_path / "run")
    assert sorted(p.name for p in (path / "calls").iterdir()) == ["000004.safetensors", "segment-000000.bin"]
    b = load_bundle(path)
    segment = b.manifest.files[SEGMENT]
    assert [r[0] for r in segment.ranges] == [0, 1, 2, 3, 4]  # call 4's small tensors are a range too
    start = segment.ranges[0][1]  # past the header region (format version 6)
    assert segment.size == (path / SEGMENT).stat().st_size == start + sum(r[2] for r in segment.ranges)
    big = [k for k, e in b.manifest.tensors.items() if e.file == "calls/000004.safetensors"]
    assert [b.manifest.tensors[k].shape for k in big] == [[BIG], [BIG], [1, 1, BIG]]  # token, double, cache
    assert b.verify() == []
    for i, (out, past) in enumerate(outputs):
        got_out, got_past = b.outputs(i)
        assert torch.equal(got_out, out) and torch.equal(got_past, past)


def test_the_manifest_lists_a_segment_as_ranges_and_its_tensors_in_byte_order(bundle: Path) -> None:
    record_ = raw(bundle)["files"][SEGMENT]
    assert set(record_) == {"size", "ranges", "tensors"} and raw(bundle)["format_version"] == 6
    start = 4096  # the data starts past the header region
    assert [r[:3] for r in record_["ranges"]][:2] == [
        [0, start, record_["ranges"][0][2]],
        [1, start + record_["ranges"][0][2], record_["ranges"][1][2]],
    ]
    offsets = [e.offset for e in load_bundle(bundle).manifest.tensors.values()]
    assert offsets == sorted(offsets) and offsets[0] == start


class TestHostileRanges:
    def test_overlapping_ranges(self, bundle: Path) -> None:
        edit(bundle, lambda m: m["files"][SEGMENT]["ranges"][1].__setitem__(1, 4))
        with pytest.raises(
            UnsafeBundleError,
            match=r"files\['calls/segment-000000.bin'\]\.ranges\[1\]: call 1's range starts at byte 4",
        ):
            load_bundle(bundle)

    def test_ranges_that_do_not_end_at_the_size(self, bundle: Path) -> None:
        edit(bundle, lambda m: m["files"][SEGMENT].__setitem__("size", m["files"][SEGMENT]["size"] + 8))
        with pytest.raises(UnsafeBundleError, match=r"\.ranges: end at byte \d+, but size is \d+"):
            load_bundle(bundle)

    def test_a_tensor_across_two_ranges(self, bundle: Path) -> None:
        def shift(m: dict[str, Any]) -> None:
            first, second = m["files"][SEGMENT]["ranges"][:2]
            first[2] -= 4
            second[1] -= 4
            second[2] += 4

        edit(bundle, shift)
        with pytest.raises(
            UnsafeBundleError, match=r"tensors\['t\d+'\]: its \d+ bytes at offset \d+ do not lie inside one range"
        ):
            load_bundle(bundle)

    def test_a_shape_larger_than_the_bytes(self, bundle: Path) -> None:
        def grow(m: dict[str, Any]) -> None:
            rows = m["files"][SEGMENT]["tensors"]
            rows[next(iter(rows))][1] = [300]

        edit(bundle, grow)
        with pytest.raises(UnsafeBundleError, match=r"do not lie inside one range"):
            load_bundle(bundle)

    def test_tensors_that_leave_bytes_unaccounted(self, bundle: Path) -> None:
        def pad(m: dict[str, Any]) -> None:  # 8 more bytes in the last range, no tensor in them
            m["files"][SEGMENT]["ranges"][-1][2] += 8
            m["files"][SEGMENT]["size"] += 8

        edit(bundle, pad)
        with pytest.raises(
            UnsafeBundleError, match=r"\.tensors: the tensors fill \d+ bytes of the \d+ its ranges hold"
        ):
            load_bundle(bundle)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (lambda r: r.__setitem__("digest", "0" * 32), r"a segment gives a digest per range, not a digest"),
            (lambda r: r["ranges"][0].__setitem__(3, "xyz"), r"ranges\[0\]: expected 32 lowercase hex digits"),
            (lambda r: r["ranges"][0].pop(), r"ranges\[0\]: expected \[call, start, length, digest\]"),
            (lambda r: r.__setitem__("ranges", {}), r"\.ranges: expected a list of \[call, start, length, digest\]"),
        ],
    )
    def test_a_malformed_range(self, bundle: Path, change: Any, message: str) -> None:
        edit(bundle, lambda m: change(m["files"][SEGMENT]))
        with pytest.raises(ManifestError, match=message):
            load_bundle(bundle)

    def test_segments_are_refused_before_version_4(self, bundle: Path) -> None:
        edit(bundle, lambda m: m.update(format_version=3))
        with pytest.raises(
            ManifestError, match=r"\.ranges: segments are a format_version 4 field; this manifest says 3"
        ):
            load_bundle(bundle)


class TestDamagedSegment:
    def test_a_flipped_byte_names_the_range_and_its_call(self, bundle: Path) -> None:
        start, length = load_bundle(bundle).manifest.files[SEGMENT].ranges[2][1:3]
        data = bytearray((bundle / SEGMENT).read_bytes())
        data[start + length - 1] ^= 0xFF
        (bundle / SEGMENT).write_bytes(bytes(data))
        b = load_bundle(bundle)
        pattern = rf"{SEGMENT}: ranges\[2\] \(call 2, bytes {start}-{start + length}\): xxh3-128 [0-9a-f]+ differs"
        with pytest.raises(IntegrityError, match=pattern):
            b.infer_arguments(0)
        (problem,) = b.verify()
        assert "ranges[2] (call 2" in problem
        assert load_bundle(bundle, verify=False).infer_arguments(0)  # the hash unchecked, the sizes still are

    def test_a_truncated_segment(self, bundle: Path) -> None:
        data = (bundle / SEGMENT).read_bytes()
        (bundle / SEGMENT).write_bytes(data[:-4])
        with pytest.raises(
            IntegrityError, match=rf"{SEGMENT}: {len(data) - 4} bytes, the manifest says at least {len(data)}"
        ):
            load_bundle(bundle).infer_arguments(0)
        assert "at least" in load_bundle(bundle).verify()[0]

    def test_bytes_past_the_last_range_are_never_read(self, bundle: Path) -> None:
        expected = load_bundle(bundle).infer_arguments(3)
        with (bundle / SEGMENT).open("ab") as f:
            f.write(b"\xff" * 100)  # what a killed writer leaves: a call's range half appended
        b = load_bundle(bundle)
        assert b.verify() == []
        assert all(torch.equal(x, y) for x, y in zip(b.infer_arguments(3), expected))

    def test_a_segment_that_is_a_link_is_refused(self, bundle: Path, tmp_path: Path) -> None:
        outside = tmp_path / "outside.bin"
        outside.write_bytes((bundle / SEGMENT).read_bytes())
        (bundle / SEGMENT).unlink()
        (bundle / SEGMENT).symlink_to(outside)
        with pytest.raises(UnsafeBundleError, match="symbolic link"):
            load_bundle(bundle)

    @pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
    def test_a_segment_that_is_not_a_regular_file(self, bundle: Path) -> None:
        (bundle / SEGMENT).unlink()
        os.mkfifo(bundle / SEGMENT)
        with pytest.raises(TensorFileError, match=rf"{SEGMENT}: not a regular file"):
            load_bundle(bundle).infer_arguments(0)


def test_a_large_segment_is_memory_mapped_and_checked_range_by_range(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from iobundle.calls import _tensorfile_read

    monkeypatch.setattr(_tensorfile_read, "READ_WHOLE_BYTES", -1)  # every file mapped, none read whole
    expected = [load_bundle(bundle, verify=False).infer_arguments(i) for i in range(4)]
    data = bytearray((bundle / SEGMENT).read_bytes())
    data[-1] ^= 1
    b = load_bundle(bundle)
    assert [list(map(torch.Tensor.tolist, b.infer_arguments(i))) for i in range(4)] == [
        list(map(torch.Tensor.tolist, e)) for e in expected
    ]
    (bundle / SEGMENT).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"ranges\[3\] \(call 3"):
        load_bundle(bundle).infer_arguments(0)


def test_pack_copies_a_segment_up_to_its_size_and_unpack_restores_it(bundle: Path, tmp_path: Path) -> None:
    size = (bundle / SEGMENT).stat().st_size
    with (bundle / SEGMENT).open("ab") as f:
        f.write(b"\x00" * 24)
    packed = pack_bundle(bundle, tmp_path / "run.tar").path
    from_archive = load_bundle(packed)
    assert from_archive.verify() == []
    assert str(from_archive.infer_dynamic_shapes()) == str(load_bundle(bundle).infer_dynamic_shapes())
    unpack_bundle(packed, tmp_path / "unpacked")
    assert (tmp_path / "unpacked" / SEGMENT).stat().st_size == size
    assert load_bundle(tmp_path / "unpacked").verify() == []


def test_a_segment_reads_through_fsspec(bundle: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/iobundle-segments-{os.getpid()}"
    try:
        fs.put(str(bundle), root, recursive=True)
        remote = load_bundle(f"memory://{root}")
        assert remote.verify() == []
        assert all(torch.equal(x, y) for x, y in zip(remote.infer_arguments(2), load_bundle(bundle).infer_arguments(2)))
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_diff_and_convert_read_segments(bundle: Path, tmp_path: Path) -> None:
    same = record(tmp_path / "again", big=False)[0]
    assert diff_bundles(bundle, same).ok
    result = convert_to_npz(load_bundle(bundle), tmp_path / "npz")
    assert sorted(p.name for p in (tmp_path / "npz").iterdir())[:1] == ["call_000000.npz"] and result


def test_the_schema_s_item_sizes_are_torch_s_for_every_dtype_a_bundle_stores() -> None:
    """schema's table is the one the writer and the readers use: each name, torch's element size."""
    from iobundle.calls import NAME_TO_DTYPE
    from iobundle.schema import DTYPE_ITEMSIZES

    assert set(NAME_TO_DTYPE) == set(DTYPE_ITEMSIZES)
    assert {n: torch.empty(0, dtype=d).element_size() for n, d in NAME_TO_DTYPE.items()} == DTYPE_ITEMSIZES
