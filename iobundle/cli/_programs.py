"""``--dynamic``, the static-axis warnings, and ``iobundle export`` with one program per phase.

Registered from :mod:`iobundle.cli._main`: :func:`add_dynamic_flag` on ``shapes`` and
``export``, :func:`add_programs_flag` and :func:`cmd_export` on ``export``,
:func:`warn_static_dims` after ``inspect``, ``shapes`` and ``export``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from iobundle.cli import _checks, _render
from iobundle.cli._exit import EXIT_CHECK_FAILED, EXIT_OK
from iobundle.errors import CLIError, ExportError, ReplayError

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
    "open_bundle",
    "quiet_exporters",
    "warn_static_dims",
]

logger = logging.getLogger(__name__)


def add_dynamic_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dynamic",
        action="append",
        default=[],
        metavar="NAME:AXIS",
        help="make AXIS of every tensor of input NAME dynamic even if its size never varied "
        "(repeat; NAME:1,2 for several axes; NAME may be a position)",
    )


def add_report_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report",
        metavar="FILE.json",
        help="also write the export report as JSON: per program its calls, input structure, traced call, "
        "patches, timings, one check per call and the check beyond the recorded calls",
    )


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
    signature = bundle.manifest.signature.parameters
    names = [p.name for p in signature]
    positional = [p.name for p in signature if p.kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    recorded = {k for c in bundle.manifest.calls for k in c.kwargs}
    spec: dict[int | str, set[int]] = {}
    for value in values:
        name, sep, axes_text = value.rpartition(":")
        try:
            axes = {int(a) for a in axes_text.split(",") if a.strip()}
        except ValueError:
            axes = set()
        if not sep or not name or not axes:
            raise CLIError(f"--dynamic {value}: expected NAME:AXIS (e.g. --dynamic input_ids:1 or cache:2).")
        key: int | str = name
        if name.isdigit():
            position = int(name)
            if position >= len(positional):
                raise CLIError(
                    f"--dynamic {value}: {bundle.manifest.signature.method}() has {len(positional)} positional "
                    f"parameters ({', '.join(positional) or 'none'}); give a position below {len(positional)} or a name."
                )
            key = positional[position]
        elif name not in names and name not in recorded:
            raise CLIError(
                f"--dynamic {value}: {name!r} is not an input of {bundle.manifest.signature.method}(). "
                f"Inputs: {', '.join(names + sorted(recorded - set(names)))}."
            )
        spec.setdefault(key, set()).update(axes)
    return spec


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
    lines = [
        f"{len(result.programs)} programs, one per phase of the calls ({result.reason})",
    ]
    for program, file in zip(result.programs, result.files or [None] * len(result.programs)):
        phase = program.phase
        lines.append("")
        lines.append(f"program {phase.name}: calls {', '.join(map(str, phase.calls))} ({phase.describe()})")
        lines.append(_with_batch_check(_render.format_export(program.report, file), program.report))
    if result.files:
        lines.append("")
        lines.append(f"program index written to {path} (give it to `iobundle validate`)")
    return "\n".join(lines)


def _with_batch_check(text: str, report: Any) -> str:
    check = getattr(report, "batch_check", None)
    if check is None:
        return text
    return f"{text}\nbeyond the recorded calls: {check.summary()}"


def cmd_export(args: argparse.Namespace) -> int:
    """``iobundle export``: one program, or one per phase (``--programs``), checked on every call."""
    from iobundle.replay import load_bundle_model, model_from_factory, static_dim_hints

    bundle = open_bundle(args.bundle)
    spec = batch_spec(args, bundle)
    dynamic = dynamic_spec(args, bundle)
    model = load_bundle_model(bundle) if args.from_bundle else model_from_factory(args.model)
    try:
        with quiet_exporters(), _checks.progress_bars(args) as bars:
            result = bundle.export_programs(
                model, programs=args.programs, set_batch_dimension_for=spec, dynamic=dynamic,
                check=not args.no_check, atol=args.atol, rtol=args.rtol, dim_names=args.dim_names,
                on_progress=bars,
            )  # fmt: skip
            path = result.to_onnx(args.output)
    except ExportError as exc:
        if exc.report is not None and exc.report.calls:
            _render.out(_render.format_export(exc.report, None))
        raise
    _render.out(format_programs(result, path))
    if args.report:
        import json

        try:
            with open(args.report, "w", encoding="utf-8") as f:
                json.dump(export_report_json(result, path), f, indent=1, default=str)
        except OSError as exc:
            raise CLIError(f"--report {args.report}: cannot write it ({exc.strerror or exc}).") from exc
    for program in result.programs:
        prefix = f"program {program.phase.name}: " if len(result.programs) > 1 else ""
        _warn(static_dim_hints(program.rc, spec, program.dynamic), prefix)
    checks = [p.report.batch_check for p in result.programs if p.report.batch_check is not None]
    ok = result.ok and (args.no_check or all(c.success is not False for c in checks))
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def open_bundle(path: str) -> Bundle:
    from iobundle import load_bundle

    logger.debug("opening %s", path)
    return load_bundle(path)


def batch_spec(args: argparse.Namespace, bundle: Bundle) -> set[int | str] | bool | None:
    """Turn --batch/--batch-all into ``set_batch_dimension_for``; positions of named parameters become names."""
    if args.batch_all and args.batch:
        raise CLIError("Cannot use both --batch and --batch-all. Use --batch-all for every input, or --batch NAME.")
    if args.batch_all:
        return True
    if not args.batch:
        return None
    signature = bundle.manifest.signature.parameters
    names = [p.name for p in signature]
    positional = [p.name for p in signature if p.kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    has_varargs = any(p.kind == "VAR_POSITIONAL" for p in signature)
    recorded = {k for c in bundle.manifest.calls for k in c.kwargs}
    spec: set[int | str] = set()
    for item in (part.strip() for value in args.batch for part in value.split(",")):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            position = int(item)
            if position < 0 or (position >= len(positional) and not has_varargs):
                raise CLIError(
                    f"--batch {item}: {bundle.manifest.signature.method}() has {len(positional)} positional "
                    f"parameters ({', '.join(positional) or 'none'}); give a position below {len(positional)} or a name."
                )
            # A position of a named parameter becomes its name, so that it also applies when passed by keyword.
            spec.add(positional[position] if position < len(positional) else position)
        elif item in names or item in recorded:
            spec.add(item)
        else:
            raise CLIError(
                f"--batch {item}: not an input of {bundle.manifest.signature.method}(). "
                f"Inputs: {', '.join(names + sorted(recorded - set(names)))}."
            )
    return spec


@contextlib.contextmanager
def quiet_exporters() -> Iterator[None]:
    """Silence the exporters' own chatter (deprecation notices, skipped optional ops); errors still show."""
    import warnings

    noisy = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [lg.level for lg in noisy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for lg in noisy:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(noisy, levels):
                lg.setLevel(level)
