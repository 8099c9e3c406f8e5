"""The one rule for a name that must stay inside the bundle (a member file, a program file).

A bundle, a packed bundle, a program index and an overwritten folder all name files relative to
their own directory; every reader and writer checks those names with :func:`is_member_name`.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

__all__ = ["MEMBER_NAME_RULE", "is_member_name"]

_CONTROL_OR_SURROGATE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Unicode categories Cc (control) and Cs (surrogate), exactly."""

MEMBER_NAME_RULE = "a relative path with no '..', backslash, colon or control character"
"""What :func:`is_member_name` asks of a name, for error messages."""


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
