"""The bundle format: pydantic models of ``manifest.json`` and their JSON I/O. Never imports torch.

Internal tier: ``__all__`` is the interface between iobundle's parts, not a public API.
"""

from __future__ import annotations

__all__ = [
    "JOURNAL_FILENAME",
    "MANIFEST_FILENAME",
    "MAX_EXTENSION_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MEMBER_NAME_RULE",
    "MISSING_VALUES_FILE",
    "SEGMENT_FILE_NAME",
    "CompactManifest",
    "FixedValues",
    "ProgramEntry",
    "ProgramIndex",
    "SizeCondition",
    "TensorInfo",
    "call_key",
    "collect_tensor_keys",
    "conditions_met",
    "deferred_calls",
    "deferred_keys",
    "deferred_shape",
    "call_file_name",
    "dump_manifest",
    "is_member_name",
    "is_writer_file",
    "journal_call_line",
    "journal_head_line",
    "load_journal",
    "load_manifest",
    "load_program_index",
    "manifest_trees",
    "parse_journal",
    "parse_manifest",
    "program_structures",
    "segment_file_name",
    "sizes_match",
    "values_match",
    "temporary_name",
    "tensor_rows",
    "tree_key",
    "write_manifest",
    "write_program_index",
]

from iobundle._store._names import (
    MEMBER_NAME_RULE,
    MISSING_VALUES_FILE,
    SEGMENT_FILE_NAME,
    call_file_name,
    is_member_name,
    is_writer_file,
    segment_file_name,
    temporary_name,
)
from iobundle.schema import _manifest
from iobundle.schema._compact import CompactManifest
from iobundle.schema._deferred import TensorInfo, deferred_calls, deferred_keys, deferred_shape, tensor_rows
from iobundle.schema._io import (
    JOURNAL_FILENAME,
    MANIFEST_FILENAME,
    MAX_EXTENSION_DEPTH,
    MAX_MANIFEST_BYTES,
    dump_manifest,
    manifest_trees,
    parse_manifest,
    write_manifest,
)
from iobundle.schema._journal import journal_call_line, journal_head_line, load_journal, parse_journal
from iobundle.schema._load import load_manifest
from iobundle.schema._manifest import *  # noqa: F403 (the models of manifest.json, listed in _manifest.__all__)
from iobundle.schema._program_index import (
    FixedValues,
    ProgramEntry,
    ProgramIndex,
    SizeCondition,
    conditions_met,
    load_program_index,
    program_structures,
    sizes_match,
    values_match,
    write_program_index,
)
from iobundle.schema._structure import call_key, collect_tensor_keys, tree_key

__all__ += _manifest.__all__  # the models of manifest.json
