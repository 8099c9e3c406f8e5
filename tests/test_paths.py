"""``iobundle._paths.Tree``: folders opened from their parent without following a link, one listing each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iobundle._paths import DIR, FILE, LINK, MISSING, Tree
from iobundle.errors import BundleExistsError, UnsafeBundleError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "bundle" / "calls").mkdir(parents=True)
    (tmp_path / "bundle" / "calls" / "a.safetensors").write_bytes(b"a")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "a.safetensors").write_bytes(b"mine")
    return tmp_path / "bundle"


def test_kinds_come_from_one_listing_per_folder(root, monkeypatch):
    (root / "calls" / "link").symlink_to(root / "calls" / "a.safetensors")
    listed = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": listed.append(p) or real(p))
    with Tree(root) as tree:
        assert [tree.kind(n) for n in ("calls/a.safetensors", "calls/link", "calls/none", "calls")] == [
            FILE,
            LINK,
            MISSING,
            DIR,
        ]
        assert tree.kind("calls/a.safetensors") == FILE
    assert len(listed) == 2  # calls/ and the root, once each


def test_a_linked_folder_is_refused_naming_it(root, tmp_path):
    (root / "sub").symlink_to(tmp_path / "outside")
    with Tree(root) as tree, pytest.raises(UnsafeBundleError, match=r"bundle/sub' is a symbolic link"):
        tree.kind("sub/a.safetensors")


def test_the_root_may_be_a_link_the_caller_chose(root, tmp_path):
    (tmp_path / "alias").symlink_to(root)
    with Tree(tmp_path / "alias") as tree:
        assert tree.kind("calls/a.safetensors") == FILE


def test_open_never_follows_a_link(root, tmp_path):
    (root / "calls" / "b.safetensors").symlink_to(tmp_path / "outside" / "a.safetensors")
    with Tree(root, error=BundleExistsError) as tree, pytest.raises(BundleExistsError, match="is a symbolic link"):
        tree.open("calls/b.safetensors", os.O_WRONLY | os.O_TRUNC)
    assert (tmp_path / "outside" / "a.safetensors").read_bytes() == b"mine"


def test_unlink_removes_regular_files_only_and_never_through_a_link(root, tmp_path):
    outside = tmp_path / "outside" / "a.safetensors"
    (root / "linked").symlink_to(tmp_path / "outside")
    (root / "calls" / "b.safetensors").symlink_to(outside)
    with Tree(root) as tree:
        with pytest.raises(UnsafeBundleError, match="linked' is a symbolic link"):
            tree.unlink("linked/a.safetensors")
        with pytest.raises(UnsafeBundleError, match=r"b\.safetensors' is a symbolic link"):
            tree.unlink("calls/b.safetensors")
        with pytest.raises(UnsafeBundleError, match="not a regular file"):
            tree.unlink("calls")
        tree.unlink("calls/a.safetensors")
        tree.unlink("calls/gone", missing_ok=True)
        assert tree.rmdir(("calls",)) is False  # b.safetensors (the link) is still there
    assert outside.read_bytes() == b"mine" and not (root / "calls" / "a.safetensors").exists()


def test_folders_are_made_on_the_way_but_never_through_a_link(root, tmp_path):
    (root / "model").symlink_to(tmp_path / "outside")
    with Tree(root) as tree:
        fd = tree.open("new/deeper/f", os.O_WRONLY | os.O_CREAT, create_folders=True)
        os.close(fd)
        with pytest.raises(UnsafeBundleError, match="model' is a symbolic link"):
            tree.folder(("model",), create=True)
    assert (root / "new" / "deeper" / "f").is_file()
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["a.safetensors"]
