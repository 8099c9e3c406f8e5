"""Local paths and URLs told apart, and a missing local path refused: nothing imported but the errors.

The command line checks a bundle's path here before it imports anything heavy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from iobundle.errors import BundleExistsError, BundleNotFoundError

__all__ = ["is_url", "local_path", "refuse_overlap", "require_existing"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (a ``str`` starting with ``scheme://``); ``file://`` counts as one."""
    return isinstance(location, str) and _URL.match(location) is not None


def local_path(location: str | os.PathLike[str]) -> Path | None:
    """``location`` as a local path, or None when it is a URL of another filesystem.

    ``file:///abs`` and ``file://localhost/abs`` are ``/abs``; ``file://x`` (no host) is ``x``.
    """
    if not is_url(location):
        return Path(location)
    assert isinstance(location, str)
    if location.lower().startswith("file://"):
        rest = location[len("file://") :]
        if rest.lower().startswith("localhost/"):
            rest = rest[len("localhost") :]
        return Path(rest)
    return None


def require_existing(location: str | os.PathLike[str]) -> None:
    """Refuse a local ``location`` that does not exist (a URL is checked when it is opened).

    Cheap (one ``lstat``, no import): the command line calls it before it loads torch.

    Raises:
        BundleNotFoundError: Nothing is at the local path ``location``.
    """
    local = local_path(location)
    if local is not None and not os.path.lexists(local):
        raise BundleNotFoundError(
            f"'{location}' does not exist. Pass the folder written by observer.save() (or a packed file, or a URL)."
        )


def _parts(location: str | os.PathLike[str]) -> tuple[str, ...]:
    """``location``'s parts: a local path's after its links are resolved, a URL's by its text (scheme first)."""
    local = local_path(location)
    if local is not None:
        return Path(os.path.realpath(local)).parts
    scheme, rest = str(location).split("://", 1)
    return (scheme.lower() + "://", *(p for p in rest.split("/") if p))


def refuse_overlap(source: str | os.PathLike[str], output: str | os.PathLike[str], what: str) -> None:
    """Refuse an ``output`` that is ``source``, lies inside it, or holds it: writing it would destroy what is read.

    Raises:
        BundleExistsError: The two overlap (the message says how).
    """
    src, out = _parts(source), _parts(output)
    if src[: len(out)] == out[: len(src)]:
        how = (
            "is the input itself" if out == src else "is inside the input" if len(out) > len(src) else "holds the input"
        )
        raise BundleExistsError(
            f"{what}: the output '{output}' {how}, '{source}'; writing it would destroy what is read.",
            hint="choose an output outside the input (and not a folder that holds it)",
        )
