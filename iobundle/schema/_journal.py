"""``journal.jsonl``: the per-call journal of a bundle being streamed (format versions 2 to 6).

While a stream is open, each call costs one appended line, not a rewrite of the whole manifest;
``manifest.json`` is written once, when the stream closes, and the journal removed. A bundle whose
writer was killed has a journal and no manifest: :func:`load_journal` rebuilds the manifest from it,
with every call whose line is complete (``docs/format.md``, "The journal", specifies the lines).

Line 1, the head, is a manifest plus ``"journal": 1``; its ``format_version`` says how the other
lines read. From version 3 each line is ``{"call": <call record>, "files": {<name>: <file record>}}``,
the record's ``structure`` written out (reading numbers the distinct structures in the order met); a
segment named again adds a range that must start where the segment ended, so the bytes a killed
writer left past the last complete line are never part of the bundle. In version 2 a line is
``{"call": <call entry>, "tensors": {...}, "files": {...}}``.

A last line without its ``\\n`` was cut short by the writer's death: it is ignored. Everything else
is validated as ``manifest.json`` is (:func:`iobundle.schema.validate_manifest`), limits included;
the journal as a whole is at most :data:`~iobundle.schema.MAX_MANIFEST_BYTES`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from iobundle._collector import collector_paused
from iobundle.errors import ManifestError, UnsafeBundleError
from iobundle.schema._compact import COMPACT_VERSIONS, call_record, dump_manifest, dumps, file_records
from iobundle.schema._deferred import tensor_rows, with_fields
from iobundle.schema._io import JOURNAL_FILENAME, MAX_CALLS, read_member, validate_manifest
from iobundle.schema._manifest import CallEntry, FileEntry, Manifest, TensorEntry

__all__ = ["JOURNAL_VERSION", "journal_call_line", "journal_head_line", "load_journal", "parse_journal"]

JOURNAL_VERSION = 1


def journal_head_line(manifest: Manifest) -> bytes:
    """The first line of a journal: ``manifest`` (what is written so far) marked as a journal head.

    Raises:
        ManifestError: The manifest cannot be written (see :func:`iobundle.schema.dump_manifest`).
    """
    text = dump_manifest(manifest, one_line=True)
    return b'{"journal":1,' + text[1:].encode("utf-8") + b"\n"


def journal_call_line(call: CallEntry, tensors: dict[str, TensorEntry], files: dict[str, FileEntry]) -> bytes:
    """The line of one call: its record (with its structure) and the files it added, with their ``tensors``.

    Raises:
        ManifestError: A tensor names a file missing from ``files``.
    """
    structure, record = call_record(call)
    record["structure"] = structure
    records = file_records(tensors, files, default_hash=None, check_order=False)
    return dumps({"call": record, "files": records}).encode("utf-8") + b"\n"


def _lines(data: bytes) -> Iterable[bytes]:
    start = 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            return  # the rest, if any, is a line cut short: ignored
        yield data[start:end]
        start = end + 1


def parse_journal(data: bytes, *, source: str = JOURNAL_FILENAME) -> Manifest:
    """Rebuild the manifest a journal describes.

    Raises:
        ManifestError: The head or a complete line is not what the writer writes.
        UnsupportedFormatVersionError, UnsafeBundleError: as for ``manifest.json``.
    """
    with collector_paused():
        return _parse_journal(data, source)


def _parse_journal(data: bytes, source: str) -> Manifest:
    lines = _lines(data)
    head_line = next(iter(lines), None)
    if head_line is None:
        raise ManifestError(f"{source}: no complete first line; the writer died before the journal was started.")
    head = _json(head_line, source, 1)
    if not isinstance(head, dict) or head.pop("journal", None) != JOURNAL_VERSION:
        raise ManifestError(f'{source}: line 1 is not a journal head (no "journal": {JOURNAL_VERSION}).')
    version = head.get("format_version")
    if type(version) is int and version in COMPACT_VERSIONS:
        return _parse_compact(head, lines, source)
    if type(version) is not int or version not in (1, 2):
        return validate_manifest(head, source=source)  # refuses the format or version, naming what it found
    calls, tensors, files = head.get("calls"), head.get("tensors"), head.get("files")
    if not isinstance(calls, list) or not isinstance(tensors, dict) or not isinstance(files, dict):
        raise ManifestError(f"{source}: line 1 lacks the calls, tensors and files of a manifest.")
    for number, record in _records(lines, source, calls, "call", "tensors", "files"):
        for field, table in (("tensors", tensors), ("files", files)):
            for key, value in record[field].items():
                if key in table:
                    raise ManifestError(f"{source}: line {number} adds {field}[{key!r}] a second time.")
                table[key] = value
        calls.append(record["call"])
    return _with_devices(validate_manifest(head, source=source))


def _records(lines: Iterable[bytes], source: str, calls: list[Any], *fields: str) -> Iterator[tuple[int, Any]]:
    """Each line after the head, numbered: an object of ``fields``, each an object; at most :data:`MAX_CALLS` calls."""
    for number, line in enumerate(lines, start=2):
        record = _json(line, source, number)
        if type(record) is not dict or record.keys() != set(fields) or any(type(record[f]) is not dict for f in fields):
            raise ManifestError(f"{source}: line {number} is not a call record ({', '.join(fields)}).")
        if len(calls) >= MAX_CALLS:
            raise UnsafeBundleError(f"{source}: more than {MAX_CALLS} calls. The file is corrupt or hostile.")
        yield number, record


def _parse_compact(head: dict[str, Any], lines: Iterable[bytes], source: str) -> Manifest:
    """A format-version-3 or 4 journal: the head's manifest plus one call record per line."""
    structures, calls, files = head.get("structures"), head.get("calls"), head.get("files")
    if not isinstance(structures, list) or not isinstance(calls, list) or not isinstance(files, dict):
        raise ManifestError(f"{source}: line 1 lacks the structures, calls and files of a manifest.")
    try:
        known = {json.dumps(s, sort_keys=True): i for i, s in enumerate(structures)}
        last: Any = None
        last_index = -1
        for number, record in _records(lines, source, calls, "call", "files"):
            call, structure = record["call"], record["call"].get("structure")
            if not isinstance(structure, dict):
                raise ManifestError(f"{source}: line {number}: call.structure is not a structure (an object).")
            if structure != last:
                text = json.dumps(structure, sort_keys=True)
                found = known.get(text)
                if found is None:
                    found = known[text] = len(structures)
                    structures.append(structure)
                last, last_index = structure, found
            call["structure"] = last_index
            for name, entry in record["files"].items():
                if name in files:
                    _append_range(files[name], entry, f"{source}: line {number}: files[{name!r}]")
                else:
                    files[name] = entry
            calls.append(call)
    except RecursionError as exc:
        raise UnsafeBundleError(f"{source}: a line nests too deep; the file is corrupt or hostile.") from exc
    return _with_devices(validate_manifest(head, source=source))


