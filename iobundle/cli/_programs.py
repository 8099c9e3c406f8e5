"""``--dynamic``, the static-axis warnings, ``iobundle export`` with one program per phase, and opening a bundle.

Registered from :mod:`iobundle.cli._main`: :func:`add_dynamic_flag` on ``shapes`` and
``export``, :func:`add_programs_flag` and :func:`cmd_export` on ``export``,
:func:`warn_static_dims` after ``inspect``, ``shapes`` and ``export``; :func:`open_bundle`,
:func:`refuse_damaged` and :func:`batch_spec` serve every command that reads a bundle.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from iobundle._locations import require_existing
from iobundle.cli import _checks, _render
from iobundle.cli._exits import EXIT_CHECK_FAILED, EXIT_OK
from iobundle.cli._logs import silence_libraries
from iobundle.errors import CLIError, ExportError, ReplayError, TensorFileError

if TYPE_CHECKING:
    from iobundle.replay import Bundle

__all__ = [
    "add_dynamic_flag",
    "add_programs_flag",
    "add_report_flag",
    "batch_spec",
    "cmd_export",
    "dynamic_spec",
    "export_report_json",
    "damaged_files",
    "open_bundle",
    "refuse_damaged",
    "warn_static_dims",
]

logger = logging.getLogger(__name__)


def add_dynamic_flag(parser: argparse.ArgumentParser) -> None:
    _checks.add_list_flag(
        parser, "--dynamic", "NAME:AXIS",
        "make AXIS of every tensor of input NAME dynamic even if its size never varied "
        "(repeat; NAME:1,2 for several axes; NAME may be a position)",
    )  # fmt: skip


def add_report_flag(parser: argparse.ArgumentParser) -> None:
    _checks.add_list_flag(
        parser, "--report", "FILE",
        "also write the export report: .md (for an issue), .html (a chart), .csv (one row per call) or "
        ".json (per program its calls, input structure, traced call, patches, timings, one check per call and "
        "the check beyond the recorded calls); repeat for several files",
    )  # fmt: skip


def _export_report_paths(values: list[str]) -> list[str]:
    """The --report files of export, checked before any work: a known extension, a writable place."""
    from iobundle.cli._reports import report_format

    for path in values:
        report_format(path)
        _check_writable(path, "--report", overwrite=True)
    return values


def _write_export_reports(
    args: argparse.Namespace, result: Any, bundle: Bundle, tolerances: Any, path: str, ok: bool, verdict: str
) -> None:
    """Write each --report file: JSON as :func:`export_report_json`, the other formats as validate's reports."""
    import json

    from iobundle.cli._reports import render_report, report_format, write_report_text

    report = None
    for file in args.report:
        fmt = report_format(file)
        if fmt == "json":
            text = json.dumps(export_report_json(result, path), indent=1, default=str)
        else:
            if report is None:
                from iobundle.replay import build_export_report

                report = build_export_report(
                    result, bundle, subject=path, ok=ok, verdict=verdict,
                    tolerances=tolerances, command=_checks.command_line(args),
                )  # fmt: skip
            text = render_report(report, fmt)
        write_report_text(text, file)
        if not _checks.quiet(args):
            _render.out(f"report written to {file}")


def _check_writable(path: str, flag: str, *, overwrite: bool) -> None:
    """Refuse an output that exists (without --overwrite) or whose folder cannot be written, before any work."""
    from iobundle.errors import BundleExistsError, BundleWriteError

    if os.path.lexists(path):
        if os.path.islink(path):  # replacing it would write through the link, wherever it points
            raise BundleExistsError(
                f"{flag} {path}: a symbolic link is there; iobundle never writes through one. "
                "Remove the link, or choose another path."
            )
        if os.path.isdir(path):
            raise BundleExistsError(
                f"{flag} {path}: a directory is there. Give a file name.",
                hint=f"give the path of a file, e.g. {os.path.join(path, 'model.onnx' if flag == '-o' else 'report.md')}",
            )
        if not overwrite:
            raise BundleExistsError(
                f"{flag} {path}: the file exists. Pass --overwrite to replace it, or choose another path."
            )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.lexists(parent) else "does not exist (iobundle does not create it)"
        raise BundleWriteError(
            f"{flag} {path}: the folder {parent} {what}.",
            hint="create the folder first, or choose a path in an existing one",
        )
    try:  # a file made and removed: os.access says yes to root in /proc or on a read-only mount
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise BundleWriteError(
            f"{flag} {path}: cannot write into {parent} ({exc.strerror or exc}).",
            hint="choose a path in a folder you can write to",
        ) from exc


