"""Format versions 3 to 6: the compact layout of ``manifest.json`` and of the journal's lines.

Versions 1 and 2 write every call's whole trees and one object per tensor and per file; version 3
writes what repeats once: each distinct call structure (trees whose tensors are numbered slots), per
call the ``keys`` of its slots, and per file the rows of its tensors. Version 4 adds segments, 5 a
call's ``autocast``, 6 (written now) a segment's header region. ``docs/format.md`` is their
specification. In memory nothing changes: reading gives the same :class:`~iobundle.schema.Manifest`.

Reading (:mod:`iobundle.schema._compact_read`) checks everything versions 1 and 2 check (limits,
tensor ranks and sizes, extensions) and keeps compact rows (:mod:`iobundle.schema._deferred`); a
call's trees are built from its structure when first asked for: tensor-free parts of a structure
are built once and shared by the calls that have it, and the tensor nodes of a key are one object.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Annotated, Any, Final, Literal, Union

from pydantic import Field, JsonValue, StrictInt, StrictStr

from iobundle.errors import ManifestError
from iobundle.schema._manifest import (
    FORMAT,
    AutocastEntry,
    CallEntry,
    ConstNode,
    DictNode,
    DType,
    FileEntry,
    HashAlgorithm,
    ListNode,
    Manifest,
    MissingValueEntry,
    ModelEntry,
    Node,
    NoneNode,
    ObjectNode,
    OpaqueNode,
    Producer,
    Redaction,
    Scalar,
    SegmentRange,
    SignatureEntry,
    TensorEntry,
    TensorNode,
    TupleNode,
    _Model,
)
from iobundle.schema._structure import call_key

__all__ = [
    "COMPACT_VERSION",
    "COMPACT_VERSIONS",
    "written_version",
    "DEFAULT_HASH",
    "CallRecord",
    "CallStructure",
    "CompactManifest",
    "FileRecord",
    "call_record",
    "dump_manifest",
    "dumps",
    "file_records",
]

COMPACT_VERSION: Final = 6

MAX_SEGMENT_HEADER = 100 * 1024**2
"""Largest header region of a segment (version 6), the bound the safetensors library sets on a header."""
COMPACT_VERSIONS = (3, 4, 5, 6)
DEFAULT_HASH: Final = "xxh3-128"

# -- the models of the file (the JSON Schema, and the validation of everything but the bulk) -----


class SlotTensorNode(_Model):
    """A tensor of a structure: the call's ``keys[slot]``."""

    kind: Literal["tensor"] = "tensor"
    slot: Annotated[StrictInt, Field(ge=0)]


class SlotListNode(_Model):
    kind: Literal["list"] = "list"
    items: list[SlotNode]


class SlotTupleNode(_Model):
    kind: Literal["tuple"] = "tuple"
    items: list[SlotNode]


class SlotDictNode(_Model):
    kind: Literal["dict"] = "dict"
    keys: list[Union[StrictStr, StrictInt]]
    items: list[SlotNode]


class SlotObjectNode(_Model):
    kind: Literal["node"] = "node"
    type: str
    version: int
    context: JsonValue = None
    items: list[SlotNode]


SlotNode = Annotated[
    Union[SlotTensorNode, NoneNode, ConstNode, SlotListNode, SlotTupleNode, SlotDictNode, SlotObjectNode, OpaqueNode],
    Field(discriminator="kind"),
]
for _model in (SlotListNode, SlotTupleNode, SlotDictNode, SlotObjectNode):
    _model.model_rebuild()


class CallStructure(_Model):
    """What calls have in common besides their tensors: trees with tensor slots, constants, filled names."""

    args: list[SlotNode]
    kwargs: dict[str, SlotNode]
    cst_kwargs: dict[str, Scalar] = Field(default_factory=dict)
    filled: list[Union[StrictStr, StrictInt]] = Field(default_factory=list)
    outputs: SlotNode | None = None
    state: SlotNode | None = None


class CallRecord(_Model):
    """One call: its structure (by position) and the keys of its tensors, slot by slot."""

    index: Annotated[StrictInt, Field(ge=0)]
    structure: Annotated[StrictInt, Field(ge=0)]
    keys: list[StrictStr]
    status: Literal["ok", "failed", "incomplete"] = "ok"
    error: str | None = None
    latency: float | None = None
    autocast: list[AutocastEntry] | None = None
    """The ``torch.autocast`` state of the call (format version 5); absent when not under autocast."""


Shape = list[Annotated[StrictInt, Field(ge=0)]]
ExtendsPair = tuple[StrictStr, Annotated[StrictInt, Field(ge=0)]]


class TensorOptions(_Model):
    """What a tensor row says only when it is not the default."""

    device: str = "cpu"
    name: str | None = None


