"""The program index: which exported program serves which recorded calls. JSON only: no torch here.

When one traced program cannot serve every recorded call (the first decoder step of an
encoder-decoder, whose cross-attention cache is still empty; a VLM prefill carrying image
features), ``iobundle export`` writes one ONNX file per phase and this index beside them::

    {
     "format": "iobundle.programs",
     "format_version": 2,
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

Format version 2 adds ``sizes``, a size rule per program: when a program refuses a batch size
on a guard of the model's own code (``if batch * length == 1``, see
:mod:`iobundle.replay.export._dims`), ``iobundle export`` writes a second program traced from the
refused inputs, and each program says which sizes it serves::

      {"name": "p0", ..., "sizes": [{"of": [["h", 1], ["h", 0]], "op": "!=", "value": 1}]},
      {"name": "p1", ..., "calls": [], "sizes": [{"of": [["h", 1], ["h", 0]], "op": "==", "value": 1}]}

Each condition multiplies the sizes of ``of`` (pairs of an input's name and an axis of the
input's first tensor, or triples naming the input's tensor too: ``["cache", 2, 0]`` is axis 2 of
the cache's first tensor in the program's order) and compares the product with ``value`` by ``op`` (one of ``==``, ``!=``,
``<``, ``<=``, ``>``, ``>=``); an optional ``div`` (one divisor per size) floor-divides each size first
(``pixel_values.size()[2] // 14 * (pixel_values.size()[3] // 14) == 4``, a number of patches); an optional
``expr`` compares that arithmetic of the sizes, named ``s0``, ``s1``, ... in the order of ``of``, instead of
their product (``{"of": [["x", 3], ["x", 2]], "expr": "s0 - s1", "op": "==", "value": 0}``: a square image;
``"expr": "(8 + -1 * (s0 % 8)) % 8"``: a side padded to a multiple of 8), whole numbers and ``+ - * // %``
only; a program serves a call when every condition holds (no ``sizes``: any sizes). A call goes to the first program whose structure it has and whose rule it meets.
``inputs`` may also be a list of structures (a program that serves calls of several). The rule
is data, evaluated by :func:`sizes_match` (an ``expr`` parsed, its tree walked), never by ``eval``. ``values`` (per input, a shape and its
flattened integers) says a program was traced with those values of an input fixed, because they
fix sizes of its graph (``torch.split(x, lengths.tolist())``): it serves only calls holding them. A version 1 index (no ``sizes``)
still loads and means what it meant.

The index is data with rules, checked on load and on write: each ``file`` is an ONNX file
(``*.onnx``, never another index: an index has no depth) relative to the index's directory
and never leaving it; program names are unique; call numbers are non-negative and each call
belongs to one program only.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

import pydantic
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
)

from iobundle._atomic import write_atomically
from iobundle._paths import FILE, LINK, MISSING, Tree, link_message
from iobundle._store._names import MEMBER_NAME_RULE, is_member_name
from iobundle.errors import ManifestError, UnsafeBundleError

__all__ = [
    "MAX_INDEX_BYTES",
    "PROGRAM_INDEX_FORMAT",
    "FixedValues",
    "ProgramEntry",
    "ProgramIndex",
    "SIZE_OPS",
    "SizeCondition",
    "conditions_met",
    "load_program_index",
    "sizes_match",
    "values_match",
    "program_structures",
    "write_program_index",
]

PROGRAM_INDEX_FORMAT: Final = "iobundle.programs"
MAX_INDEX_BYTES = 16 * 1024**2


SIZE_OPS: dict[str, Callable[[int, int], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
"""The comparisons a size rule may use, by their JSON spelling."""


class SizeCondition(BaseModel):
    """One condition of a size rule: the product of the sizes ``of`` compared with ``value`` by ``op``.

    Each size is ``[input, axis]`` (that axis of the input's first tensor) or ``[input, axis, item]``
    (that axis of the input's ``item``-th tensor, in the order the program takes them: a cache's
    ``key_0`` residual). With ``div``, each size is first floor-divided by its divisor there (a
    number of patches: ``axis 2 of pixel_values // 14``). With ``expr``, that arithmetic of the sizes
    (``s0``, ``s1``, ... in the order of ``of``) is compared instead of their product: ``s0 % 4`` (a side
    a multiple of a window), ``s0 - s1`` (a square image); see :func:`evaluate`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    of: list[tuple[StrictStr, StrictInt] | tuple[StrictStr, StrictInt, StrictInt]] = Field(min_length=1, max_length=16)
    op: Literal["==", "!=", "<", "<=", ">", ">="]
    value: StrictInt
    div: list[StrictInt] | None = Field(default=None, min_length=1, max_length=16)
    expr: StrictStr | None = Field(default=None, max_length=512)

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}  # the rules without them read as they did

    @field_validator("expr")
    @classmethod
    def _arithmetic(cls, expr: str | None) -> str | None:
        if expr is not None:
            _parse(expr)
        return expr

    def describe(self) -> str:
        """``axis 1 of h * axis 0 of h == 1``; ``axis 2 of cache (tensor 0) >= 3``; ``axis 2 of x // 14 ...``."""
        names = [f"axis {t[1]} of {t[0]}" + (f" (tensor {t[2]})" if len(t) == 3 else "") for t in self.of]
        if self.expr is not None:
            left = re.sub(
                r"\bs(\d+)\b", lambda m: names[int(m.group(1))] if int(m.group(1)) < len(names) else m[0], self.expr
            )
        else:
            left = " * ".join(n + (f" // {d}" if d != 1 else "") for n, d in zip(names, self.div or [1] * len(names)))
        return f"{left} {self.op} {self.value}"


_ARITHMETIC: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}  # fmt: skip


