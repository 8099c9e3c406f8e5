"""Fuzz the bundle reader: mutated bundles must load and replay, or fail with an IobundleError.

Valid bundles are mutated at random (JSON values replaced, deleted or inserted anywhere in the
manifest; bytes flipped, files truncated or extended; safetensors header fields edited), then
loaded, inferred from and read in full. Any exception that is not an ``IobundleError`` fails.

``IOBUNDLE_FUZZ_EXAMPLES`` sets the number of examples per test (``make fuzz`` runs 5000).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from iobundle import InputObserver, load_bundle
from iobundle.calls._dtypes import NAME_TO_DTYPE
from iobundle.errors import IobundleError

N_EXAMPLES = int(os.environ.get("IOBUNDLE_FUZZ_EXAMPLES", "200"))
FUZZ_SETTINGS = settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# --------------------------------------------------------------------------- seed bundles


class Simple(torch.nn.Module):
    def forward(self, x, d=None):
        return x * 2


class Nested(torch.nn.Module):
    def forward(self, x, pair=None, extra=None, *, scale: int = 1, mask=None):
        a, (b, c) = pair
        out = x.sum() + a.sum() + b.sum() + c.sum()
        return {"out": out.reshape(1), "both": (a, [b])}


def _make_simple(path: Path) -> None:
    model, observer = Simple(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(4, 3), d={"w": torch.ones(2)})
    observer.save(path)


def _make_nested(path: Path) -> None:
    model, observer = Nested(), InputObserver(value_if_missing={"mask": torch.ones(2, 5)})
    shared = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    with observer(model):
        model(torch.randn(2, 5), (torch.zeros(2, 1, dtype=torch.float16), [shared, torch.ones(3)]), scale=3)
        model(
            torch.randn(3, 5),
            (torch.zeros(3, 1, dtype=torch.float16), [shared, torch.ones(4)]),
            extra={"k": torch.ones(3, dtype=torch.bool), 0: [torch.ones(1, dtype=torch.bfloat16), None]},
            scale=3,
            mask=torch.zeros(3, 5),
        )
        model(torch.randn(4, 5), (torch.zeros(4, 1, dtype=torch.float16), [shared, torch.ones(5)]), scale=3)
    observer.save(path)


def _make_cache(path: Path) -> None:
    """A transformers DynamicCache input: registered node types, rebuilt through iobundle's registry."""
    from transformers import DynamicCache

    def cache(n: int) -> DynamicCache:
        c = DynamicCache()
        for layer in range(2):
            c.update(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4), layer)
        return c

    model, observer = Simple(), InputObserver()
    with observer(model):
        model(torch.randn(1, 3), d=cache(3))
        model(torch.randn(1, 1), d=cache(4))
    observer.save(path)


def _make_growing(path: Path) -> None:
    """Format 2 delta storage: a cache and a mask that grow by one position per call, stored as their new parts."""
    full_k, full_v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)

    class Growing(torch.nn.Module):
        def forward(self, x, past=None, mask=None):
            return {"x": x * 2, "past": [torch.cat([p, p[:, :, -1:]], dim=2) for p in past]}

    model, observer = Growing(), InputObserver()
    with observer(model, store_n_calls=4):
        for n in (2, 3, 4, 5):
            model(torch.randn(1, 3), past=[full_k[:, :, :n].clone(), full_v[:, :, :n].clone()], mask=torch.ones(1, n))
    observer.save(path)
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))  # format version 3: tensors listed per file
    rows = [row for f in manifest["files"].values() for row in f.get("tensors", {}).values()]
    assert sum(len(row) > 2 and row[2] is not None for row in rows) >= 6  # the seed holds extensions


def _make_journal(path: Path) -> None:
    """The growing seed as a killed stream leaves it: ``journal.jsonl``, no ``manifest.json``."""
    _make_growing(path)
    (path / "journal.jsonl").write_bytes(as_journal(json.loads((path / "manifest.json").read_text("utf-8"))))
    (path / "manifest.json").unlink()