def _check_export_output(args: argparse.Namespace) -> str:
    """``-o`` resolved (a URL of another filesystem refused) and checked: not there unless --overwrite, writable."""
    from iobundle._remote import resolve_output

    target = str(resolve_output(args.output, remote=False, what="iobundle export -o"))
    _check_writable(target, "-o", overwrite=args.overwrite)
    root, ext = os.path.splitext(target)
    stem = root if ext in (".onnx", ".json") else target
    stem = stem[: -len(".programs")] if stem.endswith(".programs") else stem
    index = stem + ".programs.json"  # what --programs per-phase writes beside it
    if index != target and os.path.lexists(index):
        _check_writable(index, "-o", overwrite=args.overwrite)
    return target


def export_report_json(result: Any, path: str) -> dict[str, Any]:
    """The JSON form of ``--report``."""
    import dataclasses

    programs = []
    for program, file in zip(result.programs, result.files or [None] * len(result.programs)):
        report = program.report
        check = report.batch_check
        programs.append(
            {
                "name": program.phase.name,
                "file": file,
                "calls": list(program.phase.calls),
                "inputs": program.phase.inputs,
                "sizes": [c.model_dump(mode="json") for c in program.sizes],
                "split_of": program.split_of,
                "traced_call": report.traced_call,
                "patches": list(report.patches),
                "options": list(report.options),
                "export_seconds": report.export_seconds,
                "check_seconds": report.check_seconds,
                "onnx_seconds": report.onnx_seconds,
                "checks": [dataclasses.asdict(c) for c in report.calls],
                "batch_check": None if check is None else dataclasses.asdict(check),
            }
        )
    return {"output": path, "reason": result.reason, "ok": result.ok, "programs": programs}


def add_programs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--programs",
        choices=("auto", "one", "per-phase"),
        default="auto",
        help="auto: one program for every call when it reproduces them all, else one per phase of the calls "
        "(inputs absent in some calls) with an index MODEL.programs.json; one: never split; per-phase: always "
        "(default: %(default)s)",
    )


def dynamic_spec(args: argparse.Namespace, bundle: Bundle) -> dict[int | str, set[int]] | None:
    """Turn ``--dynamic NAME:AXIS`` flags into the ``dynamic=`` argument; positions of named parameters become names."""
    values = getattr(args, "dynamic", None) or []
    if not values:
        return None
    spec: dict[int | str, set[int]] = {}
    for value in values:
        name, sep, axes_text = value.rpartition(":")
        try:
            axes = {int(a) for a in axes_text.split(",") if a.strip()}
        except ValueError:
            axes = set()
        if not sep or not name or not axes:
            raise CLIError(f"--dynamic {value}: expected NAME:AXIS (e.g. --dynamic input_ids:1 or cache:2).")
        key = str(_input_key(bundle, name, f"--dynamic {value}", f"{name!r} is "))
        rank = _max_rank(bundle, key)
        if rank is not None and any(not -rank <= a < rank for a in axes):
            bad = next(a for a in sorted(axes) if not -rank <= a < rank)
            raise CLIError(
                f"--dynamic {value}: input {key!r} has no axis {bad}: its tensors have at most {rank} "
                f"dimensions; give an axis between 0 and {rank - 1}."
            )
        spec.setdefault(key, set()).update(axes)
    return spec


