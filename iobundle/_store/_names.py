"""The layout's file names, written once: the rule for a name that stays inside the bundle, and the names writers give.

A bundle, a packed bundle, a program index and an overwritten folder all name files relative to
their own directory; every reader and writer checks those names with :func:`is_member_name`.
Writers name the segments of format version 4 with :func:`segment_file_name` and each call's own
tensor file with :func:`call_file_name`; a file is renamed into place from its temporary name
(:func:`temporary_name`). :func:`is_writer_file` tells whether a member name is one of those
exactly: only such files are ever removed from a bundle directory that its manifest does not list
(what a killed writer left), so a user's file is never taken for one.
"""

from __future__ import annotations

import re

__all__ = [
    "CALL_FILE_NAME",
    "JOURNAL_FILENAME",
    "MANIFEST_FILENAME",
    "MAX_MANIFEST_BYTES",
    "MEMBER_NAME_RULE",
    "MISSING_VALUES_FILE",
    "SEGMENT_FILE_NAME",
    "call_file_name",
    "is_member_name",
    "is_writer_file",
    "segment_file_name",
    "temporary_name",
]

MANIFEST_FILENAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 * 1024**2
"""The largest ``manifest.json`` (or ``journal.jsonl``) read."""
JOURNAL_FILENAME = "journal.jsonl"
"""The log of an open stream (its calls so far); removed once the stream writes ``manifest.json``."""

MISSING_VALUES_FILE = "calls/value_if_missing.safetensors"
"""The tensors of ``value_if_missing``."""

_CONTROL_OR_SURROGATE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Unicode categories Cc (control) and Cs (surrogate), exactly."""

MEMBER_NAME_RULE = "a relative path with no '..', '.' or empty component, backslash, colon or control character"
"""What :func:`is_member_name` asks of a name, for error messages."""


SEGMENT_FILE_NAME = re.compile(r"calls/segment-(?:[0-9]{6}|[1-9][0-9]{6,})\.bin")
"""What :func:`segment_file_name` gives, and nothing else (``fullmatch`` it)."""


CALL_FILE_NAME = re.compile(r"calls/(?:[0-9]{6}|[1-9][0-9]{6,})\.safetensors")
"""What :func:`call_file_name` gives, and nothing else (``fullmatch`` it)."""

_TEMPORARY_NAME = re.compile(r"((?:calls/)?)\.([^/]+)\.tmp")


def segment_file_name(number: int) -> str:
    """The member name of segment ``number`` of a bundle: ``calls/segment-NNNNNN.bin``."""
    return f"calls/segment-{number:06d}.bin"


def call_file_name(index: int) -> str:
    """The member name of the tensor file of call ``index``: ``calls/NNNNNN.safetensors``."""
    return f"calls/{index:06d}.safetensors"


def temporary_name(name: str) -> str:
    """The name a writer gives the file ``name`` until it is complete: ``.<base>.tmp`` in the same folder."""
    folder, _, base = name.rpartition("/")
    return f"{folder}/.{base}.tmp" if folder else f".{base}.tmp"


def is_writer_file(name: str) -> bool:
    """Whether the member name ``name`` is exactly one that iobundle's bundle writers give a file.

    These are ``manifest.json``, ``journal.jsonl``, ``calls/value_if_missing.safetensors``, the
    call files (:data:`CALL_FILE_NAME`), the segments (:data:`SEGMENT_FILE_NAME`), and the
    temporary names of all but the segments (which are appended to in place).
    """
    if _is_final_writer_file(name):
        return True
    tmp = _TEMPORARY_NAME.fullmatch(name)
    if tmp is None:
        return False
    final = tmp.group(1) + tmp.group(2)
    return _is_final_writer_file(final) and SEGMENT_FILE_NAME.fullmatch(final) is None


def _is_final_writer_file(name: str) -> bool:
    return (
        name in (MANIFEST_FILENAME, JOURNAL_FILENAME, MISSING_VALUES_FILE)
        or CALL_FILE_NAME.fullmatch(name) is not None
        or SEGMENT_FILE_NAME.fullmatch(name) is not None
    )


def is_member_name(name: object) -> bool:
    """Whether ``name`` is a non-empty relative POSIX path that stays inside its directory.

    Refused: a non-string or empty name, an absolute path, a ``..``, ``.`` or empty component, a
    backslash, a colon (a drive or a stream on Windows), a control or surrogate character.
    """
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or ":" in name:
        return False
    if _CONTROL_OR_SURROGATE.search(name):
        return False
    return not {"", ".", ".."} & set(name.split("/"))
