"""Bundles at s3:// URLs, against a real S3 API on localhost (moto's server, see ``tests/conftest.py``) through s3fs.

The same public calls as ``test_remote.py`` (which uses fsspec's in-memory filesystem): an S3
bucket has no directories, only keys, and every read and write is an HTTP request.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

from two_calls import Model, record  # noqa: E402

from iobundle import BundleExistsError, BundleNotFoundError, InputObserver, load_bundle  # noqa: E402
from iobundle.travel import pack_bundle, unpack_bundle  # noqa: E402

# one worker starts the server for all of them; the calls in their own files, which the tests name
pytestmark = [pytest.mark.xdist_group("s3"), pytest.mark.usefixtures("own_files")]


def keys(url: str) -> list[str]:
    """The object keys under ``url``, relative to it."""
    root = url.removeprefix("s3://").rstrip("/")
    return sorted(name.removeprefix(root + "/") for name in fsspec.filesystem("s3").find(root))


def test_save_to_s3_writes_the_bundles_objects(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = s3.bucket() + "/runs/run.iobundle"
    record(InputObserver()).save(url)
    assert keys(url) == ["calls/000000.safetensors", "calls/000001.safetensors", "manifest.json"]
    assert not any(tmp_path.iterdir()), "an s3:// URL was taken for a local path"


def test_load_bundle_from_s3_matches_the_local_bundle(s3, tmp_path):
    observer = record(InputObserver())
    url = s3.bucket() + "/run"
    observer.save(tmp_path / "local")
    observer.save(url)
    remote, local = load_bundle(url), load_bundle(tmp_path / "local")
    assert remote.path == url
    assert remote.manifest == local.manifest
    assert remote.infer_dynamic_shapes() == local.infer_dynamic_shapes()
    for key in local.manifest.tensors:
        assert torch.equal(remote.tensor(key), local.tensor(key))
    assert remote.verify() == []


def test_damaged_object_is_found_by_verify(s3):
    url = s3.bucket() + "/run"
    record(InputObserver()).save(url)
    fs = fsspec.filesystem("s3")
    key = url.removeprefix("s3://") + "/calls/000001.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    problems = load_bundle(url).verify()
    assert len(problems) == 1 and "calls/000001.safetensors: xxh3-128" in problems[0]


def test_save_to_s3_refuses_a_bundle_there_unless_overwrite(s3):
    url = s3.bucket() + "/run"
    big, model = InputObserver(), Model()
    with big(model, store_n_calls=4):
        for n in range(2, 6):
            model(torch.randn(n, 3))
    big.save(url)
    with pytest.raises(BundleExistsError, match="overwrite=True"):
        record(InputObserver()).save(url)
    fsspec.filesystem("s3").pipe_file(url.removeprefix("s3://") + "/notes.txt", b"keep me")
    record(InputObserver()).save(url, overwrite=True)
    bundle = load_bundle(url)
    assert bundle.num_obs() == 2 and bundle.verify() == []
    # The old bundle's four tensor files are gone, files beside the bundle stay.
    assert keys(url) == ["calls/000000.safetensors", "calls/000001.safetensors", "manifest.json", "notes.txt"]


def test_stream_to_s3_uploads_when_the_block_ends(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = s3.bucket() + "/stream"
    observer = record(InputObserver(), stream_to=url)
    bundle = load_bundle(url)
    assert bundle.num_obs() == 2
    assert bundle.infer_dynamic_shapes() == observer.infer_dynamic_shapes()
    assert not any(tmp_path.iterdir())


def test_packed_bundle_on_s3_is_read_in_place_and_unpacks(s3, tmp_path):
    record(InputObserver()).save(tmp_path / "b")
    url = s3.bucket() + "/b.iobundle.tar"
    pack_bundle(tmp_path / "b", url)
    assert keys(url.rsplit("/", 1)[0]) == ["b.iobundle.tar"]
    bundle = load_bundle(url)
    assert bundle.verify() == [] and bundle.num_obs() == 2
    unpack_bundle(url, tmp_path / "out")
    assert load_bundle(tmp_path / "out").manifest == load_bundle(tmp_path / "b").manifest


def test_missing_key_on_s3_is_not_a_bundle(s3):
    with pytest.raises(BundleNotFoundError, match="does not exist"):
        load_bundle(s3.bucket() + "/nothing")
