"""Read and write ``manifest.json``: limits first, then the format marker, then the models.

A manifest is untrusted input (bundles are attached to bug reports); ``docs/format.md`` ("What a
reader must check") lists what reading refuses. The order: the file's size (:data:`MAX_MANIFEST_BYTES`),
JSON, ``format`` and ``format_version`` (:class:`~iobundle.errors.UnsupportedFormatVersionError`,
naming both), the nesting depth (:data:`MAX_NESTING_DEPTH`) and counts (:data:`MAX_CALLS`,
:data:`MAX_TENSORS`), the pydantic models (``extra="forbid"``), then what models cannot express: ranks
and element counts (:data:`MAX_TENSOR_RANK`, :data:`MAX_TENSOR_ELEMENTS`), unique call indices, dict
nodes, fields newer than the version, extensions (an earlier tensor, a compatible shape, chains of at
most :data:`MAX_EXTENSION_DEPTH`).

Format versions 3 to 6 (:mod:`iobundle.schema._compact`) are checked with the same rules and limits:
the models check all but the bulk (``calls`` and ``files``), which is checked field by field and kept
as compact rows (:mod:`iobundle.schema._deferred`). The cyclic garbage collector is paused while a
manifest is parsed (:func:`iobundle._collector.collector_paused`).

A limit exceeded raises :class:`~iobundle.errors.UnsafeBundleError`; anything else that is wrong
raises :class:`~iobundle.errors.ManifestError`. Both name the file and the offending field.
Limits on tensor files (header size, byte spans) are checked when the file is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import pydantic

from iobundle._atomic import write_atomically
from iobundle._collector import collector_paused
from iobundle._store import LocalStore
from iobundle._store._names import JOURNAL_FILENAME, MANIFEST_FILENAME, MAX_MANIFEST_BYTES
from iobundle.errors import (
    BundleNotFoundError,
    ManifestError,
    TensorFileError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
)
from iobundle.schema._compact import COMPACT_VERSIONS, CompactManifest, dump_manifest
from iobundle.schema._compact_read import Reader, _short, check_tree_list, expand_compact
from iobundle.schema._manifest import (
    FORMAT,
    SUPPORTED_FORMAT_VERSIONS,
    Manifest,
    Node,
    duplicate_call_index,
)

__all__ = [
    "JOURNAL_FILENAME",
    "MANIFEST_FILENAME",
    "MAX_CALLS",
    "MAX_EXTENSION_DEPTH",
    "MAX_MANIFEST_BYTES",
    "MAX_NESTING_DEPTH",
    "MAX_TENSORS",
    "MAX_TENSOR_ELEMENTS",
    "MAX_TENSOR_RANK",
    "dump_manifest",
    "manifest_trees",
    "parse_manifest",
    "validate_manifest",
    "write_manifest",
]

_M = TypeVar("_M", bound=pydantic.BaseModel)

MAX_NESTING_DEPTH = 100
MAX_CALLS = 100_000
MAX_TENSORS = 10_000_000
MAX_TENSOR_RANK = 64
MAX_TENSOR_ELEMENTS = 2**62
MAX_EXTENSION_DEPTH = 100_000


def _check_depth(value: Any, source: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    push, pop = stack.extend, stack.pop
    while stack:
        item, depth = pop()
        if depth > MAX_NESTING_DEPTH:
            raise UnsafeBundleError(
                f"{source}: JSON nesting deeper than {MAX_NESTING_DEPTH} levels. "
                "A bundle written by iobundle never nests that deep; the file is corrupt or hostile."
            )
        children = item.values() if type(item) is dict else item
        push((v, depth + 1) for v in children if type(v) is dict or type(v) is list)


def parse_manifest(data: bytes | str, *, source: str = MANIFEST_FILENAME) -> Manifest:
    """Validate manifest JSON text, checking limits and the format marker first.

    Raises:
        ManifestError: The text is not JSON or does not match the format.
        UnsupportedFormatVersionError: ``format``/``format_version`` are not ones this version reads.
        UnsafeBundleError: A limit (size, nesting depth, counts) is exceeded.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnsafeBundleError(
            f"{source}: {len(data)} bytes, over the limit of {MAX_MANIFEST_BYTES} bytes (MAX_MANIFEST_BYTES). "
            "The file is corrupt or hostile."
        )
    with collector_paused():
        try:
            raw = json.loads(data)
        except RecursionError as exc:
            raise UnsafeBundleError(
                f"{source}: JSON nesting too deep to parse; the file is corrupt or hostile."
            ) from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{source}: not valid JSON ({exc}). Is this a bundle written by iobundle?") from exc
        return validate_manifest(raw, source=source)


