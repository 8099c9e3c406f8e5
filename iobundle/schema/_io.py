"""Read and write ``manifest.json``: limits first, then the format marker, then pydantic."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pydantic

from iobundle.errors import (
    BundleNotFoundError,
    BundleWriteError,
    ManifestError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
)
from iobundle.schema._manifest import FORMAT, SUPPORTED_FORMAT_VERSIONS, Manifest

__all__ = [
    "MANIFEST_FILENAME",
    "MAX_CALLS",
    "MAX_MANIFEST_BYTES",
    "MAX_NESTING_DEPTH",
    "MAX_TENSORS",
    "dump_manifest",
    "load_manifest",
    "parse_manifest",
    "write_manifest",
]

MANIFEST_FILENAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 * 1024**2
MAX_NESTING_DEPTH = 100
MAX_CALLS = 100_000
MAX_TENSORS = 10_000_000


def _check_depth(value: Any, source: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING_DEPTH:
            raise UnsafeBundleError(
                f"{source}: JSON nesting deeper than {MAX_NESTING_DEPTH} levels. "
                "A bundle written by iobundle never nests that deep; the file is corrupt or hostile."
            )
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def parse_manifest(data: bytes | str, *, source: str = MANIFEST_FILENAME) -> Manifest:
    """Validate manifest JSON text, checking limits and the format marker first.

    Raises:
        ManifestError: The text is not JSON or does not match the format.
        UnsupportedFormatVersionError: ``format``/``format_version`` are not ones this version reads.
        UnsafeBundleError: A limit (size, nesting depth, counts) is exceeded.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnsafeBundleError(f"{source}: {len(data)} bytes, over the limit of {MAX_MANIFEST_BYTES} bytes.")
    try:
        raw = json.loads(data)
    except RecursionError as exc:
        raise UnsafeBundleError(f"{source}: JSON nesting too deep to parse; the file is corrupt or hostile.") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc}). Is this a bundle written by iobundle?") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: expected a JSON object, found {type(raw).__name__}.")
    found_format, found_version = raw.get("format"), raw.get("format_version")
    if found_format != FORMAT:
        raise UnsupportedFormatVersionError(
            f"{source}: format is {found_format!r}, expected {FORMAT!r}. This is not an iobundle manifest.",
            found=found_format,
            supported=FORMAT,
        )
    if found_version not in SUPPORTED_FORMAT_VERSIONS or isinstance(found_version, bool):
        raise UnsupportedFormatVersionError(
            f"{source}: format_version {found_version!r} is not supported; this iobundle reads "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}. Upgrade iobundle to read newer bundles.",
            found=found_version,
            supported=SUPPORTED_FORMAT_VERSIONS,
        )
    _check_depth(raw, source)
    if len(raw.get("calls") or ()) > MAX_CALLS:
        raise UnsafeBundleError(f"{source}: more than {MAX_CALLS} calls.")
    if len(raw.get("tensors") or ()) > MAX_TENSORS:
        raise UnsafeBundleError(f"{source}: more than {MAX_TENSORS} tensors.")
    try:
        return Manifest.model_validate(raw)
    except pydantic.ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:10]]
        more = "" if exc.error_count() <= 10 else f"\n  ... and {exc.error_count() - 10} more"
        raise ManifestError(f"{source}: does not match the iobundle format:\n" + "\n".join(lines) + more) from exc
    except RecursionError as exc:
        raise UnsafeBundleError(f"{source}: structure too deep to validate.") from exc


def load_manifest(bundle_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``bundle_dir/manifest.json``.

    Raises:
        BundleNotFoundError: ``bundle_dir`` or its manifest does not exist.
        ManifestError: The manifest is invalid (see :func:`parse_manifest`).
    """
    path = Path(bundle_dir) / MANIFEST_FILENAME
    if not Path(bundle_dir).is_dir():
        raise BundleNotFoundError(f"'{bundle_dir}' is not a directory. Pass the folder written by observer.save().")
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise UnsafeBundleError(f"{path}: over the limit of {MAX_MANIFEST_BYTES} bytes.")
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise BundleNotFoundError(
            f"No {MANIFEST_FILENAME} in '{bundle_dir}'. Is it a directory written by observer.save()?"
        ) from exc
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read ({exc.strerror or exc}).") from exc
    return parse_manifest(data, source=str(path))


def dump_manifest(manifest: Manifest) -> str:
    """Return the manifest as indented JSON text (what ``manifest.json`` holds)."""
    return manifest.model_dump_json(indent=1, exclude_defaults=False) + "\n"


def write_manifest(bundle_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: temporary file, fsync, rename, fsync of the directory.

    Raises:
        BundleWriteError: The file cannot be written (disk full, permission denied).
    """
    directory = Path(bundle_dir)
    path = directory / MANIFEST_FILENAME
    tmp = directory / f".{MANIFEST_FILENAME}.tmp"
    text = dump_manifest(manifest).encode("utf-8")
    try:
        with open(tmp, "wb") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise BundleWriteError(
            f"Cannot write {path}: {exc.strerror or exc}. Check free space and permissions."
        ) from exc
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
