"""Opening a bundle pauses Python's cyclic collector and leaves it as it found it, on success and failure."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from iobundle import BundleNotFoundError, InputObserver, UnsafeBundleError, load_bundle

pytestmark = pytest.mark.usefixtures("own_files")  # these tests name the calls' safetensors files


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, observer = Double(), InputObserver()
    with observer(model):
        model(torch.ones(2, 3))
    observer.save(tmp_path / "b")
    return tmp_path / "b"


@pytest.mark.parametrize("enabled", [True, False])
def test_open_restores_the_collector(saved: Path, enabled: bool) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert load_bundle(saved).num_obs() == 1
        assert gc.isenabled() is enabled
        with pytest.raises(BundleNotFoundError):
            load_bundle(saved / "nope")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_refused_bundle_restores_the_collector(saved: Path) -> None:
    (saved / "calls" / "000000.safetensors").unlink()
    (saved / "calls" / "000000.safetensors").symlink_to("/etc/hostname")
    assert gc.isenabled()
    with pytest.raises(UnsafeBundleError, match="is a symbolic link"):
        load_bundle(saved)
    assert gc.isenabled()


def test_objects_frozen_by_the_caller_stay_frozen(saved: Path) -> None:
    """A process that froze its objects (before a fork) keeps them frozen: the open leaves the permanent generation alone."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert load_bundle(saved).num_obs() == 1
        # Frozen objects still die by reference count (other threads' too), and only gc.freeze() adds
        # to the permanent generation: a freeze by the open would grow the count, an unfreeze empty it.
        assert frozen * 0.9 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_what_the_open_built_is_long_lived(saved: Path) -> None:
    """The manifest's objects go to the oldest generation at once; no young collection walks them again."""
    gc.collect()
    bundle = load_bundle(saved)
    assert gc.get_count()[0] < 700  # the young generation is not left holding the manifest
    assert any(obj is bundle.manifest for obj in gc.get_objects(generation=2))
    assert gc.get_freeze_count() == 0
