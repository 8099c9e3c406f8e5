"""Bundles at fsspec URLs: save, stream_to and load_bundle through fsspec's real in-memory filesystem.

A ``scheme://`` string is a URL, never a local path: without fsspec it is a MissingDependencyError
naming the extra to install, and nothing named ``memory:`` appears on the disk.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

from two_calls import Model, record  # noqa: E402

from iobundle import BundleExistsError, BundleNotFoundError, InputObserver, load_bundle  # noqa: E402
from iobundle._remote import is_url, local_path  # noqa: E402
from iobundle.travel import pack_bundle, unpack_bundle  # noqa: E402

pytestmark = pytest.mark.usefixtures("own_files")  # these tests name the calls' safetensors files


@pytest.fixture
def url():
    """A fresh directory of fsspec's in-memory filesystem, removed afterwards."""
    root = f"/iobundle-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def in_tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_is_url_tells_urls_from_paths():
    assert is_url("s3://bucket/run") and is_url("memory://x") and is_url("hf://datasets/a/b")
    assert not is_url("run.iobundle") and not is_url("C:\\runs\\x") and not is_url(Path("memory://x"))
    assert local_path("file:///tmp/run") == Path("/tmp/run")
    assert local_path("memory://x") is None


def test_save_to_a_url_uploads_the_bundle_manifest_last(url, in_tmp_cwd):
    observer = record(InputObserver())
    observer.save(url + "/run.iobundle")
    fs = fsspec.filesystem("memory")
    names = sorted(fs.find(url.removeprefix("memory://")))
    assert [n.rsplit("/run.iobundle/", 1)[1] for n in names] == [
        "calls/000000.safetensors",
        "calls/000001.safetensors",
        "manifest.json",
    ]
    assert not any(in_tmp_cwd.iterdir()), "a URL was taken for a local path"


def test_load_bundle_from_a_url_matches_the_local_bundle(url, tmp_path):
    observer = record(InputObserver())
    observer.save(tmp_path / "local")
    observer.save(url + "/run")
    remote, local = load_bundle(url + "/run"), load_bundle(tmp_path / "local")
    assert remote.path == url + "/run"
    assert remote.infer_dynamic_shapes() == local.infer_dynamic_shapes()
    for key in local.manifest.tensors:
        assert torch.equal(remote.tensor(key), local.tensor(key))
    assert remote.verify() == []


def test_remote_bundle_is_checked_like_a_local_one(url):
    record(InputObserver()).save(url + "/run")
    fs = fsspec.filesystem("memory")
    path = url.removeprefix("memory://") + "/run/calls/000000.safetensors"
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    bundle = load_bundle(url + "/run")
    assert any("calls/000000.safetensors: xxh3-128" in p for p in bundle.verify())


def test_save_to_a_url_refuses_a_non_empty_target(url):
    observer = record(InputObserver())
    observer.save(url + "/run")
    with pytest.raises(BundleExistsError, match="overwrite=True"):
        observer.save(url + "/run")
    observer.save(url + "/run", overwrite=True)
    assert load_bundle(url + "/run").num_obs() == 2


def test_stream_to_a_url_uploads_when_the_block_ends(url, in_tmp_cwd):
    observer = record(InputObserver(), stream_to=url + "/stream")
    bundle = load_bundle(url + "/stream")
    assert bundle.num_obs() == 2
    assert bundle.infer_dynamic_shapes() == observer.infer_dynamic_shapes()
    assert not any(in_tmp_cwd.iterdir())


def test_packed_bundle_at_a_url_is_read(url, tmp_path):
    record(InputObserver()).save(tmp_path / "b")
    pack_bundle(tmp_path / "b", url + "/b.tar")
    bundle = load_bundle(url + "/b.tar")
    assert bundle.verify() == []
    assert bundle.num_obs() == 2


def test_packed_bundle_at_a_url_unpacks(url, tmp_path):
    record(InputObserver()).save(tmp_path / "b")
    pack_bundle(tmp_path / "b", url + "/b.tar")
    unpack_bundle(url + "/b.tar", tmp_path / "out")
    assert load_bundle(tmp_path / "out").verify() == []


def test_missing_url_is_not_a_bundle(url):
    with pytest.raises(BundleNotFoundError, match="does not exist"):
        load_bundle(url + "/nothing")


