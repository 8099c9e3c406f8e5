"""Golden bundles: the compatibility contract. These committed bundles must keep loading, forever.

They were written by ``tests/data/make_golden.py``. If a test here fails, the change broke old
bundles: fix the change (or bump the format version and keep reading the older ones), do not
regenerate the bundles. ``plain``, ``nested``, ``streamed`` and ``llama_cache`` are format
version 1 (sha256, every tensor whole); ``growing`` and ``journal`` are version 2 (XXH3-128,
tensors stored as extensions of earlier ones, and a stream's journal without its manifest);
``compact_nested``, ``compact_growing`` and ``compact_journal`` are version 3 (call structures
stored once, a tensor table per file; the last one a version-3 journal without its manifest);
``segments_nested``, ``segments_growing`` and ``segments_journal`` are version 4 (the same
recordings, the calls' tensors appended as ranges of one segment file; the journal's segment holds
bytes of a call past its last complete line); ``autocast`` is version 5 (the MLP called under
``torch.autocast``: each call records the autocast state it ran under); ``sealed_nested``,
``sealed_growing``, ``sealed_journal`` and ``sealed_llama`` are version 6 (segments are safetensors
files, sealed when the bundle is closed; the journal's is unsealed, as a killed writer leaves it;
the Llama was streamed during ``generate()``).
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
    "growing": {
        "version": 2,
        "num_obs": 4,
        "dynamic_shapes": ({}, [{2: DYN}, {2: DYN}], {1: DYN}),
        "arguments": [(((4,), F32), [((1, 2, n, 4), F32), ((1, 2, n, 4), F32)], ((1, n), I64)) for n in (2, 3, 4, 5)],
        "tensors": 22,
        "extensions": 11,
    },
    "journal": {
        "version": 2,
        "num_obs": 3,
        "dynamic_shapes": ({}, [{2: DYN}, {2: DYN}], {1: DYN}),
        "arguments": [(((4,), F32), [((1, 2, n, 4), F32), ((1, 2, n, 4), F32)], ((1, n), I64)) for n in (2, 3, 4)],
        "tensors": 17,
        "extensions": 8,
    },
    "compact_nested": {
        "version": 3,
        "num_obs": 3,
        "dynamic_shapes": {
            "x": {0: DYN},
            "inputs": {"bias": {}, "extra": [{0: DYN}, {}]},
            "mask": {0: DYN},
            "n_heads": None,
        },
        "arguments": [
            {
                "x": ((n, 4), F32),
                "inputs": {"bias": ((4,), F32), "extra": [((n, 3), F32), ((5,), F32)]},
                "mask": ((n, 4), BOOL),  # call 0: the value_if_missing placeholder, (2, 4)
                "n_heads": 2,
            }
            for n in (2, 3, 4)
        ],
        "tensors": 21,
        "extensions": 1,  # call 2's all-ones mask extends call 1's along dim 0
    },
}
# the same recordings as "growing" and "journal", written in format version 3
EXPECTED["compact_growing"] = {**EXPECTED["growing"], "version": 3}
EXPECTED["compact_journal"] = {**EXPECTED["journal"], "version": 3}
# and in format version 4
EXPECTED["segments_nested"] = {**EXPECTED["compact_nested"], "version": 4}
EXPECTED["segments_growing"] = {**EXPECTED["growing"], "version": 4}
EXPECTED["segments_journal"] = {**EXPECTED["journal"], "version": 4}
EXPECTED["segments_model"] = {
    "version": 4,
    "num_obs": 2,
    "dynamic_shapes": {"input_ids": {1: DYN}, "use_cache": None},
    "arguments": [
        {"input_ids": ((1, 3), I64), "use_cache": False},
        {"input_ids": ((1, 5), I64), "use_cache": False},
    ],
    "tensors": 4,
}
EXPECTED["autocast"] = {
    "version": 5,
    "num_obs": 3,
    "dynamic_shapes": ({0: DYN},),
    "arguments": [(((n, 8), F32),) for n in (2, 3, 4)],
    "tensors": 6,
}
# and in format version 6: segments are safetensors files
EXPECTED["sealed_nested"] = {**EXPECTED["compact_nested"], "version": 6}
EXPECTED["sealed_growing"] = {**EXPECTED["growing"], "version": 6}
EXPECTED["sealed_journal"] = {**EXPECTED["journal"], "version": 6}
EXPECTED["sealed_llama"] = {**EXPECTED["llama_cache"], "version": 6, "extensions": 4}  # streamed: caches as extensions
SEGMENTED = ("segments_nested", "segments_growing", "segments_journal")
SEALED = ("sealed_nested", "sealed_growing", "sealed_journal", "sealed_llama")


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
    if name in ("llama_cache", "segments_model", "sealed_llama"):
        pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(EXPECTED))
class TestGolden:
    @pytest.fixture(autouse=True)
    def _skip_without_transformers(self, name):
        _needs(name)

    def test_format_version(self, name):
        b = load_bundle(GOLDEN / name)
        assert b.manifest.format == "iobundle"
        assert b.manifest.format_version == EXPECTED[name].get("version", 1)
        assert b.num_obs() == EXPECTED[name]["num_obs"]
        assert len(b.manifest.tensors) == EXPECTED[name]["tensors"]
        extensions = sum(e.extends is not None for e in b.manifest.tensors.values())
        assert extensions == EXPECTED[name].get("extensions", 0)
        hashes = {f.algorithm for f in b.manifest.files.values()}
        assert hashes == ({"sha256"} if b.manifest.format_version == 1 else {"xxh3-128"})

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


def test_version_1_to_6_bundles_all_load():
    """The reader keeps format versions 1 to 5 while the writer writes version 6."""
    names = ("plain", "streamed", "growing", "journal", "compact_growing", "compact_journal", *SEGMENTED, "autocast")
    names += ("sealed_growing",)
    assert {load_bundle(GOLDEN / name).manifest.format_version for name in names} == {1, 2, 3, 4, 5, 6}


@pytest.mark.parametrize("name", SEALED)
def test_version_6_segments_are_safetensors_files(name):
    """Every file of a closed version-6 bundle opens with safetensors and holds exactly the manifest's tensors, as
    stored, named by call and path; a killed writer's segment is unsealed (header length 0), its ranges read."""
    from safetensors import safe_open

    _needs(name)
    b = load_bundle(GOLDEN / name)
    (segment,) = (n for n, f in b.manifest.files.items() if f.ranges is not None)
    if name == "sealed_journal":
        assert (GOLDEN / name / segment).read_bytes()[:8] == bytes(8)
        return
    for file in b.manifest.files:
        with safe_open(GOLDEN / name / file, "pt") as f:
            stored = {k for k, e in b.manifest.tensors.items() if e.file == file}
            names = {n: k for n, k in f.metadata().items() if n != "format"} if file == segment else None
            assert len(list(f.keys())) == len(stored)
            for tensor in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                key = names[tensor] if names is not None else tensor
                assert key in stored
                if names is not None:
                    call = int(tensor[4:10])
                    assert tensor.startswith("call") and any(r[0] == call for r in b.manifest.files[segment].ranges)
                assert f.get_tensor(tensor).shape == b._store.file_entries(file)[key].shape


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if EXPECTED[n].get("version", 1) < 5))
def test_older_versions_were_not_recorded_under_autocast(name):
    """Format versions 1 to 4 have no autocast field: their calls read as recorded without autocast."""
    _needs(name)
    assert [c.autocast for c in load_bundle(GOLDEN / name).manifest.calls] == [None] * len(
        load_bundle(GOLDEN / name).manifest.calls
    )