def validate_manifest(raw: Any, *, source: str = MANIFEST_FILENAME) -> Manifest:
    """Validate a manifest already parsed from JSON (``parse_manifest`` without the parsing).

    Raises:
        ManifestError, UnsupportedFormatVersionError, UnsafeBundleError: as :func:`parse_manifest`.
    """
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: expected a JSON object, found {type(raw).__name__}.")
    found_format, found_version = raw.get("format"), raw.get("format_version")
    if not isinstance(found_format, str) or found_format != FORMAT:
        raise UnsupportedFormatVersionError(
            f"{source}: format is {_short(found_format)}, expected {FORMAT!r}. This is not an iobundle manifest.",
            found=found_format,
            supported=FORMAT,
        )
    if (
        not isinstance(found_version, int)
        or isinstance(found_version, bool)
        or found_version not in SUPPORTED_FORMAT_VERSIONS
    ):
        newer = (
            isinstance(found_version, int)
            and not isinstance(found_version, bool)
            and found_version > max(SUPPORTED_FORMAT_VERSIONS)
        )
        hint = (
            "Upgrade iobundle to read newer bundles."
            if newer
            else "The manifest is corrupt or not written by iobundle."
        )
        raise UnsupportedFormatVersionError(
            f"{source}: format_version {_short(found_version)} is not supported; this iobundle reads "
            f"format_version {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}. {hint}",
            found=found_version,
            supported=SUPPORTED_FORMAT_VERSIONS,
        )
    reader = Reader(source, MAX_CALLS, MAX_TENSORS, MAX_TENSOR_RANK, MAX_TENSOR_ELEMENTS, MAX_EXTENSION_DEPTH)
    if found_version in COMPACT_VERSIONS:  # the bulk is checked by the reader, without walking it twice
        head = {k: v for k, v in raw.items() if k != "calls" and k != "files"}
        _check_depth(head, source)
        return expand_compact(raw, _validated(CompactManifest, {**head, "calls": [], "files": {}}, source), reader)
    _check_depth(raw, source)
    for field, limit in (("calls", MAX_CALLS), ("tensors", MAX_TENSORS)):
        value = raw.get(field)
        if isinstance(value, (list, dict)) and len(value) > limit:
            reader.too_many(field, len(value), limit)
    manifest = _validated(Manifest, raw, source)
    _check_call_indices(manifest, source)
    _check_tensor_shapes(manifest, reader)
    _check_version_fields(manifest, source)
    _check_extensions(manifest, reader)
    check_tree_list(manifest_trees(manifest), source)
    return manifest


def _validated(model: type[_M], raw: Any, source: str) -> _M:
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ManifestError(f"{source}: does not match the iobundle format:\n" + _describe(exc)) from exc
    except RecursionError as exc:
        raise UnsafeBundleError(f"{source}: structure too deep to validate.") from exc


def _describe(exc: pydantic.ValidationError) -> str:
    lines = [f"  {_loc(e['loc'])}: {e['msg']}" for e in exc.errors()[:10]]
    more = "" if exc.error_count() <= 10 else f"\n  ... and {exc.error_count() - 10} more"
    return "\n".join(lines) + more


