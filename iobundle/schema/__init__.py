"""The bundle format: pydantic models of ``manifest.json`` and their JSON I/O. Never imports torch."""

from __future__ import annotations

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILENAME",
    "PROGRAM_INDEX_FORMAT",
    "MAX_MANIFEST_BYTES",
    "SUPPORTED_FORMAT_VERSIONS",
    "CallEntry",
    "ConstNode",
    "DictNode",
    "FileEntry",
    "ListNode",
    "Manifest",
    "MissingValueEntry",
    "ModelEntry",
    "Node",
    "NoneNode",
    "ObjectNode",
    "OpaqueNode",
    "ParameterEntry",
    "Producer",
    "ProgramEntry",
    "ProgramIndex",
    "Redaction",
    "SignatureEntry",
    "TensorEntry",
    "TensorNode",
    "TupleNode",
    "dump_manifest",
    "load_manifest",
    "load_program_index",
    "manifest_json_schema",
    "parse_manifest",
    "write_manifest",
    "write_program_index",
]

import json

from iobundle.schema._io import (
    MANIFEST_FILENAME,
    MAX_MANIFEST_BYTES,
    dump_manifest,
    load_manifest,
    parse_manifest,
    write_manifest,
)
from iobundle.schema._manifest import (
    FORMAT,
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    CallEntry,
    ConstNode,
    DictNode,
    FileEntry,
    ListNode,
    Manifest,
    MissingValueEntry,
    ModelEntry,
    Node,
    NoneNode,
    ObjectNode,
    OpaqueNode,
    ParameterEntry,
    Producer,
    Redaction,
    SignatureEntry,
    TensorEntry,
    TensorNode,
    TupleNode,
)
from iobundle.schema._programs import (
    PROGRAM_INDEX_FORMAT,
    ProgramEntry,
    ProgramIndex,
    load_program_index,
    write_program_index,
)


def manifest_json_schema() -> str:
    """Return the JSON Schema of ``manifest.json``, as shipped in ``iobundle/schema/manifest.schema.json``."""
    schema = Manifest.model_json_schema()
    schema["title"] = f"iobundle manifest, format_version {FORMAT_VERSION}"
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"