def test_without_fsspec_a_url_is_a_missing_dependency_error(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        sys.modules["fsspec"] = None  # as if it were not installed
        import torch
        from iobundle import InputObserver, MissingDependencyError, load_bundle
        class M(torch.nn.Module):
            def forward(self, x):
                return x
        m, o = M(), InputObserver()
        with o(m):
            m(torch.ones(1))
        for action in (lambda: o.save("memory://x"), lambda: load_bundle("s3://bucket/run")):
            try:
                action()
            except MissingDependencyError as exc:
                print("MissingDependencyError:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert "pip install 'iobundle[remote]'" in lines[0] and "pip install 'iobundle[s3]'" in lines[1]
    assert "'memory://x' is a URL" in lines[0] and "'s3://bucket/run' is a URL" in lines[1]
    assert list(tmp_path.iterdir()) == [], "a URL was taken for a local path"


def test_overwrite_never_deletes_what_is_not_a_bundle(url):
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://") + "/precious"
    fs.pipe_file(root + "/notes.txt", b"keep me")
    with pytest.raises(BundleExistsError, match="not a bundle"):
        record(InputObserver()).save(url + "/precious", overwrite=True)
    assert fs.cat_file(root + "/notes.txt") == b"keep me"


def test_overwrite_replaces_only_the_old_bundles_files_remote(url):
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://") + "/run"
    big = InputObserver()
    model = Model()
    with big(model, store_n_calls=5):
        for n in range(2, 7):
            model(torch.randn(n, 3))
    big.save(url + "/run")
    old = set(fs.find(root))
    fs.pipe_file(root + "/notes.txt", b"keep me")
    fs.pipe_file(root + "/calls/README", b"keep me too")
    record(InputObserver()).save(url + "/run", overwrite=True)
    assert fs.cat_file(root + "/notes.txt") == b"keep me" and fs.cat_file(root + "/calls/README") == b"keep me too"
    bundle = load_bundle(url + "/run")
    assert bundle.num_obs() == 2 and bundle.verify() == []
    listed = {f"{root}/{n}" for n in bundle.manifest.files} | {f"{root}/manifest.json"}
    assert set(fs.find(root)) - listed == {root + "/notes.txt", root + "/calls/README"}  # no stale tensor file
    assert old - listed - set(fs.find(root)), "the larger bundle's extra files are gone"


def test_stream_to_url_respects_overwrite(url):
    record(InputObserver()).save(url + "/live")  # another machine wrote a bundle there meanwhile
    observer = InputObserver()
    model = Model()
    with observer(model, stream_to=url + "/other"):  # our stream, to an empty URL
        model(torch.randn(2, 3))
    fs = fsspec.filesystem("memory")
    mine = url.removeprefix("memory://") + "/other"
    fs.rm(mine, recursive=True)
    record(InputObserver()).save(url + "/other")  # someone else's bundle lands where ours was
    theirs = fs.cat_file(mine + "/manifest.json")
    with pytest.warns(Warning, match="could not upload"), observer(model, stream_to=url + "/other"):
        model(torch.randn(3, 3))
    assert fs.cat_file(mine + "/manifest.json") == theirs, "a bundle this observer did not write was replaced"
    with observer(model, stream_to=url + "/other", overwrite=True):
        model(torch.randn(4, 3))
    assert load_bundle(url + "/other").num_obs() == 3


def test_stream_to_url_replaces_its_own_upload(url):
    observer, model = InputObserver(), Model()
    for n in (2, 3):
        with observer(model, stream_to=url + "/live"):
            model(torch.randn(n, 3))
    assert load_bundle(url + "/live").num_obs() == 2


def test_staged_uploads_on_success_and_always_removes_the_staging_folder(url, tmp_path):
    from iobundle._remote import staged

    fs = fsspec.filesystem("memory")
    with staged(url + "/one", prefix="iobundle-test-") as local:
        local.mkdir()
        (local / "manifest.json").write_text("{}")
        (local / ".half.tmp").write_text("a writer's temporary file")  # never uploaded
        folder = local.parent
    assert not folder.exists()
    assert fs.cat_file(url.removeprefix("memory://") + "/one/manifest.json") == b"{}"
    assert not fs.exists(url.removeprefix("memory://") + "/one/.half.tmp")
    with pytest.raises(RuntimeError), staged(url + "/two") as local:
        local.write_text("a file")
        folder = local.parent
        raise RuntimeError("the writer failed")
    assert not folder.exists() and not fs.exists(url.removeprefix("memory://") + "/two")


def test_a_listed_name_that_is_a_folder_stops_the_overwrite_before_anything_is_removed(tmp_path):
    from iobundle._remote import clear_local_bundle

    (tmp_path / "calls").mkdir()
    (tmp_path / "manifest.json").write_text('{"files": {"calls": {}}}')
    with pytest.raises(BundleExistsError, match="calls' is not a regular file"):
        clear_local_bundle(tmp_path)
    assert (tmp_path / "calls").is_dir() and (tmp_path / "manifest.json").is_file()


def test_an_overwrite_through_a_linked_folder_removes_nothing(tmp_path):
    from iobundle._remote import clear_local_bundle

    outside = tmp_path / "users"
    outside.mkdir()
    (outside / "000000.safetensors").write_bytes(b"mine")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "calls").symlink_to(outside)
    (bundle / "manifest.json").write_text('{"files": {"calls/000000.safetensors": {}}}')
    with pytest.raises(BundleExistsError, match="calls' is a symbolic link"):
        clear_local_bundle(bundle)
    assert (outside / "000000.safetensors").read_bytes() == b"mine" and (bundle / "manifest.json").is_file()


def test_a_remote_overwrite_refuses_entries_the_filesystem_reports_as_links(tmp_path):
    """fsspec's local filesystem reports links (``islink``): the bundle there is not replaced, nothing removed."""
    pytest.importorskip("fsspec")
    from iobundle._remote import upload_directory

    outside = tmp_path / "users"
    outside.mkdir()
    (outside / "000000.safetensors").write_bytes(b"mine")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "calls").symlink_to(outside)
    (bundle / "manifest.json").write_text('{"files": {"calls/000000.safetensors": {}}}')
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "manifest.json").write_text("{}")
    with pytest.raises(BundleExistsError, match="is a symbolic link"):
        upload_directory(staging, f"local://{bundle}", overwrite=True)
    assert (outside / "000000.safetensors").read_bytes() == b"mine" and (bundle / "manifest.json").is_file()