def as_journal(manifest: Any) -> bytes:
    """``manifest`` as a journal: a head without calls, then one line per call with the tensors and files it adds."""
    if not isinstance(manifest, dict) or not all(
        isinstance(manifest.get(f), (list, dict)) for f in ("calls", "tensors", "files")
    ):
        return json.dumps({"journal": 1, **manifest} if isinstance(manifest, dict) else manifest).encode() + b"\n"
    tensors, files, calls = dict(manifest["tensors"]), dict(manifest["files"]), list(manifest["calls"])
    head = {"journal": 1, **manifest, "calls": [], "tensors": {}, "files": {}}
    for key in list(tensors):  # value_if_missing and anything no call names stays in the head
        entry = tensors[key]
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and entry["file"][-18:-12].isdigit()):
            head["tensors"][key] = tensors.pop(key)
    lines = [json.dumps(head)]
    for call in calls:
        index = call.get("index") if isinstance(call, dict) else None
        mine = f"calls/{index:06d}.safetensors" if isinstance(index, int) and not isinstance(index, bool) else None
        added = {
            k: tensors.pop(k) for k in [k for k, e in tensors.items() if isinstance(e, dict) and e.get("file") == mine]
        }
        lines.append(
            json.dumps({"call": call, "tensors": added, "files": {mine: files.pop(mine)} if mine in files else {}})
        )
    head["tensors"].update(tensors)
    head["files"].update(files)
    lines[0] = json.dumps(head)
    return "\n".join(lines).encode() + b"\n"


SEEDS: dict[str, Callable[[Path], None]] = {
    "simple": _make_simple,
    "nested": _make_nested,
    "growing": _make_growing,
    "journal": _make_journal,
}
if importlib.util.find_spec("transformers") is not None:  # a test dependency; imported only when seeding
    SEEDS["cache"] = _make_cache


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seeds")
    paths = {}
    for name, make in SEEDS.items():
        make(root / name)
        exercise(root / name, verify=True, strict=True)  # the seeds themselves are fine
        paths[name] = root / name
    return paths


# --------------------------------------------------------------------------- the code under test


