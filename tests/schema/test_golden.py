"""Golden bundles: the compatibility contract. These committed bundles must keep loading, forever.

They were written by ``tests/data/make_golden.py``. If a test here fails, the change broke old
bundles: fix the change (or bump the format version and keep reading version 1), do not
regenerate the bundles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from iobundle import load_bundle  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"
DYN = torch.export.Dim.DYNAMIC
F32, BOOL, I64 = torch.float32, torch.bool, torch.int64

EXPECTED: dict[str, dict[str, Any]] = {
    "plain": {
        "num_obs": 2,
        "dynamic_shapes": ({0: DYN},),
        "arguments": [
            (((2, 8), F32),),
            (((3, 8), F32),),
        ],
        "tensors": 4,
    },
    "nested": {
        "num_obs": 3,
        "dynamic_shapes": {
            "x": {0: DYN},
            "inputs": {"bias": {}, "extra": [{0: DYN}, {}]},
            "mask": {0: DYN},
            "n_heads": None,
        },
        "arguments": [
            {
                "x": ((2, 4), F32),
                "inputs": {"bias": ((4,), F32), "extra": [((2, 3), F32), ((5,), F32)]},
                "mask": ((0, 4), BOOL),  # absent in call 0: its dynamic dimension set to 0
                "n_heads": 2,
            },
            {
                "x": ((3, 4), F32),
                "inputs": {"bias": ((4,), F32), "extra": [((3, 3), F32), ((5,), F32)]},
                "mask": ((3, 4), BOOL),
                "n_heads": 2,
            },
            {
                "x": ((4, 4), F32),
                "inputs": {"bias": ((4,), F32), "extra": [((4, 3), F32), ((5,), F32)]},
                "mask": ((4, 4), BOOL),
                "n_heads": 2,
            },
        ],
        "tensors": 20,
    },
    "streamed": {
        "num_obs": 3,
        "dynamic_shapes": ({0: DYN},),
        "arguments": [
            (((1, 8), F32),),
            (((2, 8), F32),),
            (((3, 8), F32),),
        ],
        "tensors": 6,
    },
    "llama_cache": {
        "num_obs": 3,
        "dynamic_shapes": {
            "input_ids": {1: DYN},
            "position_ids": {1: DYN},
            "cache": [{2: DYN}, {2: DYN}],
            "use_cache": None,
            "logits_to_keep": None,
            "kwargs": {"return_dict": None},
        },
        "arguments": [
            {
                "input_ids": ((1, 3), I64),
                "position_ids": ((1, 3), I64),
                # the prefill's cache had no tensors: its layer is zero-length along the sequence
                "cache": [(((1, 1, 0, 4), F32), ((1, 1, 0, 4), F32))],
                "use_cache": True,
                "logits_to_keep": 1,
                "return_dict": True,
            },
            {
                "input_ids": ((1, 1), I64),
                "position_ids": ((1, 1), I64),
                "cache": [(((1, 1, 3, 4), F32), ((1, 1, 3, 4), F32))],
                "use_cache": True,
                "logits_to_keep": 1,
                "return_dict": True,
            },
            {
                "input_ids": ((1, 1), I64),
                "position_ids": ((1, 1), I64),
                "cache": [(((1, 1, 4, 4), F32), ((1, 1, 4, 4), F32))],
                "use_cache": True,
                "logits_to_keep": 1,
                "return_dict": True,
            },
        ],
        "tensors": 15,
    },
}


def shapes_of(value: Any) -> Any:
    """Replace each tensor by ``(shape, dtype)``, keeping the containers; a cache becomes its layers."""

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype)
        if hasattr(v, "layers"):  # a transformers cache
            return [(leaf(layer.keys), leaf(layer.values)) for layer in v.layers]
        return v

    return torch.utils._pytree.tree_map(leaf, value)


def test_every_golden_bundle_is_checked():
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(EXPECTED)


def _needs(name: str) -> None:
    if name == "llama_cache":
        pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(EXPECTED))
class TestGolden:
    @pytest.fixture(autouse=True)
    def _skip_without_transformers(self, name):
        _needs(name)

    def test_format_version(self, name):
        b = load_bundle(GOLDEN / name)
        assert b.manifest.format == "iobundle"
        assert b.manifest.format_version == 1
        assert b.num_obs() == EXPECTED[name]["num_obs"]
        assert len(b.manifest.tensors) == EXPECTED[name]["tensors"]

    def test_files_are_intact(self, name):
        assert load_bundle(GOLDEN / name).verify() == []

    def test_dynamic_shapes(self, name):
        assert load_bundle(GOLDEN / name).infer_dynamic_shapes() == EXPECTED[name]["dynamic_shapes"]

    def test_arguments(self, name):
        b = load_bundle(GOLDEN / name)
        for i, expected in enumerate(EXPECTED[name]["arguments"]):
            assert shapes_of(b.infer_arguments(i)) == expected, f"call {i}"

    def test_every_tensor_reads(self, name):
        b = load_bundle(GOLDEN / name)
        for key, entry in b.manifest.tensors.items():
            t = b.tensor(key)
            assert list(t.shape) == entry.shape
            assert torch.isfinite(t.float()).all()
        for i in range(b.num_obs()):
            b.outputs(i)


def test_plain_values():
    """The recorded values themselves, not only their shapes (float32 values, written exactly)."""
    b = load_bundle(GOLDEN / "plain")
    (x0,) = b.infer_arguments(0)
    (x1,) = b.infer_arguments(1)
    assert x0[0, :3].tolist() == [-0.2596415579319, 0.11833705008029938, 0.2439592480659485]
    assert x1[2, -2:].tolist() == [2.036036968231201, 0.13159045577049255]