TensorRow = Union[
    tuple[DType, Shape],
    tuple[DType, Shape, Union[ExtendsPair, None]],
    tuple[DType, Shape, Union[ExtendsPair, None], TensorOptions],
]


class FileRecord(_Model):
    """A file: its size and digest (of the manifest's ``hash`` unless it names another), and its tensors.

    A segment (format version 4) gives ``ranges``, ``[call, start, length, digest]`` per call, instead of ``digest``.
    """

    size: Annotated[StrictInt, Field(ge=0)]
    hash: HashAlgorithm | None = None
    digest: Annotated[str, Field(pattern=r"^[0-9a-f]{32,64}$")] | None = None
    ranges: list[SegmentRange] | None = None
    tensors: dict[str, TensorRow] = Field(default_factory=dict)


class CompactManifest(_Model):
    """``manifest.json`` of format versions 3 to 6 (see the module docstring)."""

    format: Literal["iobundle"] = FORMAT
    format_version: Literal[3, 4, 5, 6] = COMPACT_VERSION
    producer: Producer
    signature: SignatureEntry
    value_if_missing: list[MissingValueEntry] = Field(default_factory=list)
    hash: HashAlgorithm = DEFAULT_HASH
    structures: list[CallStructure]
    calls: list[CallRecord]
    files: dict[str, FileRecord]
    model: ModelEntry | None = None
    redacted: Redaction | None = None


# -- writing ----------------------------------------------------------------------------------


def _slot_tree(node: Node, keys: list[str]) -> Any:
    """``node`` as plain JSON data, each tensor a slot; the keys met are appended to ``keys``."""
    kind = type(node)
    if kind is TensorNode:
        keys.append(node.key)  # type: ignore[union-attr]
        return {"kind": "tensor", "slot": len(keys) - 1}
    if kind is ListNode or kind is TupleNode:
        return {"kind": node.kind, "items": [_slot_tree(n, keys) for n in node.items]}  # type: ignore[union-attr]
    if kind is DictNode:
        return {"kind": "dict", "keys": list(node.keys), "items": [_slot_tree(n, keys) for n in node.items]}  # type: ignore[union-attr]
    if kind is ObjectNode:
        return {
            "kind": "node",
            "type": node.type,  # type: ignore[union-attr]
            "version": node.version,  # type: ignore[union-attr]
            "context": node.context,  # type: ignore[union-attr]
            "items": [_slot_tree(n, keys) for n in node.items],  # type: ignore[union-attr]
        }
    if kind is ConstNode:
        return {"kind": "const", "value": node.value}  # type: ignore[union-attr]
    if kind is OpaqueNode:
        return {"kind": "opaque", "type": node.type, "reason": node.reason}  # type: ignore[union-attr]
    return {"kind": "none"}


def call_record(call: CallEntry) -> tuple[dict[str, Any], dict[str, Any]]:
    """The structure of ``call`` and its record, as plain data (the record's ``structure`` left unset)."""
    keys: list[str] = []
    structure: dict[str, Any] = {
        "args": [_slot_tree(a, keys) for a in call.args],
        "kwargs": {k: _slot_tree(v, keys) for k, v in call.kwargs.items()},
    }
    if call.cst_kwargs:
        structure["cst_kwargs"] = call.cst_kwargs
    if call.filled:
        structure["filled"] = call.filled
    if call.outputs is not None:
        structure["outputs"] = _slot_tree(call.outputs, keys)
    if call.state is not None:
        structure["state"] = _slot_tree(call.state, keys)
    return structure, _record(call, keys)


def _record(call: CallEntry, keys: list[str]) -> dict[str, Any]:
    record: dict[str, Any] = {"index": call.index, "structure": None, "keys": keys}
    if call.status != "ok":
        record["status"] = call.status
    if call.error is not None:
        record["error"] = call.error
    if call.latency is not None:
        record["latency"] = call.latency
    if call.autocast is not None:
        record["autocast"] = [a.model_dump() for a in call.autocast]
    return record