def exercise(path: Path, *, verify: bool, strict: bool = False) -> None:
    """Load ``path`` and touch everything a user can; only IobundleError may come out (``strict``: nothing)."""
    steps: list[Callable[[], Any]] = []

    def step(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except IobundleError:
            if strict:
                raise

    try:
        b = load_bundle(path, verify=verify)
    except IobundleError as exc:
        if strict:
            raise
        _event(f"load: {type(exc).__name__}")
        return
    _event("load: ok")
    steps += [
        b.infer_dynamic_shapes,
        lambda: b.infer_dynamic_shapes(True, dim_names=True),
        b.infer_arguments,
        lambda: b.infer_arguments(as_args_kwargs=True),
    ]
    for i in range(b.num_obs()):
        steps += [lambda i=i: b.infer_arguments(i), lambda i=i: b.infer_arguments(i, flat=True)]
        steps.append(lambda i=i: b.outputs(i))
    steps += [lambda key=key: b.tensor(key) for key in b.manifest.tensors]
    steps.append(b.verify)
    if strict:
        assert b.verify() == []
    for fn in steps:
        step(fn)
    try:
        b.infer_arguments(0)
        for key in b.manifest.tensors:
            b.tensor(key)
        _event("replay: ok")
    except IobundleError as exc:
        _event(f"replay: {type(exc).__name__}")


def _event(text: str) -> None:
    """Count outcomes (``pytest --hypothesis-show-statistics``): the fuzzer must reach past loading."""
    try:
        event(text)
    except InvalidArgument:  # outside a hypothesis test (the seed check)
        pass


# --------------------------------------------------------------------------- JSON mutations

NODE_EXAMPLES: list[Any] = [
    {"kind": "tensor", "key": "t0"},
    {"kind": "tensor", "key": "t1"},
    {"kind": "none"},
    {"kind": "const", "value": 1},
    {"kind": "const", "value": "s"},
    {"kind": "list", "items": []},
    {"kind": "tuple", "items": [{"kind": "tensor", "key": "t2"}, {"kind": "none"}]},
    {"kind": "dict", "keys": ["a", 0], "items": [{"kind": "tensor", "key": "t0"}, {"kind": "none"}]},
    {"kind": "dict", "keys": [], "items": []},
    {"kind": "opaque", "type": "os.system", "reason": "x"},
    {"kind": "node", "type": "os.system", "version": 0, "context": "echo", "items": []},
    {
        "kind": "node",
        "type": "pytree:builtins.dict",
        "version": 0,
        "context": 3,
        "items": [{"kind": "tensor", "key": "t0"}],
    },
    {
        "kind": "node",
        "type": "pytree:builtins.dict",
        "version": 0,
        "context": ["a"],
        "items": [{"kind": "tensor", "key": "t0"}],
    },
    {
        "kind": "node",
        "type": "pytree:builtins.list",
        "version": 0,
        "context": None,
        "items": [{"kind": "tensor", "key": "t0"}],
    },
    {"kind": "node", "type": "pytree:builtins.tuple", "version": 0, "context": None, "items": []},
    {"kind": "node", "type": "pytree:collections.OrderedDict", "version": 0, "context": [1, 2], "items": []},
    {
        "kind": "node",
        "type": "pytree:collections.defaultdict",
        "version": 0,
        "context": ["x", ["a"]],
        "items": [{"kind": "none"}],
    },
    {"kind": "node", "type": "pytree:collections.deque", "version": 0, "context": -5, "items": []},
    {
        "kind": "node",
        "type": "transformers.DynamicCache",
        "version": 1,
        "context": 3,
        "items": [{"kind": "tensor", "key": "t0"}],
    },
]
SCALAR_EXAMPLES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63),
    0.0, 0.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf"),
    "", "t0", "t1", "t2", "t3", "t99", "x", "d", "pair", "extra", "scale", "mask", "forward",
    "calls/000000.safetensors", "calls/000001.safetensors", "calls/value_if_missing.safetensors",
    "../x", "/etc/passwd", "calls/../manifest.json", "manifest.json", "calls", ".", "a\x00b",
    "BOOL", "U8", "I64", "F16", "BF16", "F32", "F64", "C128", "F8_E4M3", "F8_E8M0", "U64",
    "ok", "failed", "incomplete", "tensor", "none", "const", "list", "tuple", "dict", "node", "opaque",
    "os.system", "pytree:os.system", "transformers.DynamicCache",
    "POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD",
    "0" * 64, "f" * 64, "iobundle",
]  # fmt: skip

