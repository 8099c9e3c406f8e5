"""Reading a compact manifest (format versions 3 to 6, :mod:`iobundle.schema._compact`): the bulk
(``calls`` and ``files``) checked field by field with the rules of versions 1 and 2, and the
in-memory models built from it without validating them a second time.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import pydantic
from pydantic import BaseModel, TypeAdapter

from iobundle.errors import ManifestError, UnsafeBundleError
from iobundle.schema._compact import (
    COMPACT_VERSION,
    MAX_SEGMENT_HEADER,
    CallStructure,
    CompactManifest,
    SlotDictNode,
    SlotListNode,
    SlotObjectNode,
    SlotTensorNode,
    SlotTupleNode,
)
from iobundle.schema._deferred import (
    CompactStructure,
    CompactTables,
    DeferredCall,
    TensorInfo,
    _fields_set,
    _made,
    deferred_call,
    deferred_manifest,
)
from iobundle.schema._manifest import (
    DTYPE_ITEMSIZES,
    DTYPES,
    FORMAT,
    HASH_ALGORITHMS,
    AutocastEntry,
    DictNode,
    FileEntry,
    ListNode,
    Manifest,
    Node,
    ObjectNode,
    TensorNode,
    TupleNode,
    duplicate_call_index,
)

__all__ = ["Reader", "check_tree_list", "expand_compact"]

# -- fast construction of validated models ----------------------------------------------------

_NODE = TypeAdapter(Node)
_REAL: dict[type[BaseModel], type[BaseModel]] = {
    SlotListNode: ListNode,
    SlotTupleNode: TupleNode,
    SlotDictNode: DictNode,
    SlotObjectNode: ObjectNode,
}
_CALL_FIELDS = frozenset({"index", "structure", "keys", "status", "error", "latency", "autocast"})
_AUTOCAST = TypeAdapter(list[AutocastEntry])
_FILE_FIELDS = frozenset({"size", "hash", "digest", "ranges", "tensors"})
_OPTION_FIELDS = frozenset({"device", "name"})
_STATUSES = frozenset({"ok", "failed", "incomplete"})
_DTYPES = frozenset(DTYPES)
_INT_ONLY = frozenset({int})
_STR_ONLY = frozenset({str})
_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in set(HASH_ALGORITHMS.values())}

# -- reading ----------------------------------------------------------------------------------

Builder = Callable[[list[TensorNode]], Any]


class Reader:
    """Checks and expands one compact manifest; errors name ``source`` and the field."""

    def __init__(self, source: str, max_calls: int, max_tensors: int, max_rank: int, max_elements: int,
                 max_chain: int) -> None:  # fmt: skip
        self.source = source
        self.max_calls, self.max_tensors, self.max_rank = max_calls, max_tensors, max_rank
        self.max_elements, self.max_chain = max_elements, max_chain

    def too_many(self, field: str, count: int, limit: int) -> None:
        raise UnsafeBundleError(
            f"{self.source}: {field} holds {count} entries, over the limit of {limit}. The file is corrupt or hostile."
        )

    def fail(self, where: str, problem: str, *, unsafe: bool = False) -> NoReturn:
        cls = UnsafeBundleError if unsafe else ManifestError
        hint = " The file is corrupt or hostile." if unsafe else ""
        raise cls(f"{self.source}: {where}: {problem}.{hint}")

    # -- structures

    def compile(self, node: Any, where: str, counter: list[int]) -> tuple[Builder | None, Any]:
        """A builder of ``node``'s tree from a call's tensor nodes (by slot), or (None, the tree) without tensors."""
        if isinstance(node, SlotTensorNode):
            if node.slot != counter[0]:
                self.fail(where, f"slot {node.slot} where slot {counter[0]} comes (slots are numbered in order)")
            counter[0] += 1
            return operator.itemgetter(node.slot), None
        if isinstance(node, SlotDictNode):
            if len(node.keys) != len(node.items):
                self.fail(where, f"a dict with {len(node.keys)} keys but {len(node.items)} items")
            if len(set(node.keys)) != len(node.keys):
                self.fail(where, f"a dict with a repeated key: {node.keys!r}")
        if not isinstance(node, (SlotListNode, SlotTupleNode, SlotDictNode, SlotObjectNode)):
            return None, node  # none, const, opaque: the same models as in a call's tree
        parts = [self.compile(n, f"{where}.items[{j}]", counter) for j, n in enumerate(node.items)]
        if all(b is None for b, _ in parts):
            return None, _NODE.validate_python(node.model_dump())
        fields = node.model_dump(exclude={"items"})
        cls = _REAL[type(node)]
        fields_set = _fields_set(cls)
        new, setattr_ = object.__new__, object.__setattr__

        def build(nodes: list[TensorNode]) -> Any:  # _made, inline: one call per container of a call's trees
            obj = new(cls)
            setattr_(obj, "__dict__", {**fields, "items": [c if b is None else b(nodes) for b, c in parts]})
            setattr_(obj, "__pydantic_fields_set__", fields_set)
            setattr_(obj, "__pydantic_extra__", None)
            setattr_(obj, "__pydantic_private__", None)
            return obj

        return build, None

    def structure(self, s: CallStructure, where: str) -> CompactStructure:
        counter = [0]
        args = [self.compile(a, f"{where}.args[{j}]", counter) for j, a in enumerate(s.args)]
        kwargs = [(k, *self.compile(v, f"{where}.kwargs[{k!r}]", counter)) for k, v in s.kwargs.items()]
        n_inputs = counter[0]
        named = (("outputs", s.outputs), ("state", s.state))
        trees = [None if t is None else self.compile(t, f"{where}.{n}", counter) for n, t in named]
        cst, filled = s.cst_kwargs, s.filled

        def build(nodes: list[TensorNode]) -> tuple[Any, ...]:
            return (
                [c if b is None else b(nodes) for b, c in args],
                {k: c if b is None else b(nodes) for k, b, c in kwargs},
                dict(cst),
                list(filled),
                *(None if t is None else (t[1] if t[0] is None else t[0](nodes)) for t in trees),
            )

        return CompactStructure(counter[0], n_inputs, build)

    # -- the bulk: calls and files

    def autocast(self, raw: Any, where: str, version: int) -> list[AutocastEntry]:
        """A call's ``autocast`` entries, checked (a format-version-5 field)."""
        if version < 5:
            self.fail(where, f"autocast is a format_version 5 field; this manifest says {version}")
        try:
            return _AUTOCAST.validate_python(raw)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
            self.fail(f"{where}{at}", first["msg"])
            raise  # unreachable: fail raises

    def calls(self, raw: Any, tables: CompactTables, version: int = COMPACT_VERSION) -> list[DeferredCall]:
        if not isinstance(raw, list):
            self.fail("calls", f"expected a list, found {type(raw).__name__}")
        out = []
        structures = tables.structures
        n_structures = len(structures)
        call_fields = _CALL_FIELDS
        seen: dict[int, int] = {}
        make = deferred_call
        for i, rec in enumerate(raw):
            if type(rec) is not dict:
                self.fail(f"calls[{i}]", f"expected an object, found {type(rec).__name__}")
            if not rec.keys() <= call_fields:
                self.fail(f"calls[{i}]", f"unknown field {sorted(map(str, rec.keys() - call_fields))[0]!r}")
            index, s, keys = rec.get("index"), rec.get("structure"), rec.get("keys")
            if type(index) is not int or index < 0:
                self.fail(f"calls[{i}].index", f"expected an integer >= 0, found {_short(index)}")
            first = seen.setdefault(index, i)
            if first != i:
                self.fail(f"calls[{i}].index", duplicate_call_index(index, first))
            if type(s) is not int or not 0 <= s < n_structures:
                self.fail(f"calls[{i}].structure", f"{_short(s)} is not one of the {n_structures} structures")
            structure = structures[s]
            if type(keys) is not list or len(keys) != structure.n_slots:
                found = f"{len(keys)} keys" if type(keys) is list else _short(keys)
                self.fail(f"calls[{i}].keys", f"structure {s} has {structure.n_slots} tensor slots, found {found}")
            if not set(map(type, keys)) <= _STR_ONLY:
                bad = next(k for k in keys if type(k) is not str)
                self.fail(f"calls[{i}].keys", f"a key must be a string, found {_short(bad)}")
            status, error, latency = rec.get("status", "ok"), rec.get("error"), rec.get("latency")
            if type(status) is not str or status not in _STATUSES:
                self.fail(f"calls[{i}].status", f"{_short(status)} is not one of {sorted(_STATUSES)}")
            if error is not None and type(error) is not str:
                self.fail(f"calls[{i}].error", f"expected a string or null, found {_short(error)}")
            if latency is not None and type(latency) is not float:
                if type(latency) is not int:
                    self.fail(f"calls[{i}].latency", f"expected a number or null, found {_short(latency)}")
                latency = float(latency)
            autocast = rec.get("autocast")
            if autocast is not None:
                autocast = self.autocast(autocast, f"calls[{i}].autocast", version)
            values = {"index": index, "status": status, "error": error, "latency": latency, "autocast": autocast}
            out.append(make(tables, structure, keys, values))
        return out

    def ranges(self, raw: Any, size: int, algorithm: str, where: str, version: int) -> list[tuple[int, int, int, str]]:
        """A segment's ranges, checked: back to back to ``size``, each with a digest of ``algorithm``.

        They start at byte 0 (version 4, 5), or at the data start past the header region (version 6).
        """
        if type(raw) is not list:
            self.fail(f"{where}.ranges", f"expected a list of [call, start, length, digest], found {_short(raw)}")
        n, pattern = HASH_ALGORITHMS[algorithm], _HEX[HASH_ALGORITHMS[algorithm]]
        out: list[tuple[int, int, int, str]] = []
        end = 0
        if version >= 6 and raw and type(raw[0]) is list and len(raw[0]) > 1 and type(raw[0][1]) is int:
            end = raw[0][1]
            if not 8 < end <= 8 + MAX_SEGMENT_HEADER:
                self.fail(f"{where}.ranges[0]", f"the data starts at byte {end}, not past a header region of "
                          f"1 to {MAX_SEGMENT_HEADER} bytes", unsafe=True)  # fmt: skip
        for j, r in enumerate(raw):
            at = f"{where}.ranges[{j}]"
            if type(r) is not list or len(r) != 4 or any(type(v) is not int or v < 0 for v in r[:3]):
                self.fail(at, f"expected [call, start, length, digest] (integers >= 0, a string), found {_short(r)}")
            if r[1] != end:
                self.fail(at, f"call {r[0]}'s range starts at byte {r[1]}, where the range before ends at {end} "
                          "(ranges lie back to back, never overlapping)", unsafe=True)  # fmt: skip
            if type(r[3]) is not str or not pattern.fullmatch(r[3]):
                self.fail(at, f"expected {n} lowercase hex digits (a {algorithm} digest), found {_short(r[3])}")
            end = r[1] + r[2]
            out.append((r[0], r[1], r[2], r[3]))
        if end != size:
            self.fail(f"{where}.ranges", f"end at byte {end}, but size is {size}", unsafe=True)
        return out

    def files(self, raw: Any, default_hash: str, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(raw, dict):
            self.fail("files", f"expected an object, found {type(raw).__name__}")
        count = sum(len(r["tensors"]) for r in raw.values() if type(r) is dict and type(r.get("tensors")) is dict)
        if count > self.max_tensors:
            self.too_many("tensors", count, self.max_tensors)
        files: dict[str, Any] = {}
        tensors: dict[str, TensorInfo] = {}
        depths: dict[str, int] = {}  # per extension, the length of its chain (other tensors: 0)
        max_chain, max_rank, max_elements = self.max_chain, self.max_rank, self.max_elements
        prod = math.prod
        int_only = _INT_ONLY
        row_of, info = tuple.__new__, TensorInfo  # a namedtuple's own __new__ is Python code: one call per row
        dtypes = _DTYPES
        file_fields, hex_of, algorithms = _FILE_FIELDS, _HEX, HASH_ALGORITHMS
        for name, rec in raw.items():
            if type(rec) is not dict:
                self.fail(f"files[{name!r}]", f"expected an object, found {type(rec).__name__}")
            if not rec.keys() <= file_fields:
                self.fail(f"files[{name!r}]", f"unknown field {sorted(rec.keys() - file_fields)[0]!r}")
            size, algorithm, digest = rec.get("size"), rec.get("hash", default_hash), rec.get("digest")
            if type(size) is not int or size < 0:
                self.fail(f"files[{name!r}].size", f"expected an integer >= 0, found {_short(size)}")
            if type(algorithm) is not str or algorithm not in algorithms:
                self.fail(f"files[{name!r}].hash", f"{_short(algorithm)} is not one of {sorted(algorithms)}")
            ranges = None
            if "ranges" in rec:
                where = f"files[{name!r}]"
                if version < 4:
                    self.fail(f"{where}.ranges", f"segments are a format_version 4 field; this manifest says {version}")
                if digest is not None:
                    self.fail(where, "a segment gives a digest per range, not a digest")
                ranges = self.ranges(rec["ranges"], size, algorithm, where, version)
                ends = [start + length for _, start, length, _ in ranges]
                n_ends = len(ends)
                position, current = ranges[0][1] if ranges else 0, 0  # the next tensor's offset, the range it starts in
            elif type(digest) is not str or not hex_of[algorithms[algorithm]].fullmatch(digest):
                self.fail(
                    f"files[{name!r}].digest",
                    f"expected {algorithms[algorithm]} lowercase hex digits (a {algorithm} digest), "
                    f"found {_short(digest)}",
                )
            files[name] = _made(
                FileEntry, {"size": size, "sha256": None, "hash": algorithm, "digest": digest, "ranges": ranges}
            )
            rows = rec.get("tensors", {})
            if type(rows) is not dict:
                self.fail(f"files[{name!r}].tensors", f"expected an object, found {type(rows).__name__}")
            for key, row in rows.items():
                if key in tensors:
                    self.fail(f"files[{name!r}].tensors[{key!r}]", "a tensor listed a second time")
                n = len(row) if type(row) is list else 0
                options = None
                if n == 2:
                    dtype, shape = row
                    ext = None
                elif n == 3:
                    dtype, shape, ext = row
                elif n == 4:
                    dtype, shape, ext, options = row
                else:
                    self.fail(
                        f"files[{name!r}].tensors[{key!r}]",
                        f"expected [dtype, shape, extends?, options?], found {_short(row)}",
                    )
                if type(dtype) is not str or dtype not in dtypes:
                    self.fail(
                        f"files[{name!r}].tensors[{key!r}]", f"dtype {_short(dtype)} is not one of {', '.join(DTYPES)}"
                    )
                if type(shape) is not list:
                    self.fail(
                        f"files[{name!r}].tensors[{key!r}]", f"shape must be a list of integers, found {_short(shape)}"
                    )
                dims = tuple(shape)
                # the checks of self.shape, inline for a good shape; self.shape says what is wrong with another
                if not (
                    set(map(type, dims)) <= int_only  # not bool nor float: True == 1 and 2.0 == 2
                    and len(dims) <= max_rank
                    and (not dims or min(dims) >= 0)
                    and ((count := prod(dims)) or prod(d or 1 for d in dims)) <= max_elements
                ):
                    self.shape(dims, f"files[{name!r}].tensors[{key!r}]")
                extends = None
                if ext is not None:
                    if type(ext) is list and len(ext) == 2 and type(ext[0]) is str and type(ext[1]) is int:
                        base_key, dim = ext  # the common case, checked inline (a negative dim: below)
                    else:
                        base_key, dim = self.extension(ext, f"files[{name!r}].tensors[{key!r}]")
                    if dim < 0:
                        self.extension(ext, f"files[{name!r}].tensors[{key!r}]")
                    base = tensors.get(base_key)
                    if base is None:
                        problem = "is not listed before it" if base_key != key else "is itself"
                        self.fail(
                            f"files[{name!r}].tensors[{key!r}].extends",
                            f"tensor {base_key!r} {problem}; an extended "
                            "tensor must come earlier (in an earlier file or earlier in this one)",
                            unsafe=True,
                        )
                    had = base[3]  # the checks of self.compatible, inline for a good extension
                    if not (
                        base[2] == dtype
                        and len(had) == len(dims) > dim
                        and had[dim] <= dims[dim]
                        and had[:dim] == dims[:dim]
                        and had[dim + 1 :] == dims[dim + 1 :]
                    ):
                        self.compatible(
                            base_key, (base[2], had), dtype, dims, dim, f"files[{name!r}].tensors[{key!r}].extends"
                        )
                    depth = depths[key] = depths.get(base_key, 0) + 1
                    if depth > max_chain:
                        self.fail(
                            f"files[{name!r}].tensors[{key!r}].extends",
                            f"a chain of more than {max_chain} extensions (MAX_EXTENSION_DEPTH)",
                            unsafe=True,
                        )
                    extends = (base_key, dim)
                if options is None:
                    device, in_file = "cpu", key
                else:
                    device, in_file = self.options(options, key, f"files[{name!r}].tensors[{key!r}]")
                offset = None
                if extends is not None and count:  # stored: the part past the base along dim
                    count = count // dims[dim] * (dims[dim] - had[dim])
                nbytes = count * DTYPE_ITEMSIZES[dtype]
                if ranges is None and nbytes > size:  # what load_bundle checked for manifests of tensor entries
                    self.fail(f"files[{name!r}].tensors[{key!r}]", f"{dtype} {list(dims)} needs {nbytes} bytes but "
                              f"its file {name!r} has {size}", unsafe=True)  # fmt: skip
                elif ranges is not None:
                    if in_file != key:
                        self.fail(f"files[{name!r}].tensors[{key!r}]", "a segment's tensor has no name but its key")
                    if nbytes:
                        while current < n_ends and position >= ends[current]:
                            current += 1
                        if current == n_ends or position + nbytes > ends[current]:
                            self.fail(
                                f"files[{name!r}].tensors[{key!r}]",
                                f"its {nbytes} bytes at offset {position} do not lie inside one range "
                                "(each tensor is stored inside the range of the call that added it)",
                                unsafe=True,
                            )
                    offset = position
                    position += nbytes
                tensors[key] = row_of(info, (name, in_file, dtype, dims, device, extends, offset))
            if ranges is not None and position != size:
                self.fail(f"files[{name!r}].tensors", f"the tensors fill {position} bytes of the {size} its ranges hold",
                          unsafe=True)  # fmt: skip
        return files, tensors

    def shape(self, dims: tuple[Any, ...], where: str) -> None:
        """Check the shape of the tensor at ``where``: integers >= 0, rank and element count within the limits."""
        hint = "The file is corrupt or hostile."
        if len(dims) > self.max_rank:
            raise UnsafeBundleError(
                f"{self.source}: {where}.shape has {len(dims)} dimensions, over the limit of {self.max_rank}. {hint}"
            )
        count = 1
        for d in dims:
            if type(d) is not int or d < 0:
                self.fail(f"{where}.shape", f"a dimension must be an integer >= 0, found {_short(d)}")
            count *= max(d, 1)
            if count > self.max_elements:
                raise UnsafeBundleError(f"{self.source}: {where}.shape {list(dims)} is too large "
                                        f"(more than {self.max_elements} elements). {hint}")  # fmt: skip

    def extension(self, ext: Any, where: str) -> tuple[str, int]:
        if type(ext) is not list or len(ext) != 2 or type(ext[0]) is not str or type(ext[1]) is not int or ext[1] < 0:
            self.fail(
                f"{where}.extends", f"expected [key, dim] (a string, an integer >= 0) or null, found {_short(ext)}"
            )
        return ext[0], ext[1]

    def compatible(self, base_key: str, base: tuple[str, tuple[int, ...]], dtype: str, dims: tuple[int, ...],
                   dim: int, at: str) -> None:  # fmt: skip
        """Check that ``dtype`` ``dims`` (the tensor whose ``extends`` is ``at``) extends ``base`` along ``dim``."""
        if base[0] != dtype or len(base[1]) != len(dims) or dim >= len(dims):
            self.fail(at, f"{dtype} {list(dims)} cannot extend {base_key!r} ({base[0]} {list(base[1])}) along dim {dim}",
                      unsafe=True)  # fmt: skip
        if any((b > s) if d == dim else (b != s) for d, (b, s) in enumerate(zip(base[1], dims))):
            self.fail(at, f"shape {list(dims)} does not extend {list(base[1])} (of {base_key!r}) along dim {dim}: "
                      "the other dimensions must be equal and this one at least as long", unsafe=True)  # fmt: skip

    def options(self, options: Any, key: str, where: str) -> tuple[str, str]:
        if type(options) is not dict or not options.keys() <= _OPTION_FIELDS:
            self.fail(where, f"options must be an object of device and name, found {_short(options)}")
        device, name = options.get("device", "cpu"), options.get("name", key)
        if type(device) is not str or type(name) is not str:
            self.fail(where, f"device and name must be strings, found {_short(options)}")
        return device, name


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return "(a value nested too deep to show)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_tree_list(trees: Iterable[tuple[str, Node]], source: str) -> None:
    """Every dict node has as many keys as items, and no key twice."""
    stack = list(trees)[::-1]
    while stack:
        where, node = stack.pop()
        if isinstance(node, DictNode):
            if len(node.keys) != len(node.items):
                raise ManifestError(
                    f"{source}: {where} is a dict with {len(node.keys)} keys but {len(node.items)} items."
                )
            if len(set(node.keys)) != len(node.keys):
                raise ManifestError(f"{source}: {where} is a dict with a repeated key: {node.keys!r}.")
        if isinstance(node, (ListNode, TupleNode, DictNode, ObjectNode)):
            stack.extend((f"{where}.items[{j}]", n) for j, n in reversed(list(enumerate(node.items))))


def expand_compact(raw: dict[str, Any], parsed: CompactManifest, reader: Reader) -> Manifest:
    """Check the bulk (``calls`` and ``files``) of a format-version-3 to 6 manifest parsed from JSON, whose other
    fields :class:`CompactManifest` accepted as ``parsed``, and build the in-memory :class:`Manifest`.

    Raises:
        ManifestError: Something does not match the format (the message names the field).
        UnsafeBundleError: A limit is exceeded.
    """
    source, calls_raw, files_raw = reader.source, raw.get("calls"), raw.get("files")
    for field in ("calls", "files"):
        if field not in raw:
            raise ManifestError(f"{source}: does not match the iobundle format:\n  {field}: Field required")
    if isinstance(calls_raw, list) and len(calls_raw) > reader.max_calls:
        reader.too_many("calls", len(calls_raw), reader.max_calls)
    if len(parsed.structures) > reader.max_calls:
        reader.too_many("structures", len(parsed.structures), reader.max_calls)
    if parsed.model is not None:
        for name, file in parsed.model.files.items():
            if file.ranges is not None:
                reader.fail(f"model.files[{name!r}].ranges", "the stored model's files are not segments")
    check_tree_list([(f"value_if_missing[{i}].value", e.value) for i, e in enumerate(parsed.value_if_missing)], source)
    structures = [reader.structure(s, f"structures[{i}]") for i, s in enumerate(parsed.structures)]
    files, tensors = reader.files(files_raw, parsed.hash, parsed.format_version)
    tables = CompactTables(structures, tensors)
    calls = reader.calls(calls_raw, tables, parsed.format_version)
    return deferred_manifest(
        {
            "format": FORMAT,
            "format_version": parsed.format_version,
            "producer": parsed.producer,
            "signature": parsed.signature,
            "value_if_missing": parsed.value_if_missing,
            "files": files,
            "model": parsed.model,
            "redacted": parsed.redacted,
        },
        tables,
        calls,
    )