def test_an_old_manifest_naming_files_outside_is_refused_and_nothing_deleted(tmp_path):
    from iobundle._remote import clear_local_bundle

    (tmp_path / "manifest.json").write_text('{"files": {"../outside.txt": {}}}')
    with pytest.raises(BundleExistsError, match="not inside the bundle"):
        clear_local_bundle(tmp_path)
    assert (tmp_path / "manifest.json").exists()


def test_an_old_manifest_naming_a_file_with_a_control_character_is_refused_and_nothing_deleted(tmp_path):
    from iobundle._remote import clear_local_bundle

    (tmp_path / "manifest.json").write_text('{"files": {"calls/\\u001b[2J.safetensors": {}}}')
    with pytest.raises(BundleExistsError, match="not inside the bundle"):
        clear_local_bundle(tmp_path)
    assert (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("link", ["calls", "calls/000000.safetensors"])
def test_a_remote_bundle_whose_files_the_filesystem_reports_as_links_is_refused(tmp_path, link):
    pytest.importorskip("fsspec")
    import shutil

    import torch

    from iobundle.errors import UnsafeBundleError

    observer = InputObserver()
    model = torch.nn.Linear(3, 2)
    with observer(model):
        model(torch.randn(2, 3))
    bundle = tmp_path / "run.iobundle"
    observer.save(bundle)
    outside = tmp_path / "outside"
    source = bundle / link
    if source.is_dir():
        shutil.copytree(source, outside)
        shutil.rmtree(source)
    else:
        outside.mkdir()
        outside = outside / source.name
        shutil.copy(source, outside)
        source.unlink()
    source.symlink_to(outside)
    if link == "calls":  # a folder: refused when the bundle is opened
        with pytest.raises(UnsafeBundleError, match="calls' is a symbolic link"):
            load_bundle(f"local://{bundle}")
    else:  # a file: refused when it is read
        problems = load_bundle(f"local://{bundle}").verify()
        assert len(problems) == 1 and "000000.safetensors' is a symbolic link" in problems[0]