scalars = st.one_of(
    st.sampled_from(SCALAR_EXAMPLES),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.one_of(
    st.sampled_from(NODE_EXAMPLES).map(copy.deepcopy),
    st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(
                st.sampled_from(["kind", "key", "items", "keys", "a", "0"]) | st.text(max_size=6), children, max_size=4
            ),
        ),
        max_leaves=8,
    ),
)
dict_keys = st.one_of(
    st.sampled_from(
        ["kind", "key", "items", "keys", "value", "type", "version", "context", "index", "status", "args", "kwargs",
         "cst_kwargs", "filled", "outputs", "latency", "file", "name", "dtype", "shape", "size", "sha256", "x", "d",
         "t0", "t5", "mask", "evil", "calls/000002.safetensors", "extends", "dim", "hash", "digest", "journal", "call"]
    ),
    st.text(max_size=8),
)  # fmt: skip


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``value``, the root included."""
    paths = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            paths += json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            paths += json_paths(v, (*prefix, i))
    return paths


def get_at(value: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        value = value[p]
    return value


def mutate_json(data: st.DataObject, doc: Any) -> Any:
    """Apply one random mutation to ``doc`` (modified in place where possible); return the new document."""
    paths = json_paths(doc)
    # Mostly the parts inference reads (the format marker and the producer have their own tests).
    focus = [
        p
        for p in paths
        if len(p) > 1 and p[0] in ("calls", "tensors", "signature", "value_if_missing", "files", "structures")
    ]
    if focus and data.draw(st.integers(0, 9), label="focus") > 0:
        path = data.draw(st.sampled_from(focus), label="path")
    else:
        path = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "insert", "copy", "copy", "copy"]), label="op")
    if op == "copy":  # a value taken elsewhere in the document: often valid there too, so it gets further
        new = copy.deepcopy(get_at(doc, data.draw(st.sampled_from(paths), label="from")))
    else:
        new = data.draw(json_values, label="value")
    if not path:
        return new if op in ("replace", "copy") else doc
    parent, last = get_at(doc, path[:-1]), path[-1]
    if op in ("replace", "copy"):
        parent[last] = new
    elif op == "delete":
        del parent[last]
    else:
        target = get_at(doc, path)
        if isinstance(target, dict):
            target[data.draw(dict_keys, label="key")] = new
        elif isinstance(target, list):
            target.insert(data.draw(st.integers(0, len(target)), label="at"), new)
        else:
            parent[last] = new
    return doc


# --------------------------------------------------------------------------- tensor file mutations


def split_tensor_file(raw: bytes) -> tuple[Any, bytes] | None:
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        return json.loads(raw[8 : 8 + n]), raw[8 + n :]
    except (struct.error, ValueError, RecursionError):
        return None


def mutate_file(data: st.DataObject, raw: bytes) -> bytes | None:
    """One random mutation of a tensor file's bytes; None deletes the file."""
    op = data.draw(
        st.sampled_from(["flip", "flip", "truncate", "extend", "header_len", "header", "header", "header", "delete"]),
        label="file op",
    )
    if op == "flip" and raw:
        pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
        return raw[:pos] + bytes([raw[pos] ^ data.draw(st.integers(1, 255), label="mask")]) + raw[pos + 1 :]
    if op == "truncate":
        return raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)), label="cut")]
    if op == "extend":
        return raw + data.draw(st.binary(min_size=1, max_size=64), label="tail")
    if op == "header_len":
        value = data.draw(
            st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, len(raw), len(raw) - 8, len(raw) - 7, 2**63])),
            label="header_len",
        )
        return struct.pack("<Q", value) + raw[8:]
    if op == "header":
        parts = split_tensor_file(raw)
        if parts is None:
            return raw
        header, body = parts
        header = mutate_json(data, header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text + body
    if op == "delete":
        return None
    return raw


def retype_tensor(data: st.DataObject, bundle: Path, manifest: Any) -> None:
    """Give one tensor another dtype and/or shape in both the manifest and its file, consistently.

    Single mutations rarely get past the consistency checks; this one does, so the code that
    uses the tensors (inference, stand-ins for absent inputs, dtype views) sees odd but valid data.
    """
    tensors = manifest.get("tensors") if isinstance(manifest, dict) else None
    if not isinstance(tensors, dict) or not tensors:
        return
    key = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
    entry = tensors[key]
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not isinstance(entry.get("name"), str):
        return
    try:
        if (
            not (bundle / entry["file"]).resolve().is_relative_to(bundle.resolve())
            or not (bundle / entry["file"]).is_file()
        ):
            return
    except (OSError, ValueError):
        return
    raw = (bundle / entry["file"]).read_bytes()
    parts = split_tensor_file(raw)
    if parts is None or not isinstance(parts[0], dict) or not isinstance(parts[0].get(entry.get("name")), dict):
        return
    header, body = parts
    info = header[entry["name"]]
    try:
        begin, end = info["data_offsets"]
        nbytes = end - begin
    except (KeyError, TypeError, ValueError):
        return
    dtype = data.draw(st.sampled_from(sorted(NAME_TO_DTYPE)), label="dtype")
    itemsize = NAME_TO_DTYPE[dtype].itemsize
    if nbytes % itemsize:
        return
    numel = nbytes // itemsize
    shapes = [[numel], [numel, 1], [1, numel], [], [0], [0, numel], [numel, 0, 2]]
    shapes += [[a, numel // a] for a in range(2, min(numel, 8) + 1) if numel % a == 0]
    shape = data.draw(st.sampled_from([s for s in shapes if _numel(s) == numel] + [[0, 5]]), label="shape")
    if _numel(shape) == 0:
        info["data_offsets"] = [begin, begin]
    info.update(dtype=dtype, shape=shape)
    entry.update(dtype=dtype, shape=shape)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + body
    (bundle / entry["file"]).write_bytes(new)
    files = manifest.get("files")
    if isinstance(files, dict) and isinstance(files.get(entry["file"]), dict):
        files[entry["file"]] = {"size": len(new), "hash": "xxh3-128", "digest": xxhash.xxh3_128_hexdigest(new)}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --------------------------------------------------------------------------- the fuzz tests


def apply_mutations(data: st.DataObject, bundle: Path) -> None:
    journal = not (bundle / "manifest.json").exists()
    # a journal: mutate the manifest it describes, then write it back as a journal
    manifest = schema_json(bundle) if journal else json.loads((bundle / "manifest.json").read_text("utf-8"))
    files = sorted(p.relative_to(bundle).as_posix() for p in (bundle / "calls").iterdir())
    n = data.draw(st.sampled_from([1, 1, 1, 2, 2, 3, 4]), label="n mutations")
    raw_edit = False
    for _ in range(n):
        where = data.draw(
            st.sampled_from(["manifest", "manifest", "manifest", "file", "tensor", "tensor", "manifest bytes"]),
            label="where",
        )
        if where == "tensor":
            retype_tensor(data, bundle, manifest)
        elif where == "manifest":
            manifest = mutate_json(data, manifest)
        elif where == "file":
            name = data.draw(st.sampled_from(files), label="file")
            path = bundle / name
            if not path.exists():
                continue
            new = mutate_file(data, path.read_bytes())
            if new is None:
                path.unlink()
                continue
            path.write_bytes(new)
            if data.draw(st.booleans(), label="resync") and isinstance(manifest, dict):
                entries = manifest.get("files")
                if isinstance(entries, dict) and isinstance(entries.get(name), dict):
                    entries[name] = {"size": len(new), "hash": "xxh3-128", "digest": xxhash.xxh3_128_hexdigest(new)}
        else:
            raw_edit = True
    text = as_journal(manifest) if journal else json.dumps(manifest, indent=1).encode("utf-8")
    if raw_edit and text:
        pos = data.draw(st.integers(0, len(text) - 1), label="manifest pos")
        op = data.draw(st.sampled_from(["flip", "truncate", "insert"]), label="manifest op")
        if op == "flip":
            text = text[:pos] + bytes([text[pos] ^ data.draw(st.integers(1, 255))]) + text[pos + 1 :]
        elif op == "truncate":
            text = text[:pos]
        else:
            text = (
                text[:pos]
                + data.draw(st.sampled_from([b"[", b"{", b"]", b"}", b",", b'"', b"\\", b"\xff", b"-", b"9" * 30]))
                + text[pos:]
            )
    (bundle / ("journal.jsonl" if journal else "manifest.json")).write_bytes(text)


def schema_json(bundle: Path) -> Any:
    """The manifest a journal describes, as JSON values."""
    from iobundle.schema import dump_manifest, load_journal

    return json.loads(dump_manifest(load_journal(bundle)))


@FUZZ_SETTINGS
@given(data=st.data(), seed=st.sampled_from(sorted(SEEDS)), verify=st.booleans())
def test_mutated_bundles_fail_cleanly(seeds, data, seed, verify):
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        shutil.copytree(seeds[seed], bundle)
        apply_mutations(data, bundle)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch may warn about odd dtypes; only exceptions matter
            exercise(bundle, verify=verify)


def test_seeds_are_valid(seeds):
    """The fuzzer starts from bundles that load and replay without any error."""
    assert set(seeds) >= {"simple", "nested", "growing", "journal"}