MAX_EXPR_CHARS = 256
"""The longest ``expr`` a size rule may hold: what the program split writes is a few dozen characters."""


@functools.lru_cache(maxsize=256)
def _parse(expr: str) -> ast.expr:
    """``expr`` parsed (never run): whole numbers, sizes ``s0``, ``s1``, ..., ``+ - * // %`` and unary minus only,
    in at most :data:`MAX_EXPR_CHARS` characters (a long product of long numbers would take long to evaluate)."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"an arithmetic of sizes of {len(expr)} characters, above {MAX_EXPR_CHARS}: {expr[:40]!r}...")
    try:
        tree = ast.parse(expr, mode="eval").body
    except (SyntaxError, RecursionError, ValueError) as exc:
        raise ValueError(f"not arithmetic of sizes: {expr!r}") from exc
    for node in ast.walk(tree):
        allowed = (
            type(node) in _ARITHMETIC
            or isinstance(node, (ast.BinOp, ast.UnaryOp, ast.USub, ast.Load))
            or (isinstance(node, ast.Constant) and type(node.value) is int)
            or (isinstance(node, ast.Name) and re.fullmatch(r"s\d{1,2}", node.id) is not None)
        )
        if not allowed:
            raise ValueError(f"{expr!r} holds {type(node).__name__}: only + - * // % of sizes s0, s1, ... and numbers")
    return tree


def evaluate(expr: str, sizes: list[int]) -> int | None:
    """The value of a size rule's ``expr`` with ``s0``, ``s1``, ... the ``sizes`` (None on a division by 0 or a
    size it names that there is not)."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp):
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand)
        if isinstance(node, ast.Name):
            return sizes[int(node.id[1:])]
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return node.value

    try:
        return value(_parse(expr))
    except (ZeroDivisionError, IndexError):
        return None


class FixedValues(BaseModel):
    """The values an input held in the calls a program serves (a program traced with them fixed): its first
    tensor's ``shape`` and its elements, flattened."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[StrictInt] = Field(max_length=8)
    data: list[StrictInt] = Field(max_length=4096)


class ProgramEntry(BaseModel):
    """One program of the index: its ONNX file, the calls it serves, (version 2) the sizes it serves, and the
    values of inputs that fix sizes of its graph (``values``: a call is served only with those values)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    file: StrictStr
    calls: list[StrictInt]
    traced_call: StrictInt
    inputs: dict[StrictStr, StrictStr] | list[dict[StrictStr, StrictStr]]
    sizes: list[SizeCondition] = Field(default_factory=list, max_length=64)
    values: dict[StrictStr, FixedValues] = Field(default_factory=dict, max_length=16)

    def describe_sizes(self) -> str:
        """The size rule in words (``any sizes`` without one), and the values it was traced with."""
        values = [f"{name} holding {v.data} (shape {v.shape})" for name, v in self.values.items()]
        return " and ".join([c.describe() for c in self.sizes] + values) or "any sizes"


