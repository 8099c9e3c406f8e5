"""The names of a bundle's files: the one rule for a name that must stay inside the bundle, and the segments' names.

A bundle, a packed bundle, a program index and an overwritten folder all name files relative to
their own directory; every reader and writer checks those names with :func:`is_member_name`.
Writers name the segments of format version 4 with :func:`segment_file_name`; an unlisted file
whose name :data:`SEGMENT_FILE_NAME` matches is one a writer left (it died before listing a range).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

__all__ = ["MEMBER_NAME_RULE", "SEGMENT_FILE_NAME", "is_member_name", "segment_file_name"]

_CONTROL_OR_SURROGATE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Unicode categories Cc (control) and Cs (surrogate), exactly."""

MEMBER_NAME_RULE = "a relative path with no '..', backslash, colon or control character"
"""What :func:`is_member_name` asks of a name, for error messages."""


SEGMENT_FILE_NAME = re.compile(r"calls/segment-(?:[0-9]{6}|[1-9][0-9]{6,})\.bin")
"""What :func:`segment_file_name` gives, and nothing else (``fullmatch`` it)."""


def segment_file_name(number: int) -> str:
    """The member name of segment ``number`` of a bundle: ``calls/segment-NNNNNN.bin``."""
    return f"calls/segment-{number:06d}.bin"


def is_member_name(name: object) -> bool:
    """Whether ``name`` is a non-empty relative POSIX path that stays inside its directory.

    Refused: a non-string or empty name, an absolute path, a ``..`` component, a backslash,
    a colon (a drive or a stream on Windows), a control or surrogate character.
    """
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or ":" in name:
        return False
    if _CONTROL_OR_SURROGATE.search(name):
        return False
    pure = PurePosixPath(name)
    return not pure.is_absolute() and ".." not in pure.parts
