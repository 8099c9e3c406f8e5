"""The bundle writer: each call's tensor file named after its index (two calls with one index are refused), and
what replacing a bundle removes."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.errors import BundleWriteError


def test_saving_two_calls_with_one_index_is_refused(tmp_path):
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
        model(torch.randn(2, 4))
    rc = observer._recorded()
    rc.calls[1] = rc.calls[1].model_copy(update={"index": 0})
    with pytest.raises(BundleWriteError, match=r"Call 0 is written twice .* calls/000000\.safetensors"):
        observer.save(tmp_path / "b")
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_overwrite_removes_unlisted_segments_and_no_other_file(tmp_path):
    """Segment files a killed writer left unlisted go with the bundle; files of other names, links and what they point at stay."""
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
    bundle, outside = tmp_path / "b", tmp_path / "users.bin"
    observer.save(bundle)
    calls = bundle / "calls"
    assert (calls / "segment-000000.bin").is_file()  # listed
    orphans = ["segment-000001.bin", "segment-1234567.bin"]
    kept = ["segment-1.bin", "segment-000001.bin.bak", "my-segment-000002.bin", "segment-0000003.bin", "notes.txt"]
    for name in orphans + kept:
        (calls / name).write_bytes(b"x")
    (calls / "segment-000004.bin").mkdir()  # a folder of that name is not a segment
    outside.write_bytes(b"mine")
    (calls / "segment-000005.bin").symlink_to(outside)  # never removed, nor what it points at
    (bundle / "segment-000006.bin").write_bytes(b"beside the bundle, not in calls/")
    observer.save(bundle, overwrite=True)
    assert load_bundle(bundle).verify() == []
    left = {p.name for p in calls.iterdir()}
    assert left == {*kept, "segment-000000.bin", "segment-000004.bin", "segment-000005.bin"}
    assert (calls / "segment-000005.bin").is_symlink() and outside.read_bytes() == b"mine"
    assert (bundle / "segment-000006.bin").is_file()


def test_overwrite_removes_what_a_killed_writer_left_and_no_other_file(tmp_path):
    """A journal, temporary files and unlisted call files go with the bundle, by exact name; a link is never followed."""
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
    bundle, outside = tmp_path / "b", tmp_path / "users.bin"
    observer.save(bundle)
    left = ["journal.jsonl", ".journal.jsonl.tmp", ".manifest.json.tmp", "calls/000007.safetensors"]
    left += ["calls/.000008.safetensors.tmp", "calls/.value_if_missing.safetensors.tmp"]
    kept = ["calls/notes.txt", "calls/000007.safetensors.tmp", "calls/.000008.tmp", "notes.txt", "000007.safetensors"]
    for name in left + kept:
        (bundle / name).write_bytes(b"x")
    outside.write_bytes(b"mine")
    (bundle / "calls" / ".000009.safetensors.tmp").symlink_to(outside)
    observer.save(bundle, overwrite=True)
    assert load_bundle(bundle).verify() == []
    assert not any((bundle / name).exists() for name in left)
    assert all((bundle / name).read_bytes() == b"x" for name in kept)
    assert (bundle / "calls" / ".000009.safetensors.tmp").is_symlink() and outside.read_bytes() == b"mine"


def test_a_failed_save_removes_its_files_and_no_other(tmp_path, monkeypatch):
    """What a failed save wrote goes, by exact name; a user's file in calls/ and beside the bundle stay."""
    from iobundle.capture import _writer

    model, observer = torch.nn.Linear(64, 2048), InputObserver()  # 8 KiB outputs per row: call 1 has its own file
    with observer(model):
        model(torch.randn(1, 64))
        model(torch.randn(16, 64))
    bundle = tmp_path / "b"
    observer.save(bundle)
    (bundle / "calls" / "notes.txt").write_text("mine")
    (bundle / "notes.txt").write_text("mine")
    real = _writer.write_tensor_file

    def full_at_call_one(path, tensors, **kwargs):
        if path.name == "000001.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(_writer, "write_tensor_file", full_at_call_one)
    with pytest.raises(BundleWriteError, match="No space left"):
        observer.save(bundle, overwrite=True)
    left = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*")}
    assert left == {"calls", "calls/notes.txt", "notes.txt"}