def file_records(
    tensors: dict[str, TensorEntry],
    files: dict[str, FileEntry],
    *,
    default_hash: str | None,
    check_order: bool = True,
) -> dict[str, dict[str, Any]]:
    """The file records of ``files`` with the ``tensors`` they hold, in the order of ``tensors``.

    A record names its ``hash`` unless it is ``default_hash``. With ``check_order`` (a whole manifest),
    each extended tensor must come before its extension once grouped by file; a journal line's
    tensors extend tensors of earlier lines. A segment's tensors must come in the order of their
    ``offset`` (the file lists them in the order of their bytes).

    Raises:
        ManifestError: A tensor names a file missing from ``files``, extends a tensor that would be
            listed after it, or comes before a tensor stored earlier in its segment.
    """
    records: dict[str, dict[str, Any]] = {}
    listed: set[str] = set()
    ends: dict[str, int] = {}  # per segment, the offset of the tensor listed last
    for key, entry in tensors.items():
        record = records.get(entry.file)
        if record is None:
            file = files.get(entry.file)
            if file is None:
                raise ManifestError(f"tensors[{key!r}]: its file {entry.file!r} is not listed in files.")
            record = records[entry.file] = _file_record(file, default_hash)
            record["tensors"] = {}
        if "ranges" in record:
            if entry.offset is None or entry.offset < ends.get(entry.file, 0):
                raise ManifestError(
                    f"tensors[{key!r}]: offset {entry.offset} in segment {entry.file!r} comes before that of "
                    "a tensor listed earlier; list a segment's tensors in the order of their bytes."
                )
            ends[entry.file] = entry.offset
        row: list[Any] = [entry.dtype, entry.shape]
        ext = entry.extends
        if ext is not None:
            if check_order and ext.key not in listed:
                raise ManifestError(
                    f"tensors[{key!r}] extends {ext.key!r}, which format version 4 would list after it "
                    "(tensors are grouped by file). Write the base tensor's file first."
                )
            row.append([ext.key, ext.dim])
        if entry.device != "cpu" or entry.name != key:
            options: dict[str, str] = {}
            if entry.device != "cpu":
                options["device"] = entry.device
            if entry.name != key:
                options["name"] = entry.name
            row += [None, options] if ext is None else [options]
        record["tensors"][key] = row
        listed.add(key)
    for name, file in files.items():
        if name not in records:
            records[name] = _file_record(file, default_hash)
    return records


def _file_record(file: FileEntry, default_hash: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"size": file.size}
    if file.algorithm != default_hash:
        record["hash"] = file.algorithm
    if file.ranges is not None:
        record["ranges"] = [list(r) for r in file.ranges]
    else:
        record["digest"] = file.hexdigest
    return record


dumps = json.JSONEncoder(separators=(",", ":")).encode
"""Compact JSON text of plain data (one encoder: ``json.dumps`` with options builds one per call)."""


def written_version(manifest: Manifest) -> int:
    """The format version :func:`dump_manifest` writes ``manifest`` in: 6, or 5 for headerless segments."""
    headerless = any(f.ranges and f.ranges[0][1] == 0 for f in manifest.files.values())
    return 5 if headerless else COMPACT_VERSION


def dump_manifest(manifest: Manifest, *, one_line: bool = False) -> str:
    """``manifest`` as the text of ``manifest.json``, format version 6 whatever version it was read from.

    One line per field, structure, call and file.

    A manifest whose segments have no header region (read from version 4 or 5: their first range
    starts at byte 0) is written as version 5, which describes those files.
    With ``one_line`` the text has no line break (a journal head).

    Raises:
        ManifestError: The manifest cannot be written in format version 6 (see :func:`file_records`).
    """
    algorithms = [f.algorithm for f in manifest.files.values()]
    default_hash = max(set(algorithms), key=algorithms.count) if algorithms else DEFAULT_HASH
    numbers: dict[Hashable, int] = {}  # per structure (call_key), its position in "structures"
    structures: list[str] = []
    calls: list[str] = []
    for call in manifest.calls:
        keys: list[str] = []
        number = numbers.get(key := call_key(call, keys, outputs=True))
        if number is None:
            structure, record = call_record(call)
            number = numbers[key] = len(structures)
            structures.append(dumps(structure))
        else:
            record = _record(call, keys)
        record["structure"] = number
        calls.append(dumps(record))
    files = file_records(manifest.tensors, manifest.files, default_hash=default_hash)
    nl = "" if one_line else "\n"
    head = [
        f'"format":{dumps(manifest.format)}',
        f'"format_version":{written_version(manifest)}',
        f'"producer":{manifest.producer.model_dump_json()}',
        f'"signature":{manifest.signature.model_dump_json()}',
        f'"value_if_missing":[{",".join(v.model_dump_json() for v in manifest.value_if_missing)}]',
        f'"hash":{dumps(default_hash)}',
        f'"structures":[{nl}{("," + nl).join(structures)}]',
        f'"calls":[{nl}{("," + nl).join(calls)}]',
        f'"files":{{{nl}{("," + nl).join(f"{dumps(k)}:{dumps(v)}" for k, v in files.items())}}}',
    ]
    if manifest.model is not None:
        head.append(f'"model":{manifest.model.model_dump_json()}')
    if manifest.redacted is not None:
        head.append(f'"redacted":{manifest.redacted.model_dump_json()}')
    return "{" + ("," + nl).join(head) + "}" + nl
