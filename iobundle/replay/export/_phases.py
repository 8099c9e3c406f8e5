"""One program when it can serve every call, one per phase when it cannot.

Some calls of a ``generate()`` loop take a code path one traced program cannot share with the
others without changing what the model computes: the first decoder step of an encoder-decoder (T5,
BART) computes the cross-attention keys and values and fills the cache, later steps read them
back; a VLM prefill merges image features decode steps never receive. Such phases show in the
*structure* of the calls (which inputs are absent, or hold no tensor yet), by which
:func:`partition_calls` groups them.

:func:`export_programs` first exports one program for every call; when that fails and the calls
fall into several phases, it exports one program per phase from that phase's calls alone and
checks each on its own calls. :meth:`ProgramSet.to_onnx` writes one ONNX file, or one per phase
plus a program index (:class:`iobundle.schema.ProgramIndex`: which program serves which calls, as
Optimum ships ``decoder_model.onnx`` and ``decoder_with_past_model.onnx``), which
:func:`iobundle.replay.check.validate_onnx` validates call by call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from iobundle._remote import resolve_output
from iobundle.calls import RecordedCalls
from iobundle.errors import AlignmentError, ExportError
from iobundle.replay.check import Tolerances
from iobundle.replay.export._call_checks import CallCheck, ExportReport
from iobundle.replay.export._export import ExportResult, export_program
from iobundle.replay.export._onnx_save import save_onnx
from iobundle.replay.export._trace import signed_subclass
from iobundle.replay.infer import DynamicSpec, align_calls, call_structures, call_values, owner_name, phase_calls
from iobundle.schema import FixedValues, ProgramEntry, ProgramIndex, write_program_index

__all__ = [
    "INDEX_SUFFIX",
    "Phase",
    "PhaseProgram",
    "ProgramSet",
    "ProgramsMode",
    "export_programs",
    "partition_calls",
]

logger = logging.getLogger(__name__)

INDEX_SUFFIX = ".programs.json"
ProgramsMode = Literal["auto", "one", "per-phase"]
_MODES = ("auto", "one", "per-phase")


@dataclass(frozen=True)
class Phase:
    """Recorded calls of one structure.

    Attributes:
        name: ``p0``, ``p1``, ... in the order of their first call (``all`` for every call).
        calls: The recorded indices (``CallEntry.index``) of its calls.
        inputs: Per input, ``present``, ``absent``, ``empty`` or ``K/N`` tensors present.
    """

    name: str
    calls: tuple[int, ...]
    inputs: dict[str, str]

    def describe(self) -> str:
        """The inputs that are not plainly present, e.g. ``cache absent`` (``every input present`` otherwise)."""
        odd = [f"{name} {status}" for name, status in self.inputs.items() if status != "present"]
        return ", ".join(odd) if odd else "every input present"


def partition_calls(rc: RecordedCalls) -> list[Phase]:
    """Group the ok calls by structure (:func:`call_structures`), phases in the order of their first call.

    Calls that pass different keyword names (no call passes them all) are in different phases.

    Raises:
        AlignmentError: The recorded calls cannot be aligned, even in groups passing the same keywords.
    """
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
    structures: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for index, structure in call_structures(rc):
        key = tuple(structure.items())
        groups.setdefault(key, []).append(index)
        structures.setdefault(key, structure)
    return [Phase(f"p{i}", tuple(calls), structures[key]) for i, (key, calls) in enumerate(groups.items())]


@dataclass(kw_only=True)
class PhaseProgram(ExportResult):
    """One exported program (with its report), the phase it serves and the calls it was exported from."""

    phase: Phase
    rc: RecordedCalls
    dynamic: DynamicSpec = None
    """The ``dynamic=`` axes this program was exported with (those of inputs the phase holds)."""
    structures: list[dict[str, str]] = field(default_factory=list)
    """The call structures it serves when not only its phase's (a split of one program for every call)."""
    split_of: str | None = None
    """The program whose refused sizes this one serves (a second program traced from the refused inputs:
    recorded calls, or a recorded call cut to another batch)."""
    values: dict[str, FixedValues] = field(default_factory=dict)
    """The values of inputs this program was traced with, fixed (see :func:`_per_value_set`)."""

    @classmethod
    def of(cls, result: ExportResult, phase: Phase, rc: RecordedCalls, dynamic: DynamicSpec) -> PhaseProgram:
        return cls(
            result.program, result.report, result.splits, result.plan, result.sizes, phase=phase, rc=rc, dynamic=dynamic
        )