def _max_rank(bundle: Bundle, name: str) -> int | None:
    """The highest rank among the tensors recorded for input ``name`` in any call (None when it holds none)."""
    from iobundle.calls import iter_tensor_nodes, positional_names
    from iobundle.schema import tensor_rows

    positional, rows = list(positional_names(bundle.manifest.signature)), tensor_rows(bundle.manifest)
    ranks: list[int] = []
    for call in bundle.manifest.calls:
        node = call.kwargs.get(name)
        if node is None and name in positional and positional.index(name) < len(call.args):
            node = call.args[positional.index(name)]
        if node is not None:
            ranks += [len(rows[n.key].shape) for n in iter_tensor_nodes(node) if n.key in rows]
    return max(ranks, default=None)


def warn_static_dims(bundle: Bundle, batch: Any = None, dynamic: Any = None) -> None:
    """Print a warning per axis that looks like a batch or sequence axis and is static only by accident."""
    try:
        hints = bundle.static_dim_hints(batch, dynamic=dynamic)
    except ReplayError as exc:  # the command itself reports alignment problems
        logger.debug("no static-axis hints: %s", exc)
        return
    _warn(hints)


def _warn(hints: Any, prefix: str = "") -> None:
    for hint in hints:
        _render.err(f"warning: {prefix}{hint.message()}")


def format_programs(result: Any, path: str) -> str:
    """The report of :meth:`Bundle.export_programs`: one block per program, then the files written."""
    if len(result.programs) == 1:
        text = _render.format_export(result.programs[0].report, path)
        return _with_batch_check(text, result.programs[0].report)
    split = any(p.sizes for p in result.programs)
    how = "split by the sizes a program refused" if split else "one per phase of the calls"
    lines = [_render.plain(f"{len(result.programs)} programs, {how} ({result.reason})")]
    for program, file in zip(result.programs, result.files or [None] * len(result.programs)):
        phase = program.phase
        calls = f"calls {', '.join(map(str, phase.calls))}" if phase.calls else "no recorded call"
        what = phase.describe() if phase.inputs else "every structure of the calls"
        sizes = " and ".join(c.describe() for c in program.sizes)
        lines.append("")
        lines.append(_render.plain(f"program {phase.name}: {calls} ({what}{f'; sizes: {sizes}' if sizes else ''})"))
        lines.append(_with_batch_check(_render.format_export(program.report, file), program.report))
    if result.files:
        lines.append("")
        lines.append(f"program index written to {path} (give it to `iobundle validate`)")
    return "\n".join(lines)


def _with_batch_check(text: str, report: Any) -> str:
    check = getattr(report, "batch_check", None)
    if check is None:
        return text
    return f"{text}\n" + _render.plain(f"beyond the recorded calls: {check.summary()}")


def cmd_export(args: argparse.Namespace) -> int:
    """``iobundle export``: one program, or one per phase (``--programs``), checked on every call.

    Every flag and the output are checked before anything is traced; each step's line is
    printed as it ends (``-q``: only the verdict).
    """
    tolerances = _checks.export_tolerances(args)
    output = _check_export_output(args)
    reports = _export_report_paths(args.report)
    bundle = open_bundle(args.bundle)
    spec = batch_spec(args, bundle)
    dynamic = dynamic_spec(args, bundle)
    refuse_damaged(bundle, args.bundle)
    from iobundle.replay import ProgressEvent, load_bundle_model, model_from_factory, static_dim_hints

    model = load_bundle_model(bundle) if args.from_bundle else model_from_factory(args.model)
    quiet = _checks.quiet(args)
    try:
        with _checks.progress_bars(args, stages=True) as bars:
            result = bundle.export_programs(
                model, programs=args.programs, set_batch_dimension_for=spec, dynamic=dynamic,
                check=not args.no_check, tolerances=tolerances, dim_names=args.dim_names, on_progress=bars,
            )  # fmt: skip
            onnx_task = "torch.onnx.export" + (
                f" ({len(result.programs)} programs)" if len(result.programs) > 1 else ""
            )
            bars(ProgressEvent(onnx_task, 0, 1))
            path = result.to_onnx(output)
            bars(ProgressEvent(onnx_task, 1, 1))
    except ExportError as exc:
        if exc.report is not None and exc.report.calls and not quiet:
            _render.out(_render.format_export(exc.report, None))
        raise
    if not quiet:
        _render.out(format_programs(result, path))
    checks = [p.report.batch_check for p in result.programs if p.report.batch_check is not None]
    ok = result.ok and (args.no_check or all(c.success is not False for c in checks))
    verdict = _export_verdict(result, path, ok, checked=not args.no_check)
    if reports:
        _write_export_reports(args, result, bundle, tolerances, path, ok, verdict)
    if not quiet:
        for program in result.programs:
            prefix = f"program {program.phase.name}: " if len(result.programs) > 1 else ""
            _warn(static_dim_hints(program.rc, spec, program.dynamic), prefix)
    _render.out(_render.format_verdict(verdict, ok))
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def _export_verdict(result: Any, path: str, ok: bool, *, checked: bool) -> str:
    calls = [c for p in result.programs for c in p.report.calls]
    reproduced = sum(1 for c in calls if c.success)
    what = f"{reproduced}/{len(calls)} recorded calls reproduced" if checked else "not checked (--no-check)"
    programs = f"{len(result.programs)} programs, " if len(result.programs) > 1 else ""
    return f"{'PASS' if ok else 'FAIL'}: {programs}{what}; written to {path}"