def program_structures(program: ProgramEntry) -> list[dict[str, str]]:
    """The call structures ``program`` serves (``inputs``, one or a list)."""
    return program.inputs if isinstance(program.inputs, list) else [program.inputs]


def sizes_match(program: ProgramEntry, size: Callable[[str, int, int | None], int | None]) -> bool:
    """Whether a call meets ``program``'s size rule; ``size(input, axis, item)`` is that axis of the input's
    ``item``-th tensor in the call (its first tensor when ``item`` is None), None when there is no such
    tensor or the tensor has no such axis (not met then)."""
    return conditions_met(program.sizes, size)


def values_match(program: ProgramEntry, value: Callable[[str], tuple[list[int], list[int]] | None]) -> bool:
    """Whether a call holds the values ``program`` was traced with; ``value(input)`` is the shape and flattened
    elements of the input's first tensor in the call (None without one)."""
    return all(value(name) == (fixed.shape, fixed.data) for name, fixed in program.values.items())


def conditions_met(conditions: list[SizeCondition], size: Callable[[str, int, int | None], int | None]) -> bool:
    """Whether every condition of a size rule holds, sizes asked of ``size`` as :func:`sizes_match` does."""
    for condition in conditions:
        sizes = [size(term[0], term[1], term[2] if len(term) == 3 else None) for term in condition.of]
        if None in sizes:
            return False
        known = [s for s in sizes if s is not None]
        if condition.expr is not None:
            found = evaluate(condition.expr, known)
        else:
            found = math.prod(s // d for s, d in zip(known, condition.div or [1] * len(known)))
        if found is None or not SIZE_OPS[condition.op](found, condition.value):
            return False
    return True


class ProgramIndex(BaseModel):
    """Several programs exported from one bundle, one per phase of its calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["iobundle.programs"] = PROGRAM_INDEX_FORMAT
    format_version: Literal[1, 2] = 2
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
        if index.format_version < 2 and (program.sizes or program.values or isinstance(program.inputs, list)):
            raise ManifestError(
                f"{field}.sizes: a format_version 1 index has no size rules nor lists of structures; "
                "set format_version to 2 or export again with `iobundle export`."
            )
        for name, fixed in program.values.items():
            if min(fixed.shape, default=0) < 0 or math.prod(fixed.shape) != len(fixed.data):
                raise ManifestError(
                    f"{field}.values[{name!r}]: shape {fixed.shape} does not hold {len(fixed.data)} elements."
                )
        for j, condition in enumerate(program.sizes):
            for term in condition.of:
                if min(term[1:]) < 0 or (condition.value < 0 and condition.expr is None):
                    raise ManifestError(
                        f"{field}.sizes[{j}]: axis {term[1]} of {term[0]!r}"
                        + (f" (tensor {term[2]})" if len(term) == 3 else "")
                        + f" compared with {condition.value}: axes, tensor positions and sizes are non-negative."
                    )
            if condition.div is not None and (len(condition.div) != len(condition.of) or min(condition.div) < 1):
                raise ManifestError(
                    f"{field}.sizes[{j}].div: {condition.div} must hold one divisor of 1 or more per size of 'of' "
                    f"({len(condition.of)} sizes)."
                )
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
            file is not an ONNX file, two programs share a name, a call number is negative or
            listed twice, or a size rule is malformed (the message names the file and the field).
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
        # A size is one of two tuples: the location names the field, not which of them pydantic tried.
        found = (
            f"{'.'.join(str(p) for p in e['loc'] if not (isinstance(p, str) and '[' in p))}: {e['msg']}"
            for e in exc.errors()[:8]
        )
        problems = "; ".join(list(dict.fromkeys(found))[:5])
        raise ManifestError(f"{path}: invalid program index: {problems}") from exc
    _check_rules(index, f"{path}: ")
    _check_no_links(index, path)
    return index


def _check_no_links(index: ProgramIndex, path: Path) -> None:
    """Each program's file lies in the index's folder, reached without a link (:class:`iobundle._paths.Tree`)."""
    with Tree(path.parent) as tree:
        for i, program in enumerate(index.programs):
            field = f"{path}: programs[{i}].file"
            if not is_member_name(program.file):
                raise UnsafeBundleError(f"{field}: {program.file!r} is not {MEMBER_NAME_RULE} inside its folder.")
            parts = tuple(program.file.split("/"))
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
