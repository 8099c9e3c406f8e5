"""The commands' shared pieces: flag helpers, tolerance flags, progress bars, reports; and ``diff`` and ``run``.

Every subcommand declares its flags with the helpers here (:func:`add_switch`, :func:`add_output`,
:func:`add_list_flag`, ...) and runs its long step under :func:`with_progress`. ``validate`` (in
:mod:`iobundle.cli._main`), ``run`` and ``diff`` take the same comparison flags (``--atol [NAME=]VALUE``,
``--rtol [NAME=]VALUE``, ``--check-error-stat``, ``--error-quantile``) and write the same reports
(``--report FILE``: .md, .html, .json or .csv).
"""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from iobundle.cli import _render
from iobundle.cli._progress_bar import ProgressBars
from iobundle.errors import CLIError

if TYPE_CHECKING:
    from iobundle.replay import Bundle, Tolerances, ValidationReport

__all__ = [
    "AddCommand",
    "EXAMPLES",
    "BUNDLE",
    "add_comparison_flags",
    "add_list_flag",
    "add_model_source",
    "add_output",
    "add_switch",
    "add_tolerance_flags",
    "comparison_options",
    "export_tolerances",
    "register",
    "finish_comparison",
    "tolerance_help",
    "progress_bars",
    "quiet",
    "tolerances",
    "with_progress",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

BUNDLE = "the bundle (a directory, a packed file or a URL)"  # the help of most commands' BUNDLE

# Copies of iobundle.replay's values, so that --help loads no torch; tests/cli/test_diff_run.py keeps them equal.
ERROR_STATS = ("max", "mean", "median", "quantile")

DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 0.1

EXAMPLES = {
    "diff": """\
examples:
  iobundle diff gpu.iobundle cpu.iobundle
  iobundle diff before-upgrade.iobundle after-upgrade.iobundle --atol 1e-3 --report diff.md
  iobundle diff a.iobundle b.iobundle --atol logits=1e-2 --check-error-stat median

Compares B with A (the reference), call by call: status, structure of inputs and outputs
(containers, keys, cache layers), constants, each tensor's shape and dtype, then values: the
outputs output by output with the tolerances and --check-error-stat, the inputs with the
default tolerances. When a bundle holds no recorded outputs (redacted), the structure and the
inputs are compared and the verdict says the outputs were not. Exit code 0 when every call is
alike, 1 when something differs, 2 when a bundle does not exist or a tolerance names no output,
4 when a bundle holds no calls, 5 when one is damaged.""",
    "run": """\
examples:
  iobundle run run.iobundle --model mypkg.models:build
  iobundle run llama.iobundle --from-bundle --report drift.html
  iobundle run run.iobundle --model mypkg.models:build --device cuda --atol 1e-3

Calls the eager model again on the inputs of every recorded call (fresh copies each time) and
compares its outputs with the recorded ones: the numerical drift between the machine or the
library versions that recorded the bundle and this one. Same flags and reports as validate.
Exit code 0 when every call passes, 1 when one differs or fails to run, 2 when the bundle does
not exist, the model cannot be loaded or a tolerance names no output, 4 when the bundle holds no
recorded outputs (redacted): nothing compared, 5 when the bundle is damaged.""",
}


def tolerance_help(what: str) -> str:
    """The help of ``--atol`` (``what="absolute"``) or ``--rtol`` (``"relative"``), with the defaults by dtype.

    The help loads no torch: the values of ``iobundle.replay.check.DTYPE_TOLERANCES`` are written here
    (tests/cli/test_first_hour.py compares them).
    """
    default, half, bfloat = (DEFAULT_ATOL, 5e-3, 2e-2) if what == "absolute" else (DEFAULT_RTOL, 0.1, 0.1)
    return (
        f"{what} tolerance: VALUE for every output, or NAME=VALUE for one output (its name in the output tree, "
        "e.g. logits or past_key_values[0], or its ONNX name; fnmatch patterns allowed); repeat the flag "
        f"(default: {default:g}; float16 outputs get {half:g}, bfloat16 outputs {bfloat:g})"
    )


def add_model_source(p: argparse.ArgumentParser) -> None:
    """``--model MODULE:FACTORY | --from-bundle``, one of them required (export and run)."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="MODULE:FACTORY", help="a callable returning the model (your code)")
    add_switch(
        source,
        "--from-bundle",
        "rebuild the model stored in the bundle (saved with include_model=True; transformers and diffusers classes only)",
    )


def add_switch(parser: Any, flag: str, help: str) -> None:
    """A flag that is off unless given (``--overwrite``, ``--no-verify``, ...)."""
    parser.add_argument(flag, action="store_true", help=help)


def add_output(parser: Any, metavar: str, help: str) -> None:
    """``-o/--output METAVAR``, required."""
    parser.add_argument("-o", "--output", metavar=metavar, required=True, help=help)


def add_list_flag(parser: Any, flag: str, metavar: str, help: str) -> None:
    """A flag given any number of times; its values in a list (``[]`` when it is not given)."""
    parser.add_argument(flag, action="append", default=[], metavar=metavar, help=help)


def add_tolerance_flags(parser: Any, *, prefix: str = "") -> None:
    """``--atol`` and ``--rtol``, each ``[NAME=]VALUE`` repeated (``prefix`` starts their help)."""
    for flag, what in (("--atol", "absolute"), ("--rtol", "relative")):
        add_list_flag(parser, flag, "[NAME=]VALUE", prefix + tolerance_help(what))


def add_comparison_flags(parser: argparse.ArgumentParser) -> None:
    """``--atol``, ``--rtol``, ``--check-error-stat``, ``--error-quantile`` and ``--report``."""
    group = parser.add_argument_group("comparison")
    add_tolerance_flags(group)
    group.add_argument(
        "--check-error-stat",
        choices=ERROR_STATS,
        default="max",
        help="the error statistic that decides an output: max = every element within atol or rtol; mean, median, "
        "quantile = that statistic of the errors within atol (or of the relative errors within rtol) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--error-quantile",
        type=float,
        default=0.99,
        metavar="Q",
        help="the quantile of --check-error-stat quantile, also shown in reports; the errors' median and quantile "
        "are computed only for these two (default: %(default)s)",
    )
    add_list_flag(
        group, "--report", "FILE",
        "also write a report: .md (for an issue), .html (charts), .json or .csv; repeat for several files",
    )  # fmt: skip


def tolerances(values: list[str] | None, flag: str, default: float) -> tuple[float, dict[str, float]]:
    value, per_output = default, {}
    for item in values or []:
        name, sep, number = item.rpartition("=")
        try:
            parsed = float(number)
        except ValueError:
            raise CLIError(
                f"{flag} {item}: {number!r} is not a number. Give {flag} VALUE or {flag} NAME=VALUE (e.g. {flag} logits=1e-3)."
            ) from None
        if parsed < 0:
            raise CLIError(f"{flag} {item}: a tolerance cannot be negative.")
        if sep and not name:
            raise CLIError(f"{flag} {item}: the output name before '=' is empty. Use {flag} NAME=VALUE.")
        if sep:
            per_output[name] = parsed
        else:
            value = parsed
    return value, per_output


def export_tolerances(args: argparse.Namespace) -> Tolerances:
    """The comparison value of ``export``'s check from its ``--atol`` / ``--rtol`` flags.

    Raises:
        CLIError: A tolerance is not a number.
    """
    from iobundle.replay import Tolerances

    atol, output_atol = tolerances(args.atol, "--atol", DEFAULT_ATOL)
    rtol, output_rtol = tolerances(args.rtol, "--rtol", DEFAULT_RTOL)
    return Tolerances.build(atol=atol, rtol=rtol, output_atol=output_atol, output_rtol=output_rtol)


def comparison_options(args: argparse.Namespace) -> Tolerances:
    """The one comparison value of ``validate``/``run``/``diff`` from the flags.

    Raises:
        CLIError: A tolerance is not a number, a quantile is out of range, or --report has an unknown extension.
    """
    from iobundle.replay import Tolerances

    base = export_tolerances(args)
    if not 0.0 <= args.error_quantile <= 1.0:
        raise CLIError(f"--error-quantile {args.error_quantile:g}: give a quantile between 0 and 1 (e.g. 0.99).")
    reports = getattr(args, "report", None) or []
    for path in reports:
        from iobundle.cli._reports import report_format

        report_format(path)  # refuse a bad extension before the work
    options = Tolerances.build(
        atol=base.atol, rtol=base.rtol, output_atol=base.per_output_atol, output_rtol=base.per_output_rtol,
        check_error_stat=args.check_error_stat, error_quantile=args.error_quantile,
    )  # fmt: skip
    return replace(options, quantiles=bool(reports))  # reports show the quantile, the terminal does not


def progress_bars(args: argparse.Namespace, *, stages: bool = False) -> ProgressBars:
    """Bars on stderr unless -q (and only on a terminal); with ``stages``, a line on stdout as each step ends."""
    return ProgressBars(enabled=not quiet(args), stages=stages and not quiet(args))


def with_progress(args: argparse.Namespace, work: Callable[..., T], *positional: Any, **keywords: Any) -> T:
    """``work(*positional, on_progress=bars, **keywords)`` with :func:`progress_bars`."""
    with progress_bars(args) as bars:
        return work(*positional, on_progress=bars, **keywords)


def quiet(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "log_level", logging.WARNING) > logging.WARNING)


def command_line(args: argparse.Namespace) -> str:
    argv = getattr(args, "argv", None)
    return "iobundle " + " ".join(shlex.quote(a) for a in argv) if argv is not None else ""


def finish_comparison(args: argparse.Namespace, result: ValidationReport, bundles: list[Bundle]) -> int:
    """Print the table and verdict, write --report, and return the exit code (0 pass, 1 fail)."""
    _render.out(_render.format_validation(result, quiet=quiet(args)))
    paths = getattr(args, "report", None) or []
    if paths:
        from iobundle.cli._reports import write_report
        from iobundle.replay import build_report

        report = build_report(result, bundles, command=command_line(args))
        for path in paths:
            write_report(report, path)
            if not quiet(args):
                _render.out(f"report written to {path}")
    return 0 if result.ok else 1


# --------------------------------------------------------------------------- diff, run


def _cmd_diff(args: argparse.Namespace) -> int:
    from iobundle import load_bundle
    from iobundle.replay import diff_bundles

    options = comparison_options(args)
    a, b = load_bundle(args.a), load_bundle(args.b)
    result = with_progress(args, diff_bundles, a, b, tolerances=options)
    if result.differences and not quiet(args):
        for line in result.differences:
            _render.out(_render.plain(f"bundles differ: {line}"))
    return finish_comparison(args, result, [a, b])


def _cmd_run(args: argparse.Namespace) -> int:
    from iobundle import load_bundle
    from iobundle.replay import load_bundle_model, model_from_factory

    options = comparison_options(args)
    bundle = load_bundle(args.bundle)
    model = load_bundle_model(bundle) if args.from_bundle else model_from_factory(args.model)
    if args.device:
        try:
            model = model.to(args.device)
        except Exception as exc:  # an unknown or absent device
            raise CLIError(
                f"--device {args.device}: cannot move the model there ({type(exc).__name__}: {exc})."
            ) from exc
    model.eval()
    result = with_progress(args, bundle.rerun, model, device=args.device, tolerances=options)
    return finish_comparison(args, result, [bundle])


AddCommand = Callable[..., argparse.ArgumentParser]
"""``_main._add_command``: ``(subparsers, name, handler, summary=, description=, bundle=)`` -> the parser."""


def register(subparsers: Any, add_command: AddCommand) -> None:
    """Add ``diff`` and ``run`` to the ``iobundle`` parser."""
    p = add_command(
        subparsers, "diff", _cmd_diff,
        summary="compare two bundles call by call: structure, shapes, dtypes, values within tolerances",
        description="Compare bundle B with bundle A (the reference), call by call.",
    )  # fmt: skip
    p.add_argument("a", metavar="A", help="the reference bundle")
    p.add_argument("b", metavar="B", help="the bundle compared with it")
    add_comparison_flags(p)

    p = add_command(
        subparsers, "run", _cmd_run, bundle=BUNDLE,
        summary="re-run the eager model on the recorded inputs and compare with the recorded outputs",
        description="Call the model again on every recorded call's inputs and compare with the recorded outputs.",
    )  # fmt: skip
    add_model_source(p)
    p.add_argument("--device", metavar="DEVICE", help="run on this torch device (cpu, cuda, cuda:1, ...)")
    add_comparison_flags(p)