@dataclass
class ProgramSet:
    """What :func:`export_programs` exported: one program for every call, or one per phase.

    Attributes:
        programs: The programs, in the order of their first call.
        reason: Why one program was not enough (empty when one serves every call).
    """

    programs: list[PhaseProgram]
    reason: str = ""
    files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.report.ok for p in self.programs)

    @property
    def report(self) -> ExportReport:
        """Every program's report merged: one check per recorded call, in recording order."""
        if len(self.programs) == 1:
            return self.programs[0].report
        if len(self.programs) == 2 and self.programs[1].split_of is not None and not self.programs[1].phase.calls:
            return self.programs[0].report  # one program for the recorded calls, split for the sizes it refused
        reports = [p.report for p in self.programs]
        calls: list[CallCheck] = sorted((c for r in reports for c in r.calls), key=lambda c: c.index)
        merged = ExportReport(
            traced_call=reports[0].traced_call,
            export_seconds=sum(r.export_seconds for r in reports),
            check_seconds=sum(r.check_seconds for r in reports),
            options=list(dict.fromkeys(o for r in reports for o in r.options)),
            patches=list(dict.fromkeys(p for r in reports for p in r.patches)),
            calls=calls,
        )
        onnx = [r.onnx_seconds for r in reports if r.onnx_seconds is not None]
        merged.onnx_seconds = sum(onnx) if onnx else None
        return merged

    def to_onnx(self, path: str | os.PathLike[str]) -> str:
        """Write the ONNX file(s); return ``path`` (one program) or the program index (several).

        With several programs, ``model.onnx`` becomes ``model.p0.onnx``, ``model.p1.onnx``, ...
        and the index ``model.programs.json``, all in the same directory.

        Raises:
            ExportError: ``torch.onnx.export`` failed on a program.
        """
        path = resolve_output(path, remote=False, what="to_onnx")
        assert isinstance(path, Path)
        if len(self.programs) == 1 and not self.programs[0].values:
            only = self.programs[0]
            self.files = [save_onnx(only.rc, only, path)]
            return self.files[0]
        stem = path.name[: -len(path.suffix)] if path.suffix in (".onnx", ".json") else path.name
        if stem.endswith(".programs"):
            stem = stem[: -len(".programs")]
        entries, self.files = [], []
        for program in self.programs:
            file = path.parent / f"{stem}.{program.phase.name}.onnx"
            try:
                save_onnx(program.rc, program, file)
            except ExportError as exc:
                raise ExportError(
                    f"Program {program.phase.name} (calls {list(program.phase.calls)}): {exc}", report=exc.report
                ) from exc
            self.files.append(str(file))
            structures = program.structures or [program.phase.inputs]
            entries.append(
                ProgramEntry(
                    name=program.phase.name,
                    file=file.name,
                    calls=list(program.phase.calls),
                    traced_call=program.report.traced_call,
                    inputs=structures[0] if len(structures) == 1 else structures,
                    sizes=program.sizes,
                    values=program.values,
                )
            )
        index_path = path.parent / f"{stem}{INDEX_SUFFIX}"
        write_program_index(ProgramIndex(reason=self.reason, programs=entries), index_path)
        logger.info("wrote %d programs and their index %s", len(entries), index_path)
        return str(index_path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def export_programs(
    rc: RecordedCalls, model: torch.nn.Module, *, programs: ProgramsMode = "auto",
    set_batch_dimension_for: Collection[int | str] | bool | None = None, dynamic: DynamicSpec = None,
    strict: bool = False, check: bool = True, dim_names: Any = False, on_progress: Any = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
) -> ProgramSet:  # fmt: skip
    """Export one program that serves every recorded call, or one per phase when it cannot.

    With ``programs="auto"`` (the default) one program is exported and checked on every call
    first; only when that fails (``torch.export`` refuses, or a call is not reproduced) and
    the calls have several structures (:func:`partition_calls`) is one program exported per
    phase, each from its own calls and checked on them. ``"one"`` never splits;
    ``"per-phase"`` always does. The other arguments are those of :func:`export_program`; the
    tolerances are built once (or given as ``tolerances``) and shared by every program's check.

    Raises:
        ExportError: No program could be exported for some call, or (with ``check``) a call
            is not reproduced by its program; the message names the phase and the call.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
    if programs not in _MODES:
        raise ExportError(f"programs={programs!r}: use one of {', '.join(map(repr, _MODES))}.")
    options: dict[str, Any] = dict(
        set_batch_dimension_for=set_batch_dimension_for, dynamic=dynamic, strict=strict, dim_names=dim_names,
        on_progress=on_progress, tolerances=tolerances,
    )  # fmt: skip
    phases = partition_calls(rc)
    every = Phase("all", tuple(c.index for c in rc.ok_calls), {})
    if programs == "one" or len(phases) == 1:
        try:
            one = export_program(rc, model, check=check, **options)
        except ExportError as exc:
            fixed = None if programs == "one" else _per_value_set(rc, model, phases[0], exc, check, options)
            if fixed is None:
                raise
            return fixed
        return _split(ProgramSet([PhaseProgram.of(one, every, rc, dynamic)]), phases)
    reason = f"programs={programs!r}"
    single: ProgramSet | None = None
    if programs == "auto":
        try:
            one = export_program(rc, model, check=True, **options)
            single = ProgramSet([PhaseProgram.of(one, every, rc, dynamic)])
        except (ExportError, AlignmentError) as exc:
            reason = f"one program: {_first_line(exc)}"
        if single is not None:
            unchecked = [c.index for c in single.report.calls if c.success is None]
            if not unchecked:
                return _split(single, phases)
            # Calls fed stand-ins for absent inputs that then differ are not checked: their own
            # phase's program, which never needs those stand-ins, may check them.
            reason = f"one program leaves calls {unchecked} unchecked (stand-ins for absent inputs differ)"
        logger.info("%s; exporting one program per phase (%d phases)", reason, len(phases))
    result = ProgramSet([], reason=reason)
    for phase in phases:
        sub = phase_calls(rc, phase.calls)
        phase_dynamic = _phase_dynamic(rc, phase, dynamic)
        try:
            one = export_program(sub, model, check=check, **{**options, "dynamic": phase_dynamic})
        except ExportError as exc:
            if single is not None:  # one program with unchecked calls beats none
                logger.info("program %s failed (%s); keeping the single program", phase.name, _first_line(exc))
                return single
            raise ExportError(
                f"Program {phase.name} (calls {list(phase.calls)}, {phase.describe()}): {exc}\n"
                f"(one program for every call was tried first: {reason})",
                report=exc.report,
            ) from exc
        result.programs.append(PhaseProgram.of(one, phase, sub, phase_dynamic))
    return _split(result, phases)


def _split(result: ProgramSet, phases: list[Phase]) -> ProgramSet:
    """``result`` with each program followed by the programs its export kept for the sizes it refused.

    (its ``splits``, :class:`iobundle.replay.export.SplitProgram`.) The first keeps the calls no
    split took and the size rule its guards hold, each other program the calls it was traced from (none
    for a split beyond the recorded calls) and its own rule; the reason says why. One program for
    every call serves the structures of every phase.
    """
    if not any(p.splits for p in result.programs):
        return result
    programs: list[PhaseProgram] = []
    reasons = [result.reason] if result.reason else []
    for program in result.programs:
        if not program.splits:
            programs.append(program)
            continue
        whole = program.phase.name == "all"
        structures = [p.inputs for p in phases] if whole else []
        taken = {c for split in program.splits for c in split.calls}
        kept = tuple(c for c in program.phase.calls if c not in taken)
        first = Phase("p0" if whole else program.phase.name, kept, program.phase.inputs)
        programs.append(dataclasses.replace(program, splits=[], phase=first, structures=structures))
        for number, split in enumerate(program.splits, 1):
            name = f"p{number}" if whole else f"{first.name}_split" + (str(number) if number > 1 else "")
            second = Phase(name, split.calls, program.phase.inputs)
            second_rc = phase_calls(program.rc, split.calls) if split.calls else program.rc
            programs.append(PhaseProgram.of(split, second, second_rc, program.dynamic))
            programs[-1].structures, programs[-1].split_of = structures, first.name
            traced = f"traced from its recorded calls {list(split.calls)}" if split.calls else "traced from such inputs"
            reasons.append(
                f"program {first.name} refuses {' and '.join(c.describe() for c in split.sizes)} on a guard of the "
                f"model's code; program {second.name}, {traced}, serves them"
            )
    return ProgramSet(programs, reason="; ".join(reasons))


def _phase_dynamic(rc: RecordedCalls, phase: Phase, dynamic: DynamicSpec) -> DynamicSpec:
    """``dynamic`` without the inputs that hold no tensor in ``phase`` (a cache at the first step)."""
    if not dynamic:
        return dynamic
    kept = {}
    for key, axes in dynamic.items():
        name = rc.names[key] if isinstance(key, int) and key < len(rc.names) else str(key)
        if phase.inputs.get(name, "absent") != "absent":
            kept[key] = axes
    return kept


_DATA_DEPENDENT = "data-dependent"
MAX_FIXED_ELEMENTS = 4096


_FACTORIES = {f"aten::{name}" for name in ("arange", "full", "zeros", "ones", "scalar_tensor", "linspace", "eye")}


class _ValuesFixed(torch.nn.Module):
    """``model``'s observed method with the inputs of ``fixed`` replaced by tensors of those values
    (``{name: (elements, shape, dtype)}``), made anew at each call.

    The method keeps its signature (the inputs stay arguments, unused): a program traced through it
    takes what the recorded calls hold, and computes with the values it was traced with.
    """

    def __new__(cls, model: torch.nn.Module, method: str, fixed: dict[str, tuple[Any, ...]]) -> _ValuesFixed:
        from unittest import mock

        from torch._subclasses import fake_tensor

        signature = inspect.signature(getattr(model, method))

        def forward(self: _ValuesFixed, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            # Tensors made from numbers while tracing are constants whose values torch.export's fake
            # tensors keep, and propagate through the ops on them, up to CONSTANT_NUMEL_LIMIT elements;
            # so is what factories build from numbers (torch.arange(n): a window index built from a grid),
            # computed anew, not from fake tensors' dispatch cache (a factory's output traced before, not constant).
            allow, fake = fake_tensor.should_allow_numbers_as_tensors, torch._guards.detect_fake_mode()
            with (
                contextlib.nullcontext() if fake is None else fake_tensor.disable_fake_tensor_cache(fake),
                mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", MAX_FIXED_ELEMENTS),
                mock.patch.object(
                    fake_tensor,
                    "should_allow_numbers_as_tensors",
                    lambda op: op.name().split(".")[0] in _FACTORIES or allow(op),
                ),
            ):
                for name, (data, shape, dtype) in self.fixed.items():
                    bound.arguments[name] = torch.tensor(data, dtype=dtype).reshape(shape)
                return getattr(self.model, method)(*bound.args, **bound.kwargs)

        return super().__new__(signed_subclass(cls, forward, signature, method))

    def __init__(self, model: torch.nn.Module, method: str, fixed: dict[str, tuple[Any, ...]]) -> None:
        super().__init__()
        self.model = model
        self.fixed = fixed


def _value_inputs(rc: RecordedCalls) -> dict[str, torch.dtype]:
    """The inputs that may carry sizes in their values, and their dtypes: one integer tensor of at most
    :data:`MAX_FIXED_ELEMENTS` elements in every call (an image grid, lengths), smallest first."""
    alignment = align_calls(rc)
    found: dict[str, tuple[int, torch.dtype]] = {}
    for owner, count in collections.Counter(alignment.owners).items():
        name = owner_name(rc, owner)
        values = [call_values(rc, alignment, i)(name) for i in range(len(alignment.calls))]
        key = alignment.slots[0][alignment.owners.index(owner)]
        if key and count == 1 and name != rc.var_keyword and all(v and len(v[1]) <= MAX_FIXED_ELEMENTS for v in values):
            found[name] = (max(len(v[1]) for v in values if v), rc.store.get(key).dtype)
    return {name: found[name][1] for name in sorted(found, key=lambda n: found[n][0])}


def _per_value_set(
    rc: RecordedCalls, model: torch.nn.Module, phase: Phase, exc: ExportError, check: bool, options: dict[str, Any]
) -> ProgramSet | None:
    """When torch.export stopped on a size read from tensor values (``torch.split(x, lengths.tolist())``): one
    program per recorded value set of the inputs carrying it, each traced with those values fixed; None when
    the failure is another (a constraint on such an input's size counts), or no fixed values let the first set export.

    The inputs tried are those of :func:`_value_inputs`, each alone, then all together. Each program
    serves the calls holding its values (the program index's ``values``) and is checked on them;
    its report says which inputs fix sizes of its graph.
    """
    text = str(exc)
    if rc.signature.method is None or (_DATA_DEPENDENT not in text and "Constraints violated" not in text):
        return None
    dtypes = _value_inputs(rc)
    if _DATA_DEPENDENT not in text and not any(f"L['{name}'].size()" in text for name in dtypes):
        return None
    tries = [[name] for name in dtypes] + ([list(dtypes)] if len(dtypes) > 1 else [])
    alignment = align_calls(rc)
    for names in tries:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, call in enumerate(alignment.calls):
            value = call_values(rc, alignment, i)
            groups.setdefault(tuple((n, *map(tuple, value(n) or ())) for n in names), []).append(call.index)
        result = ProgramSet([], reason=f"one program: {_first_line(exc)}")
        for number, (key, calls) in enumerate(groups.items()):
            fixed = {n: FixedValues(shape=list(shape), data=list(data)) for n, shape, data in key}
            sub = phase_calls(rc, calls)
            wrapped = _ValuesFixed(
                model, rc.signature.method, {n: (v.data, v.shape, dtypes[n]) for n, v in fixed.items()}
            )
            try:
                one = export_program(sub, wrapped, check=check, **options)
            except ExportError as again:
                if number == 0:
                    break  # fixing these inputs does not serve: try the next
                raise ExportError(
                    f"Calls {calls}, traced with the values of {', '.join(names)} fixed: {again}", report=again.report
                ) from again
            said = ", ".join(f"{n} = {v.data} (shape {v.shape})" for n, v in fixed.items())
            one.report.options.append(
                f"traced with the values of {', '.join(names)} fixed ({said}): they fix sizes of the graph, "
                "torch.export could not trace those sizes without them; serves the calls holding them"
            )
            program = PhaseProgram.of(one, Phase(f"p{number}", tuple(calls), phase.inputs), sub, None)
            program.values = fixed
            result.programs.append(program)
        else:
            result.reason += (
                f"; sizes read from the values of {', '.join(names)}: one program per recorded value set "
                f"({len(groups)} sets)"
            )
            logger.info("%s", result.reason)
            return result
    return None