def _loc(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _check_call_indices(manifest: Manifest, source: str) -> None:
    seen: dict[int, int] = {}
    for i, call in enumerate(manifest.calls):
        first = seen.setdefault(call.index, i)
        if first != i:
            raise ManifestError(f"{source}: calls[{i}].index: {duplicate_call_index(call.index, first)}.")


def _check_tensor_shapes(manifest: Manifest, reader: Reader) -> None:
    for key, entry in manifest.tensors.items():
        reader.shape(tuple(entry.shape), f"tensors[{key!r}]")


def _check_version_fields(manifest: Manifest, source: str) -> None:
    """Version 1 holds no format-2 field: no ``extends``, no ``hash``/``digest`` (version 2 may spell ``sha256``).

    Neither holds a format-4 field (segments: ``FileEntry.ranges``, ``TensorEntry.offset``) nor a format-5 one
    (``CallEntry.autocast``).
    """
    files = [(f"files[{n!r}]", e) for n, e in manifest.files.items()]
    if manifest.model is not None:
        files += [(f"model.files[{n!r}]", e) for n, e in manifest.model.files.items()]
    newer = [(f"{where}.ranges", 4) for where, file in files if file.ranges is not None]
    newer += [(f"calls[{i}].autocast", 5) for i, call in enumerate(manifest.calls) if call.autocast is not None]
    newer += [(f"tensors[{k!r}].offset", 4) for k, tensor in manifest.tensors.items() if tensor.offset is not None]
    if not newer and manifest.format_version == 1:
        for where, entry in files:
            if entry.sha256 is None:
                raise ManifestError(
                    f"{source}: {where} records hash and digest, which format_version 1 does not use (sha256 expected)."
                )
        newer = [(f"tensors[{k!r}].extends", 2) for k, t in manifest.tensors.items() if t.extends is not None]
    if newer:
        (where, version), *_ = newer
        raise ManifestError(
            f"{source}: {where} is a format_version {version} field; this manifest says version {manifest.format_version}."
        )


def _check_extensions(manifest: Manifest, reader: Reader) -> None:
    """Each extension names an earlier tensor of compatible dtype and shape; chains stay bounded."""
    depth: dict[str, int] = {}
    for key, entry in manifest.tensors.items():
        ext = entry.extends
        if ext is not None:
            at = f"tensors[{key!r}].extends"
            base = manifest.tensors.get(ext.key)
            if base is None or ext.key not in depth:
                problem = "is not listed" if base is None else "is listed after it (or is itself)"
                reader.fail(at, f"tensor {ext.key!r} {problem}; an extended tensor must come earlier in tensors",
                            unsafe=True)  # fmt: skip
            reader.compatible(ext.key, (base.dtype, tuple(base.shape)), entry.dtype, tuple(entry.shape), ext.dim, at)
            if depth[ext.key] + 1 > reader.max_chain:
                reader.fail(
                    at, f"a chain of more than {reader.max_chain} extensions (MAX_EXTENSION_DEPTH)", unsafe=True
                )
        depth[key] = 0 if ext is None else depth[ext.key] + 1


def manifest_trees(manifest: Manifest) -> list[tuple[str, Node]]:
    """Every value tree of ``manifest``, with where it stands in ``manifest.json`` (``calls[3].kwargs['x']``)."""
    trees: list[tuple[str, Node]] = [
        (f"value_if_missing[{i}].value", e.value) for i, e in enumerate(manifest.value_if_missing)
    ]
    for i, call in enumerate(manifest.calls):
        trees += [(f"calls[{i}].args[{j}]", a) for j, a in enumerate(call.args)]
        trees += [(f"calls[{i}].kwargs[{k!r}]", v) for k, v in call.kwargs.items()]
        trees += [
            (f"calls[{i}].{n}", t) for n, t in (("outputs", call.outputs), ("state", call.state)) if t is not None
        ]
    return trees


def read_member(root: Path, path: Path, *, appended: bool = False) -> bytes:
    """The bytes of the bundle file ``path`` (``manifest.json``, ``journal.jsonl``) of the directory ``root``, read
    through :class:`iobundle._store.LocalStore` (never a link), at most :data:`MAX_MANIFEST_BYTES`; an
    ``appended`` one (the journal of a live stream) as long as it was when opened.

    Raises:
        BundleNotFoundError: It does not exist.
        UnsafeBundleError: It is a symbolic link, or is over :data:`MAX_MANIFEST_BYTES`.
        ManifestError: It is not a regular file, or cannot be read.
    """
    try:
        return LocalStore(root).read("/".join(path.relative_to(root).parts), MAX_MANIFEST_BYTES, appended=appended)
    except TensorFileError as exc:
        if not os.path.lexists(path):
            raise BundleNotFoundError(
                f"No {path.name} in '{root}'. Is it a directory written by observer.save()?"
            ) from exc
        raise ManifestError(f"{exc} ('{root}')") from exc


def write_manifest(bundle_dir: str | os.PathLike[str], manifest: Manifest, *, durable: bool = True) -> Path:
    """Write ``manifest.json`` atomically: temporary file, fsync, rename, fsync of the directory.

    With ``durable=False`` the fsyncs are skipped: the rename is still atomic for every process,
    but a crash of the machine may lose the new file.

    Raises:
        BundleWriteError: The file cannot be written (disk full, permission denied).
    """
    path = Path(bundle_dir) / MANIFEST_FILENAME
    write_atomically(path, [dump_manifest(manifest).encode("utf-8")], durable=durable)
    return path
