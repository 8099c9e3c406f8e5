"""Format version 3, the compact manifest: exact values of a golden bundle, the journal, hostile input.

The hostile cases edit a real version-3 manifest (the golden ``compact_nested`` or ``compact_growing``)
one field at a time; each must fail with an IobundleError naming the field, never with a traceback
from json or pydantic. Version 1 and 2 layouts get the same treatment in tests/replay/test_hostile.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from iobundle.errors import IobundleError, ManifestError, UnsafeBundleError
from iobundle.schema import (
    FORMAT_VERSION,
    ConstNode,
    DictNode,
    Extension,
    FileEntry,
    ListNode,
    Manifest,
    TensorEntry,
    TensorNode,
    dump_manifest,
    journal_call_line,
    journal_head_line,
    load_manifest,
    parse_journal,
    parse_manifest,
)

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"


def golden(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name / "manifest.json").read_text("utf-8"))


def parse(raw: dict[str, Any]) -> Manifest:
    return parse_manifest(json.dumps(raw), source="m.json")


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return load_manifest(GOLDEN / "compact_nested")


@pytest.fixture(scope="module")
def lines() -> list[bytes]:
    """``compact_growing`` as the journal of its stream: the head, then one line per call."""
    m = load_manifest(GOLDEN / "compact_growing")
    out = [journal_head_line(m.model_copy(update={"calls": [], "tensors": {}, "files": {}}))]
    for call in m.calls:
        file = f"calls/{call.index:06d}.safetensors"
        tensors = {k: e for k, e in m.tensors.items() if e.file == file}
        out.append(journal_call_line(call, tensors, {file: m.files[file]}))
    return out


class TestGoldenValues:
    """``compact_nested`` read field by field: what a version-3 file says, the in-memory manifest holds."""

    def test_the_file_is_compact(self):
        raw = golden("compact_nested")
        assert raw["format_version"] == 3 and raw["hash"] == "xxh3-128"
        assert len(raw["structures"]) == 2 and len(raw["calls"]) == 3  # call 0 has a filled mask, 1 and 2 not
        assert [c["structure"] for c in raw["calls"]] == [0, 1, 1]
        assert "tensors" not in raw and all("hash" not in f for f in raw["files"].values())

    def test_calls(self, manifest):
        call = manifest.calls[0]
        assert call.index == 0 and call.status == "ok" and call.error is None and call.latency > 0
        assert call.args == [
            TensorNode(key="t1"),
            DictNode(
                keys=["bias", "extra"],
                items=[TensorNode(key="t2"), ListNode(items=[TensorNode(key="t3"), TensorNode(key="t4")])],
            ),
        ]
        assert call.kwargs == {"mask": TensorNode(key="t0")}  # the value_if_missing placeholder
        assert call.cst_kwargs == {"n_heads": 2} and call.filled == ["mask"]
        assert call.outputs == DictNode(
            keys=["y", "parts"], items=[TensorNode(key="t5"), ListNode(items=[TensorNode(key="t6")])]
        )
        assert manifest.calls[2].kwargs == {"mask": TensorNode(key="t18")} and manifest.calls[2].filled == []
        assert manifest.value_if_missing[0].key == "mask"
        assert manifest.value_if_missing[0].value == TensorNode(key="t0")

    def test_tensors_and_files(self, manifest):
        assert len(manifest.tensors) == 21 and list(manifest.tensors)[:2] == ["t0", "t1"]
        assert manifest.tensors["t0"] == TensorEntry(
            file="calls/value_if_missing.safetensors", name="t0", dtype="BOOL", shape=[2, 4]
        )
        assert manifest.tensors["t18"] == TensorEntry(
            file="calls/000002.safetensors",
            name="t18",
            dtype="BOOL",
            shape=[4, 4],
            extends=Extension(key="t11", dim=0),
        )
        assert manifest.files["calls/000000.safetensors"] == FileEntry(
            size=524, hash="xxh3-128", digest="9f099943ac7835ff0b353405c58dfd50"
        )
        assert manifest.producer.devices == ["cpu"] and manifest.signature.parameters[3].default == 1

    def test_equal_to_the_models_validated_whole(self, manifest):
        """The fast construction gives what pydantic validation of the same content gives."""
        assert Manifest.model_validate(manifest.model_dump()) == manifest
        again = parse_manifest(dump_manifest(manifest))
        text = (GOLDEN / "compact_nested" / "manifest.json").read_text()
        assert again == manifest.model_copy(update={"format_version": FORMAT_VERSION})  # written as the newest version
        assert dump_manifest(again) == text.replace('"format_version":3', f'"format_version":{FORMAT_VERSION}', 1)

    def test_tensor_nodes_and_constant_subtrees_are_shared(self):
        m = load_manifest(GOLDEN / "compact_growing")
        # the cache output by call 0 is the cache input of call 1: one node object per key
        assert m.calls[1].args[1].items[0] is m.calls[0].outputs.items[1].items[0]
        m.calls[0].model_copy(update={"index": 7})  # copies of shared models stay independent
        assert m.calls[0].index == 0


def test_every_node_kind_and_option_round_trips(tmp_path):
    """Constants, None, opaque values, registered nodes, a failed call, a CUDA tensor and a renamed one."""
    raw = golden("compact_nested")
    raw["structures"].append(
        {
            "args": [
                {"kind": "const", "value": float("nan")},
                {"kind": "none"},
                {"kind": "opaque", "type": "m.Thing", "reason": "why"},
                {"kind": "tuple", "items": [{"kind": "const", "value": "s"}, {"kind": "tensor", "slot": 0}]},
                {"kind": "node", "type": "t.T", "version": 2, "context": {"a": [1]}, "items": []},
            ],
            "kwargs": {"k": {"kind": "list", "items": []}},
        }
    )
    raw["calls"].append({"index": 3, "structure": 2, "keys": ["t99"], "status": "failed", "error": "boom"})
    raw["files"]["calls/000003.safetensors"] = {
        "size": 8,
        "hash": "sha256",
        "digest": "0" * 64,
        "tensors": {"t99": ["F16", [2], None, {"device": "cuda:0", "name": "inner"}]},
    }
    m = parse(raw)
    call = m.calls[3]
    assert call.status == "failed" and call.error == "boom" and call.latency is None and call.outputs is None
    assert call.args[0].value != call.args[0].value  # NaN
    assert call.args[3].items[0] == ConstNode(value="s") and call.args[3].items[1] == TensorNode(key="t99")
    assert call.args[4].context == {"a": [1]}
    assert m.tensors["t99"] == TensorEntry(
        file="calls/000003.safetensors", name="inner", dtype="F16", shape=[2], device="cuda:0"
    )
    assert m.files["calls/000003.safetensors"].algorithm == "sha256"
    again = parse_manifest(dump_manifest(m))
    assert dump_manifest(again) == dump_manifest(m)
    assert again.tensors == m.tensors and again.calls[3].args[4] == call.args[4]


def test_version_1_file_entries_are_written_with_their_algorithm_named():
    m = load_manifest(GOLDEN / "plain")  # format version 1: sha256 everywhere
    raw = json.loads(dump_manifest(m))
    assert raw["hash"] == "sha256" and all("hash" not in f for f in raw["files"].values())
    again = parse_manifest(json.dumps(raw))
    assert {n: f.hexdigest for n, f in again.files.items()} == {n: f.hexdigest for n, f in m.files.items()}


def test_a_base_listed_after_its_extension_cannot_be_written():
    m = load_manifest(GOLDEN / "compact_growing")
    tensors = dict(reversed(list(m.tensors.items())))
    with pytest.raises(ManifestError, match=r"extends .*, which format version 4 would list after it"):
        dump_manifest(m.model_copy(update={"tensors": tensors}))


class TestJournal:
    def test_rebuilds_the_manifest(self, lines):
        golden = load_manifest(GOLDEN / "compact_growing")  # format version 3; the journal is written in 5
        assert parse_journal(b"".join(lines)) == golden.model_copy(update={"format_version": FORMAT_VERSION})

    def test_a_line_is_one_compact_record(self, lines):
        record = json.loads(lines[2])
        assert set(record) == {"call", "files"}
        assert set(record["call"]) == {"index", "structure", "keys", "latency"}
        assert isinstance(record["call"]["structure"], dict)  # written out: a line stands alone
        assert len(lines[2]) < 1200

    def test_calls_share_their_structure(self, lines):
        m = parse_journal(b"".join(lines))
        assert m.calls[1].args[1].items[0] is m.calls[0].outputs.items[1].items[0]

    def test_a_cut_last_line_is_ignored(self, lines):
        data = b"".join(lines)
        assert len(parse_journal(data[:-30]).calls) == len(lines) - 2

    def test_a_file_added_twice(self, lines):
        with pytest.raises(
            ManifestError, match=r"line 5: files\['calls/000002.safetensors'\]: a file added a second time"
        ):
            parse_journal(b"".join([*lines[:4], lines[3]]))

    @pytest.mark.parametrize("structure", [3, None, [1], "s"])
    def test_a_structure_that_is_not_an_object(self, lines, structure):
        record = json.loads(lines[1])
        record["call"]["structure"] = structure
        with pytest.raises(ManifestError, match=r"line 2: call\.structure is not a structure"):
            parse_journal(lines[0] + json.dumps(record).encode() + b"\n")

    def test_a_bad_structure_names_its_line_through_validation(self, lines):
        record = json.loads(lines[1])
        record["call"]["structure"]["args"][0]["slot"] = 5
        with pytest.raises(ManifestError, match=r"structures\[0\]\.args\[0\]: slot 5 where slot 0 comes"):
            parse_journal(lines[0] + json.dumps(record).encode() + b"\n")


# -- hostile edits of a version-3 manifest ------------------------------------------------------

FILE2 = "calls/000002.safetensors"


def _row(raw: dict[str, Any], key: str) -> list[Any]:
    for f in raw["files"].values():
        if key in f.get("tensors", {}):
            return f["tensors"][key]
    raise KeyError(key)


def _nest(raw: dict[str, Any]) -> None:
    node: Any = {"kind": "tensor", "slot": 0}
    for _ in range(120):
        node = {"kind": "list", "items": [node]}
    raw["structures"][0]["args"][0] = node


HOSTILE: dict[str, tuple[Any, type[Exception], str]] = {
    # top level (checked by the CompactManifest model)
    "unknown top-level field": (lambda m: m.update(evil=1), ManifestError, r"evil: Extra inputs"),
    "no calls": (lambda m: m.pop("calls"), ManifestError, r"calls: Field required"),
    "calls not a list": (lambda m: m.update(calls={}), ManifestError, r"calls: expected a list"),
    "calls null": (lambda m: m.update(calls=None), ManifestError, r"calls: expected a list, found NoneType"),
    "files not an object": (lambda m: m.update(files=[]), ManifestError, r"files: expected an object"),
    "unknown hash": (lambda m: m.update(hash="md5"), ManifestError, r"hash: Input should be"),
    "too deep": (_nest, UnsafeBundleError, r"JSON nesting deeper than 100 levels"),
    # structures
    "slot out of order": (
        lambda m: m["structures"][1]["args"][0].update(slot=1),
        ManifestError,
        r"structures\[1\]\.args\[0\]: slot 1 where slot 0 comes",
    ),
    "tensor without slot": (
        lambda m: m["structures"][1]["args"].__setitem__(0, {"kind": "tensor", "key": "t0"}),
        ManifestError,
        r"structures\[1\]\.args\[0\]\.tensor\.slot: Field required",
    ),
    "dict keys and items": (
        lambda m: m["structures"][1]["args"][1]["keys"].append("more"),
        ManifestError,
        r"structures\[1\]\.args\[1\]: a dict with 3 keys but 2 items",
    ),
    "repeated dict key": (
        lambda m: m["structures"][1]["args"][1].update(keys=["a", "a"]),
        ManifestError,
        r"a dict with a repeated key",
    ),
    # calls
    "unknown call field": (lambda m: m["calls"][0].update(evil=1), ManifestError, r"calls\[0\]: unknown field 'evil'"),
    "call not an object": (lambda m: m["calls"].__setitem__(1, [1]), ManifestError, r"calls\[1\]: expected an object"),
    "negative index": (lambda m: m["calls"][0].update(index=-1), ManifestError, r"calls\[0\]\.index"),
    "bool index": (lambda m: m["calls"][0].update(index=True), ManifestError, r"calls\[0\]\.index"),
    "structure out of range": (
        lambda m: m["calls"][2].update(structure=2),
        ManifestError,
        r"calls\[2\]\.structure: 2 is not one of the 2 structures",
    ),
    "structure as text": (lambda m: m["calls"][2].update(structure="0"), ManifestError, r"calls\[2\]\.structure"),
    "a key too few": (
        lambda m: m["calls"][1]["keys"].pop(),
        ManifestError,
        r"calls\[1\]\.keys: structure 1 has 7 tensor slots, found 6 keys",
    ),
    "keys not a list": (lambda m: m["calls"][1].update(keys="t1"), ManifestError, r"calls\[1\]\.keys"),
    "key not a string": (
        lambda m: m["calls"][1]["keys"].__setitem__(3, ["t1"]),
        ManifestError,
        r"calls\[1\]\.keys: a key must be a string, found \['t1'\]",
    ),
    "bad status": (lambda m: m["calls"][0].update(status="done"), ManifestError, r"calls\[0\]\.status"),
    "error not text": (lambda m: m["calls"][0].update(error=3), ManifestError, r"calls\[0\]\.error"),
    "latency as text": (lambda m: m["calls"][0].update(latency="1"), ManifestError, r"calls\[0\]\.latency"),
    "latency as bool": (lambda m: m["calls"][0].update(latency=True), ManifestError, r"calls\[0\]\.latency"),
    # files and tensor rows
    "unknown file field": (
        lambda m: m["files"][FILE2].update(sha256="0" * 64),
        ManifestError,
        r"files\['calls/000002.safetensors'\]: unknown field 'sha256'",
    ),
    "negative size": (lambda m: m["files"][FILE2].update(size=-1), ManifestError, r"\.size: expected an integer"),
    "short digest": (lambda m: m["files"][FILE2].update(digest="abc"), ManifestError, r"\.digest: expected 32"),
    "digest of another hash": (
        lambda m: m["files"][FILE2].update(hash="sha256"),
        ManifestError,
        r"\.digest: expected 64 lowercase hex digits \(a sha256 digest\)",
    ),
    "row not a list": (
        lambda m: m["files"][FILE2]["tensors"].update(t14={"dtype": "F32"}),
        ManifestError,
        r"tensors\['t14'\]: expected \[dtype, shape, extends\?, options\?\]",
    ),
    "row too long": (lambda m: _row(m, "t14").extend([None, {}, 1]), ManifestError, r"tensors\['t14'\]: expected"),
    "bad dtype": (lambda m: _row(m, "t14").__setitem__(0, "F33"), ManifestError, r"dtype 'F33' is not one of"),
    "dtype not text": (lambda m: _row(m, "t14").__setitem__(0, ["F32"]), ManifestError, r"dtype \['F32'\]"),
    "negative dim": (lambda m: _row(m, "t14").__setitem__(1, [-1, 4]), ManifestError, r"a dimension must be an"),
    "float dim": (lambda m: _row(m, "t14").__setitem__(1, [2.0, 4]), ManifestError, r"a dimension must be an"),
    "bool dim": (lambda m: _row(m, "t14").__setitem__(1, [True, 4]), ManifestError, r"a dimension must be an"),
    "nested dim": (lambda m: _row(m, "t14").__setitem__(1, [[4], 4]), ManifestError, r"a dimension must be an"),
    "shape not a list": (lambda m: _row(m, "t14").__setitem__(1, 4), ManifestError, r"shape must be a list"),
    "rank over the limit": (lambda m: _row(m, "t14").__setitem__(1, [1] * 65), UnsafeBundleError, r"65 dimensions"),
    "too many elements": (lambda m: _row(m, "t14").__setitem__(1, [2**40, 2**40]), UnsafeBundleError, "too large"),
    "a key in two files": (
        lambda m: m["files"][FILE2]["tensors"].update(t1=["F32", [2, 4]]),
        ManifestError,
        r"tensors\['t1'\]: a tensor listed a second time",
    ),
    "extends a later tensor": (
        lambda m: _row(m, "t11").append(["t18", 0]),
        UnsafeBundleError,
        r"tensor 't18' is not listed before it",
    ),
    "extends itself": (lambda m: _row(m, "t18").__setitem__(2, ["t18", 0]), UnsafeBundleError, r"'t18' is itself"),
    "extends another dtype": (
        lambda m: _row(m, "t18").__setitem__(2, ["t7", 0]),
        UnsafeBundleError,
        r"BOOL \[4, 4\] cannot extend 't7' \(F32 \[3, 4\]\)",
    ),
    "extends along a dim past the rank": (
        lambda m: _row(m, "t18").__setitem__(2, ["t11", 2]),
        UnsafeBundleError,
        r"cannot extend 't11'",
    ),
    "extends a longer tensor": (
        lambda m: _row(m, "t18").__setitem__(1, [2, 4]),
        UnsafeBundleError,
        r"shape \[2, 4\] does not extend \[3, 4\]",
    ),
    "extends of the wrong shape": (
        lambda m: _row(m, "t18").__setitem__(2, {"key": "t11", "dim": 0}),
        ManifestError,
        r"extends: expected \[key, dim\]",
    ),
    "negative extends dim": (lambda m: _row(m, "t18").__setitem__(2, ["t11", -1]), ManifestError, r"extends: expected"),
    "unknown option": (
        lambda m: _row(m, "t14").extend([None, {"file": "/etc/passwd"}]),
        ManifestError,
        r"options must be an object of device and name",
    ),
    "device not text": (lambda m: _row(m, "t14").extend([None, {"device": 0}]), ManifestError, r"must be strings"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_edit_is_refused_naming_the_field(case):
    edit, error, match = HOSTILE[case]
    raw = copy.deepcopy(golden("compact_nested"))
    edit(raw)
    with pytest.raises(error, match=match) as info:
        parse(raw)
    assert str(info.value).startswith("m.json: ")


def test_hostile_cases_start_from_a_valid_manifest():
    parse(golden("compact_nested"))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.999])
def test_a_cut_manifest_is_a_manifest_error(fraction):
    text = (GOLDEN / "compact_nested" / "manifest.json").read_bytes()
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(text[: int(len(text) * fraction)])


def test_random_single_byte_edits_fail_cleanly():
    """Every byte of a version-3 manifest replaced in turn by another: a Manifest or an IobundleError."""
    text = (GOLDEN / "compact_growing" / "manifest.json").read_bytes()
    outcomes = {"ok": 0, "refused": 0}
    for pos in range(0, len(text), 3):
        for new in (b"0", b'"', b"]", b"-"):
            try:
                parse_manifest(text[:pos] + new + text[pos + 1 :])
                outcomes["ok"] += 1
            except IobundleError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > outcomes["ok"] > 0


@pytest.mark.parametrize("text", [b"", b"{", (GOLDEN / "compact_nested" / "manifest.json").read_bytes()])
def test_parsing_leaves_the_garbage_collector_as_it_was(text):
    import gc

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            try:
                parse_manifest(text)
            except ManifestError:
                pass
            assert gc.isenabled() == enabled
        finally:
            gc.enable()


class TestAutocastField:
    """Format version 5's ``autocast`` of a call record: read back, refused where it has no meaning or is wrong."""

    def test_reads_back_and_survives_a_rewrite(self):
        manifest = load_manifest(GOLDEN / "autocast")
        assert [c.autocast is not None for c in manifest.calls] == [True, True, False]
        again = parse_manifest(dump_manifest(manifest))
        assert [c.autocast for c in again.calls] == [c.autocast for c in manifest.calls]

    def test_a_version_4_manifest_holds_none(self):
        raw = golden("autocast")
        raw["format_version"] = 4
        with pytest.raises(ManifestError, match=r"calls\[0\]\.autocast: autocast is a format_version 5 field"):
            parse_manifest(json.dumps(raw))

    def test_a_version_2_manifest_holds_none(self):
        raw = golden("growing")  # the layout of versions 1 and 2: whole call entries
        raw["calls"][0]["autocast"] = [{"device_type": "cpu", "dtype": "BF16", "enabled": True}]
        with pytest.raises(ManifestError, match=r"calls\[0\]\.autocast is a format_version 5 field"):
            parse_manifest(json.dumps(raw))

    @pytest.mark.parametrize(
        ("entry", "where"),
        [
            ({"device_type": "cuda", "dtype": "I64", "enabled": True}, r"\[0\]\.dtype"),
            ({"device_type": "../cuda", "dtype": "BF16", "enabled": True}, r"\[0\]\.device_type"),
            ({"device_type": "cuda", "dtype": "BF16", "enabled": 1}, r"\[0\]\.enabled"),
            ({"device_type": "cuda", "dtype": "BF16", "enabled": True, "extra": 1}, r"\[0\]\.extra"),
        ],
    )
    def test_a_bad_entry_is_refused_by_its_field(self, entry, where):
        raw = golden("autocast")
        raw["calls"][1]["autocast"] = [entry]
        with pytest.raises(ManifestError, match=r"calls\[1\]\.autocast" + where):
            parse_manifest(json.dumps(raw))


# -- sizes


def test_a_tensor_larger_than_its_file_is_refused_when_the_manifest_is_read():
    raw = golden("compact_nested")
    _row(raw, "t14")[1] = [1000, 1000]
    with pytest.raises(UnsafeBundleError, match=r"tensors\['t14'\]: \w+ \[1000, 1000\] needs \d+ bytes but its file"):
        parse(raw)