def test_version_5_records_the_autocast_state_of_each_call():
    """The first two calls ran under torch.autocast("cpu", bfloat16): their state is recorded, their outputs are
    bfloat16 from float32 weights; the third ran without autocast and records none."""
    from iobundle.schema import AutocastEntry

    b = load_bundle(GOLDEN / "autocast")
    cpu_bf16 = [AutocastEntry(device_type="cpu", dtype="BF16", enabled=True)]
    assert [c.autocast for c in b.manifest.calls] == [cpu_bf16, cpu_bf16, None]
    assert [b.outputs(i).dtype for i in range(3)] == [torch.bfloat16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("name", SEGMENTED)
def test_version_4_calls_share_one_segment(name):
    """Every call's tensors are a range of calls/segment-000000.bin: no file per call, no header per call."""
    m = load_bundle(GOLDEN / name).manifest
    (segment,) = (n for n, f in m.files.items() if f.ranges is not None)
    assert segment == "calls/segment-000000.bin"
    assert [r[0] for r in m.files[segment].ranges] == [c.index for c in m.calls]
    assert set(m.files) <= {segment, "calls/value_if_missing.safetensors"}
    on_disk = (GOLDEN / name / segment).stat().st_size
    assert on_disk == m.files[segment].size + (40 if name == "segments_journal" else 0)  # a killed call's bytes


@pytest.mark.parametrize(("old", "new"), [("compact_nested", "segments_nested"), ("growing", "segments_growing")])
def test_version_4_holds_what_version_3_held(old, new):
    """The same recording read from versions 2 or 3 and from version 4: the same calls, tensor shapes and values."""
    a, b = load_bundle(GOLDEN / old), load_bundle(GOLDEN / new)
    assert [c.model_copy(update={"latency": None}) for c in a.manifest.calls] == [
        c.model_copy(update={"latency": None}) for c in b.manifest.calls
    ]
    assert {k: (e.shape, e.extends) for k, e in a.manifest.tensors.items()} == {
        k: (e.shape, e.extends) for k, e in b.manifest.tensors.items()
    }
    assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.manifest.tensors)