def open_bundle(path: str) -> Bundle:
    require_existing(path)  # before the imports opening a bundle pays for
    from iobundle import load_bundle

    logger.debug("opening %s", path)
    bundle = load_bundle(path)
    silence_libraries()  # torch is imported now, and resets its loggers when it is
    return bundle


def damaged_files(bundle: Bundle, where: str) -> list[str]:
    """One line per listed file that is missing or has the wrong size (no hashing: only the headers are read)."""
    return [f"{where}: {problem}" for problem in bundle.verify(hashes=False)]


def refuse_damaged(bundle: Bundle, where: str) -> None:
    """Raise when a listed file is missing or has the wrong size, so a damaged bundle exits with one code.

    Raises:
        TensorFileError: The first bad file, with a count of the others.
    """
    problems = damaged_files(bundle, where)
    if problems:
        more = (
            f" (and {len(problems) - 1} more files: `iobundle verify {where}` lists them)" if len(problems) > 1 else ""
        )
        raise TensorFileError(problems[0] + more)


def batch_spec(args: argparse.Namespace, bundle: Bundle) -> set[int | str] | bool | None:
    """Turn --batch/--batch-all into ``set_batch_dimension_for``; positions of named parameters become names."""
    if args.batch_all and args.batch:
        raise CLIError("Cannot use both --batch and --batch-all. Use --batch-all for every input, or --batch NAME.")
    if args.batch_all:
        return True
    if not args.batch:
        return None
    items = (part.strip() for value in args.batch for part in value.split(","))
    return {_input_key(bundle, item, f"--batch {item}", "", varargs=True) for item in items if item}


def _input_key(bundle: Bundle, name: str, flag: str, unknown: str, *, varargs: bool = False) -> int | str:
    """The input ``name`` given to ``flag`` (its text, for messages): a recorded or declared name, or a position.

    A position of a named parameter becomes its name, so that it also applies when passed by keyword; with
    ``varargs``, a position under ``*args`` stays a position. ``unknown`` starts the message of an unknown name.

    Raises:
        CLIError: The position is past the positional parameters, or the name is no input.
    """
    signature = bundle.manifest.signature
    names = [p.name for p in signature.parameters]
    positional = [p.name for p in signature.parameters if p.kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    recorded = {k for c in bundle.manifest.calls for k in c.kwargs}
    if name.lstrip("-").isdigit() if varargs else name.isdigit():
        position = int(name)
        open_ended = varargs and any(p.kind == "VAR_POSITIONAL" for p in signature.parameters)
        if position < 0 or (position >= len(positional) and not open_ended):
            raise CLIError(
                f"{flag}: {signature.method}() has {len(positional)} positional parameters "
                f"({', '.join(positional) or 'none'}); give a position below {len(positional)} or a name."
            )
        return positional[position] if position < len(positional) else position
    if name in names or name in recorded:
        return name
    raise CLIError(
        f"{flag}: {unknown}not an input of {signature.method}(). Inputs: {', '.join(names + sorted(recorded - set(names)))}."
    )