def _with_devices(manifest: Manifest) -> Manifest:
    """``manifest`` naming the devices its tensors lived on (the head knows only those written before the stream)."""
    devices = {*manifest.producer.devices, *(row.device for row in tensor_rows(manifest).values())}
    if devices == set(manifest.producer.devices):
        return manifest
    return with_fields(manifest, producer=manifest.producer.model_copy(update={"devices": sorted(devices)}))


def _append_range(segment: Any, added: Any, where: str) -> None:
    """Add to ``segment`` (a segment's record so far) the range and tensors of ``added`` (a line's record of it)."""
    if (
        not isinstance(segment, dict)
        or not isinstance(added, dict)
        or not isinstance(segment.get("ranges"), list)
        or not isinstance(added.get("ranges"), list)
        or not isinstance(segment.get("tensors", {}), dict)
        or not isinstance(added.get("tensors", {}), dict)
        or added.keys() - {"size", "hash", "ranges", "tensors"}
    ):
        raise ManifestError(f"{where}: a file added a second time; only a segment (ranges) grows line by line.")
    if added.get("hash", segment.get("hash")) != segment.get("hash"):
        raise ManifestError(f"{where}: the line names hash {added.get('hash')!r}, the segment {segment.get('hash')!r}.")
    tensors = segment.setdefault("tensors", {})
    for key, row in added.get("tensors", {}).items():
        if key in tensors:
            raise ManifestError(f"{where}: adds tensor {key!r} a second time.")
        tensors[key] = row
    segment["ranges"] += added["ranges"]  # in place (a copy per line is quadratic); validation checks they lie back to back
    segment["size"] = added.get("size")


def _json(line: bytes, source: str, number: int) -> Any:
    try:
        return json.loads(line)
    except RecursionError as exc:
        raise UnsafeBundleError(f"{source}: line {number} nests too deep; the file is corrupt or hostile.") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{source}: line {number} is not valid JSON ({exc}).") from exc


def load_journal(bundle_dir: str | os.PathLike[str]) -> Manifest:
    """Rebuild the manifest of ``bundle_dir`` from its ``journal.jsonl`` (see :func:`parse_journal`).

    Raises:
        BundleNotFoundError: There is no journal.
        ManifestError, UnsafeBundleError: The journal is unreadable, too large or invalid.
    """
    root = Path(bundle_dir)
    path = root / JOURNAL_FILENAME
    return parse_journal(read_member(root, path, appended=True), source=str(path))