@pytest.mark.parametrize(("old", "new"), [("growing", "compact_growing"), ("journal", "compact_journal")])
def test_version_3_holds_what_version_2_held(old, new):
    """The same recording (same seed) read from version 2 and version 3: the same calls and tensors."""
    a, b = load_bundle(GOLDEN / old).manifest, load_bundle(GOLDEN / new).manifest
    assert [c.model_copy(update={"latency": None}) for c in a.calls] == [
        c.model_copy(update={"latency": None}) for c in b.calls
    ]
    assert a.tensors == b.tensors
    assert {n: f.size for n, f in a.files.items()} == {n: f.size for n, f in b.files.items()}


@pytest.mark.parametrize(
    "name", ["growing", "journal", "compact_growing", "compact_journal", "segments_growing", "segments_journal"]
)
def test_extensions_rebuild_the_recorded_values(name):
    """Each call's cache is the previous call's output, rebuilt bit for bit from its stored parts."""
    b = load_bundle(GOLDEN / name)
    assert (GOLDEN / name / "manifest.json").exists() == name.endswith("growing")
    for i in range(1, b.num_obs()):
        _, past, mask = b.infer_arguments(i)
        before = b.outputs(i - 1)["past"]
        assert all(torch.equal(p, q) for p, q in zip(past, before))
        assert torch.equal(mask, torch.ones_like(mask))
        x, previous_past, _ = b.infer_arguments(i - 1)
        assert all(torch.equal(p[:, :, :-1], q) for p, q in zip(past, previous_past))
        assert all(torch.equal(p[0, 0, -1], x) for p in past)


def test_plain_values():
    """The recorded values themselves, not only their shapes (float32 values, written exactly)."""
    b = load_bundle(GOLDEN / "plain")
    (x0,) = b.infer_arguments(0)
    (x1,) = b.infer_arguments(1)
    assert x0[0, :3].tolist() == [-0.2596415579319, 0.11833705008029938, 0.2439592480659485]
    assert x1[2, -2:].tolist() == [2.036036968231201, 0.13159045577049255]


def test_model_stored_before_non_finite_floats_still_rebuilds():
    """A self-contained bundle written before configs could hold inf: its Llama rebuilds and gives the recorded logits."""
    pytest.importorskip("transformers")
    from iobundle.replay import load_bundle_model

    b = load_bundle(GOLDEN / "segments_model")
    assert b.manifest.model is not None and b.manifest.model.class_name == "LlamaForCausalLM"
    model = load_bundle_model(GOLDEN / "segments_model")
    assert model.config.vocab_size == 16 and model.config.rms_norm_eps == 1e-6
    for i in range(b.num_obs()):
        with torch.no_grad():
            got = model(**b.infer_arguments(i)).logits
        torch.testing.assert_close(got, b.outputs(i)["logits"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["journal", "compact_journal", "segments_journal", "sealed_journal"])
def test_a_journal_names_the_devices_of_the_tensors_its_lines_added(name):
    head = (GOLDEN / name / "journal.jsonl").read_text().split("\n", 1)[0]
    assert '"devices":[]' in head  # the head was written before any tensor
    assert load_bundle(GOLDEN / name).manifest.producer.devices == ["cpu"]
