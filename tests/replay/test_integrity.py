"""Hash (XXH3-128; sha256 in format version 1) and size checks of tensor files: on first read (``verify=True``), sizes only (``verify=False``), and ``Bundle.verify()``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash

import iobundle.calls._tensorfile_read as tensorfile
from iobundle import InputObserver, load_bundle
from iobundle._store import LocalStore
from iobundle.errors import IntegrityError, TensorFileError

# every test runs through both ways of opening a tensor file (small files read whole, large ones mapped)
pytestmark = pytest.mark.usefixtures("tensor_file_paths", "own_files")  # own files: the tests edit them

FILE0 = "calls/000000.safetensors"
FILE1 = "calls/000001.safetensors"


class Model(torch.nn.Module):
    def forward(self, x, d=None):
        return x * 2


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(4, 3), d={"w": torch.ones(2)})
    observer.save(tmp_path / "bundle")
    return tmp_path / "bundle"


def flip_last_byte(path: Path) -> None:
    """Flip one bit of tensor data (the last byte is data in every file iobundle writes)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_is_caught_on_first_read(bundle):
    flip_last_byte(bundle / FILE1)
    b = load_bundle(bundle)  # verify=True is the default
    assert b.tensor("t0").shape == (2, 3)  # another file: fine
    with pytest.raises(IntegrityError, match=f"{FILE1}: xxh3-128 [0-9a-f]{{32}} differs from the manifest"):
        b.tensor("t2")
    with pytest.raises(IntegrityError, match=FILE1):
        b.infer_arguments(1)


def test_flipped_byte_in_header_is_caught(bundle):
    data = bytearray((bundle / FILE0).read_bytes())
    data[20] ^= 0x20  # inside the JSON header
    (bundle / FILE0).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"{FILE0}: xxh3-128"):
        load_bundle(bundle).tensor("t0")


def test_verify_false_skips_the_hash(bundle):
    original = load_bundle(bundle).tensor("t4").clone()
    flip_last_byte(bundle / FILE1)
    b = load_bundle(bundle, verify=False)
    changed = b.tensor("t4")
    assert not torch.equal(changed.view(torch.uint8), original.view(torch.uint8))
    assert torch.equal(changed.view(torch.uint8)[:-1], original.view(torch.uint8)[:-1])
    b.infer_arguments(1)


def test_verify_false_still_checks_sizes(bundle):
    (bundle / FILE1).write_bytes((bundle / FILE1).read_bytes() + b"\x00")
    b = load_bundle(bundle, verify=False)
    with pytest.raises(IntegrityError, match=f"{FILE1}: \\d+ bytes, the manifest says \\d+"):
        b.tensor("t2")


def test_verify_false_still_checks_headers(bundle):
    data = (bundle / FILE0).read_bytes()
    (bundle / FILE0).write_bytes(data.replace(b'"F32"', b'"I32"', 1))  # same size, different dtype
    with pytest.raises(TensorFileError, match=f"{FILE0}: tensor 't0' \\(key 't0'\\) is 'I32'"):
        load_bundle(bundle, verify=False).tensor("t0")


def test_hash_is_checked_once_per_file(bundle, monkeypatch):
    calls = []
    real = tensorfile.check_digest
    monkeypatch.setattr(tensorfile, "check_digest", lambda *a, **k: calls.append(a) or real(*a, **k))
    b = load_bundle(bundle)
    for key in b.manifest.tensors:
        b.tensor(key)
    b.infer_arguments(0)
    assert len(calls) == len(b.manifest.files) == 2


def test_a_verified_file_is_read_once(bundle, monkeypatch):
    """Hashing reads the bytes the tensors then view (read whole, or mapped): no file is read a second time."""
    reads = []
    real = LocalStore.open
    monkeypatch.setattr(LocalStore, "open", lambda store, name: reads.append(name) or real(store, name))
    monkeypatch.setattr(tensorfile, "_hash_file", lambda *a, **k: pytest.fail("a tensor file hashed by a second read"))
    b = load_bundle(bundle)
    for key in b.manifest.tensors:
        b.tensor(key)
    # the manifest once, each tensor file once (mapped: opened for its size and hash, then mapped by name)
    assert sorted(reads) == sorted([*b.manifest.files, "manifest.json"])
    flip_last_byte(bundle / FILE1)
    with pytest.raises(IntegrityError, match=f"{FILE1}: xxh3-128 [0-9a-f]{{32}} differs from the manifest"):
        load_bundle(bundle).tensor("t2")


def test_verify_good_bundle(bundle):
    assert load_bundle(bundle).verify() == []


def test_verify_lists_every_bad_file(bundle):
    flip_last_byte(bundle / FILE0)
    flip_last_byte(bundle / FILE1)
    problems = load_bundle(bundle).verify()
    assert len(problems) == 2
    assert FILE0 in problems[0] and "xxh3-128" in problems[0]
    assert FILE1 in problems[1] and "xxh3-128" in problems[1]


def test_verify_reports_each_kind_of_problem(bundle):
    (bundle / FILE0).unlink()
    (bundle / FILE1).write_bytes((bundle / FILE1).read_bytes()[:-4])
    problems = load_bundle(bundle, verify=False).verify()  # verify() always hashes
    assert len(problems) == 2
    assert f"{FILE0}: missing from the bundle" in problems[0]
    assert f"{FILE1}: " in problems[1] and "the manifest says" in problems[1]


def test_verify_checks_headers_against_the_manifest(bundle):
    data = (bundle / FILE0).read_bytes().replace(b'"F32"', b'"I32"', 1)
    (bundle / FILE0).write_bytes(data)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][FILE0]["digest"] = xxhash.xxh3_128_hexdigest(data)  # a consistent, lying manifest
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = load_bundle(bundle).verify()
    assert len(problems) == 1 and f"{FILE0}: tensor 't0'" in problems[0]
