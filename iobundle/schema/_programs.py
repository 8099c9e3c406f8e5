"""The program index: which exported program serves which recorded calls. JSON only: no torch here.

When one traced program cannot serve every recorded call (the first decoder step of an
encoder-decoder, whose cross-attention cache is still empty; a VLM prefill carrying image
features), ``iobundle export`` writes one ONNX file per phase and this index beside them::

    {
     "format": "iobundle.programs",
     "format_version": 1,
     "reason": "one program: torch.export failed on recorded call 2: ...",
     "programs": [
      {"name": "p0", "file": "t5.p0.onnx", "calls": [0], "traced_call": 0,
       "inputs": {"attention_mask": "present", "cache": "absent", ...}},
      {"name": "p1", "file": "t5.p1.onnx", "calls": [1, 2, 3, 4], "traced_call": 2,
       "inputs": {"attention_mask": "present", "cache": "present", ...}}
     ]
    }

``inputs`` is the structure a call must have to be served by the program: per input of the
observed method, ``present`` (every tensor there), ``absent`` (not passed, None, or a cache
holding no tensor yet), ``empty`` (zero-length tensors) or ``K/N`` (K of its N tensors
present). ``calls`` lists the recorded calls the program was exported from and checked on.

The index is data with rules, checked on load and on write: each ``file`` is an ONNX file
(``*.onnx``, never another index: an index has no depth) relative to the index's directory
and never leaving it; program names are unique; call numbers are non-negative and each call
belongs to one program only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from iobundle._atomic import write_atomically
from iobundle._paths import FILE, LINK, MISSING, Tree, check_relative_name, link_message
from iobundle.errors import ManifestError, UnsafeBundleError
from iobundle.schema._names import MEMBER_NAME_RULE, is_member_name

__all__ = [
    "MAX_INDEX_BYTES",
    "PROGRAM_INDEX_FORMAT",
    "ProgramEntry",
    "ProgramIndex",
    "load_program_index",
    "write_program_index",
]

PROGRAM_INDEX_FORMAT = "iobundle.programs"
MAX_INDEX_BYTES = 16 * 1024**2


class ProgramEntry(BaseModel):
    """One program of the index: its ONNX file and the calls it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    file: StrictStr
    calls: list[StrictInt]
    traced_call: StrictInt
    inputs: dict[StrictStr, StrictStr]


class ProgramIndex(BaseModel):
    """Several programs exported from one bundle, one per phase of its calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["iobundle.programs"] = PROGRAM_INDEX_FORMAT
    format_version: Literal[1] = 1
    reason: StrictStr = ""
    programs: list[ProgramEntry] = Field(min_length=1)


def _check_file_name(name: str, where: str) -> None:
    if not is_member_name(name):
        raise UnsafeBundleError(
            f"{where}: file {name!r} must be a relative path inside the index's directory ({MEMBER_NAME_RULE})."
        )


def _check_rules(index: ProgramIndex, where: str) -> None:
    names: set[str] = set()
    owner: dict[int, str] = {}
    for i, program in enumerate(index.programs):
        field = f"{where}programs[{i}]"
        _check_file_name(program.file, field)
        if PurePosixPath(program.file).suffix != ".onnx":
            raise ManifestError(
                f"{field}.file: {program.file!r} is not an ONNX file. A program index names *.onnx files only, "
                "never another index; export again with `iobundle export`."
            )
        if program.name in names:
            raise ManifestError(
                f"{field}.name: {program.name!r} names two programs; each program of an index has its own name."
            )
        names.add(program.name)
        if program.traced_call < 0:
            raise ManifestError(f"{field}.traced_call: {program.traced_call} is negative; call numbers start at 0.")
        for call in program.calls:
            if call < 0:
                raise ManifestError(f"{field}.calls: {call} is negative; call numbers start at 0.")
            if call in owner:
                raise ManifestError(
                    f"{field}.calls: call {call} is listed twice (also by program {owner[call]!r}); "
                    "each recorded call belongs to one program."
                )
            owner[call] = program.name


def load_program_index(path: str | os.PathLike[str]) -> ProgramIndex:
    """Read a program index written by ``iobundle export`` (untrusted input: size, format and names checked).

    Raises:
        ManifestError: The file is missing, not JSON, not an index, or a field is invalid: a program's
            file is not an ONNX file, two programs share a name, or a call number is negative or
            listed twice (the message names the file and the field).
        UnsafeBundleError: The file is too large, or a program's file name leaves the index's directory.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise UnsafeBundleError(f"{path}: {size} bytes, over the limit of {MAX_INDEX_BYTES} for a program index.")
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the program index ({exc.strerror or exc}).") from exc
    except ValueError as exc:
        raise ManifestError(f"{path}: not a JSON program index ({exc}).") from exc
    if not isinstance(data, dict) or data.get("format") != PROGRAM_INDEX_FORMAT:
        raise ManifestError(
            f"{path}: not a program index (its 'format' is not {PROGRAM_INDEX_FORMAT!r}). "
            "Pass an ONNX file or the .programs.json written by `iobundle export`."
        )
    try:
        index = ProgramIndex.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise ManifestError(f"{path}: invalid program index: {problems}") from exc
    _check_rules(index, f"{path}: ")
    _check_no_links(index, path)
    return index


def _check_no_links(index: ProgramIndex, path: Path) -> None:
    """Each program's file lies in the index's folder, reached without a link (:class:`iobundle._paths.Tree`)."""
    with Tree(path.parent) as tree:
        for i, program in enumerate(index.programs):
            field = f"{path}: programs[{i}].file"
            parts = check_relative_name(program.file, field)
            try:
                kind = tree.kind(parts)  # raises for a symlinked folder on the way
            except UnsafeBundleError as exc:
                raise UnsafeBundleError(f"{field}: {exc}") from exc
            except OSError as exc:
                raise ManifestError(f"{field}: {program.file!r} cannot be checked ({exc.strerror or exc}).") from exc
            if kind == LINK:
                raise UnsafeBundleError(f"{field}: {link_message(path.parent.joinpath(*parts))}")
            if kind not in (FILE, MISSING):  # a missing file is reported when the program is loaded
                raise ManifestError(f"{field}: {program.file!r} is not a regular file ({kind}).")


def write_program_index(index: ProgramIndex, path: str | os.PathLike[str]) -> None:
    """Write ``index`` to ``path`` atomically, after checking the rules :func:`load_program_index` checks."""
    _check_rules(index, f"{path}: ")
    text = json.dumps(index.model_dump(mode="json"), indent=1) + "\n"
    write_atomically(Path(path), [text.encode("utf-8")])
