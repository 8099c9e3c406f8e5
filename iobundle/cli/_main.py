"""The ``iobundle`` command: an argparse parser, one thin handler per subcommand, one error funnel.

Each handler parses, calls the public API, and hands the result to :mod:`iobundle.cli._render`
(the only module that writes to the terminal). Handlers import the library inside their body,
so ``import iobundle.cli`` and ``iobundle --help`` never load torch.

To add a subcommand: write ``_cmd_<name>(args) -> int``, an ``_EXAMPLES`` entry, and in
:func:`_build_parser` an ``_add_command`` block (the handler, the help of its BUNDLE) with its arguments.
Raise :class:`~iobundle.errors.CLIError` for bad flag combinations; return :data:`EXIT_CHECK_FAILED`
when a check the user asked for fails.

The comparing commands (``validate`` here, ``run`` and ``diff`` registered by
:mod:`iobundle.cli._checks`) share their flags, progress bars (:mod:`iobundle.cli._progress_bar`) and
report files (:mod:`iobundle.cli._reports`: Markdown, HTML, JSON, CSV).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from iobundle._collector import collector_paused
from iobundle.cli import _checks, _programs, _render, _render_shapes, _travel
from iobundle.cli._exits import (
    DEBUG_ENV,
    EXIT_DAMAGED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    exit_code_for,
    hint_for,
)
from iobundle.cli._logs import configure_logging
from iobundle.cli._programs import batch_spec as _batch_spec
from iobundle.cli._programs import damaged_files, refuse_damaged
from iobundle.cli._programs import open_bundle as _open_bundle
from iobundle.errors import BundleWriteError, IobundleError, MissingDependencyError, ReplayError

__all__ = ["main"]  # the exit codes are iobundle.cli._exits's

logger = logging.getLogger(__name__)

_DESCRIPTION = """\
Inspect, check and replay iobundle bundles: the calls a PyTorch model received,
recorded with iobundle.InputObserver and saved with observer.save(PATH)."""

_EXIT_HELP = """\
exit codes (the same in every command):
  0    success (validate, run, export: every recorded call reproduced; diff: the bundles are alike;
       verify, inspect: every listed file is there)
  1    a check failed: validate, run, export: a call differs or fails to run (export: or the export
       failed); diff: the bundles differ
  2    usage error: a flag or its value, a path or URL that does not exist, an output that exists
       (without --overwrite) or cannot be written, an unknown URL protocol, a missing optional
       dependency, a model that cannot be loaded or does not fit the bundle
  3    the bundle was read but the operation failed (e.g. calls that cannot be aligned)
  4    nothing compared: validate, run: the bundle holds no recorded outputs (iobundle redact dropped
       them); diff: a bundle holds no calls
  5    the bundle is damaged: manifest.json invalid, a listed file missing, truncated or changed, a
       packed file that is not a valid archive
  130  interrupted (Ctrl-C); what was printed stays printed

environment:
  IOBUNDLE_DEBUG=1  show the full traceback of an error
  NO_COLOR=1        no colour (there is none either when stdout is not a terminal)"""

_EXAMPLES = {
    "iobundle": """\
examples:
  iobundle inspect run.iobundle
  iobundle shapes run.iobundle --batch input_ids --json
  iobundle verify run.iobundle && echo intact
  iobundle export run.iobundle --model mypkg.models:build -o model.onnx
  iobundle validate run.iobundle model.onnx --report report.md
  iobundle pack run.iobundle -o run.iobundle.tar
  iobundle redact run.iobundle -o bug-report.iobundle
  iobundle convert run.iobundle --to onnx-testdata testdata --model model.onnx
  iobundle run run.iobundle --model mypkg.models:build --report drift.html
  iobundle diff gpu.iobundle cpu.iobundle
  iobundle demo
  iobundle COMMAND --help""",
    "export": """\
examples:
  iobundle export run.iobundle --model mypkg.models:build_model -o model.onnx
  iobundle export run.iobundle --model mypkg.models:build_model --batch input_ids --batch cache
  iobundle export bug-report.iobundle --from-bundle -o model.onnx
  iobundle export t5.iobundle --from-bundle --batch-all --dynamic attention_mask:1 -o t5.onnx
  iobundle export run.iobundle --model mypkg.models:build_model --report export.md --report export.json

MODULE:FACTORY names a callable that returns the model (a torch.nn.Module). It is imported
from YOUR environment (installed packages and the current directory) and runs your code;
nothing is ever imported from the bundle. The model is exported with torch.export using the
recorded arguments and dynamic shapes, the exported program is run on every recorded call,
then torch.onnx writes the ONNX file; each step's line is printed as it ends. -o is checked
(not there unless --overwrite, writable) before anything is traced. Exit code 1 when a recorded
call is not reproduced, 2 on a bad flag or an existing -o, 5 when the bundle is damaged.
--report writes what validate's --report does, by extension (.md, .html, .csv: one row per
recorded call, the verdict, the traced call, patches and timings), .json the programs in full.

When one program cannot serve every call (--programs auto, the default) and the calls fall
into phases by structure (inputs absent in some calls: the first decoder step of an
encoder-decoder, a VLM prefill with image features), one program is exported per phase:
MODEL.p0.onnx, MODEL.p1.onnx, ... and MODEL.programs.json, the index to give `validate`.
--dynamic NAME:AXIS makes an axis dynamic that never varied in the recording; a warning
names the axes that look like batch or sequence axes and are static only for that reason.
When the batch is dynamic, the program also runs on a recorded call cut to another batch
size and is compared with the eager model ("beyond the recorded calls"). A program that
refuses that batch on a guard is re-exported with a remedy that serves it, when one does;
else, when the guard is a rule on sizes (a branch of the model's code on batch x length), a
second program is traced from the refused inputs and both are written with an index whose
size rules select one. The line says what the program assumed and what was done, or that
nothing serves it. Recorded calls that a program refuses on such a rule (a quantized cache's
step that moves its residual into the quantized part) get a program of their own the same way.

--from-bundle rebuilds the model from the config and weights a self-contained bundle carries
(observer.save(path, include_model=True)), for the classes transformers registers in its
auto-model mappings and the models the diffusers package exports only, and refuses a config
that would fetch, import or run code (remote code, hub kernels, quantization backends): no code
of yours and none from the bundle runs. For any other model, build it yourself and pass --model MODULE:FACTORY.""",
    "validate": """\
examples:
  iobundle validate run.iobundle model.onnx
  iobundle validate run.iobundle model.onnx --atol 1e-3 --report report.json
  iobundle validate old.iobundle new_model.onnx --report regressions.md
  iobundle validate run.iobundle model.onnx --atol logits=1e-3 --atol 1e-4 --report report.html
  iobundle validate run.iobundle model.onnx --check-error-stat quantile --error-quantile 0.999
  iobundle validate t5.iobundle t5.programs.json

Runs the ONNX model with onnxruntime on every recorded call and compares each output with
the recorded one. With --check-error-stat max (the default) an output passes when every
element is within its --atol or within its --rtol of the recorded value; with mean, median
or quantile, when that statistic of its errors is. A call passes when all its outputs do. A
call whose input was absent at capture and had to be fed a stand-in is "not checked" when it
differs. --report writes a Markdown report to paste into an issue (.md), a self-contained
page with charts (.html), or every column of every call (.json, .csv), by extension.
Given a program index (MODEL.programs.json, written by `export` when one program per phase
was needed), each call runs through the program whose input structure it has and whose
size rule its sizes meet; a call no program serves fails, naming the rules.
Exit code 0 when every call passes, 1 when one differs or fails to run, 2 when the bundle does
not exist, the model cannot be loaded or does not fit the bundle, or a tolerance names no
output, 4 when the bundle holds no recorded outputs (redacted): nothing compared, 5 when the
bundle is damaged.""",
    "demo": """\
examples:
  iobundle demo
  iobundle demo /tmp/iobundle-demo

Builds a tiny decoder (plain torch, part of iobundle), captures its generation loop (a prefill
call, then decode calls with a growing key/value cache), saves the bundle, then in fresh
processes runs `iobundle export` and `iobundle validate` on it.""",
    "inspect": """\
examples:
  iobundle inspect run.iobundle
  iobundle inspect run.iobundle --calls all | less -S

Shapes and dtypes come from manifest.json: no tensor data is read (each listed file's size and
header are checked: a missing or truncated one is named, exit code 5). The dynamic shapes are those `iobundle shapes` prints. Past 20 calls,
consecutive calls that differ only in tensor sizes share one row (a generate() loop: the
prefill, then one row for all the decode steps, growing sizes shown as a range: 5..1003);
--calls all lists every call.""",
    "shapes": """\
examples:
  iobundle shapes run.iobundle
  iobundle shapes run.iobundle --batch input_ids --batch attention_mask
  iobundle shapes run.iobundle --batch 0,1 --json
  iobundle shapes run.iobundle --batch-all --dim-names

A dimension is dynamic when its size differs across the recorded calls; --batch makes
the batch axis of the named inputs dynamic even if every call used the same batch size.
The batch axis is found, not assumed: the batch is the leading size of input_ids (or of
the first input) in each call, and an input's batch axis is the one of that size in every
call (axis 1 of position_ids shaped (3, batch, length)); an input with none is left alone.
With --batch or --batch-all the output ends with the axis taken in each input and why
(comment lines; under the "$batch_axes" key with --json).""",
    "verify": """\
examples:
  iobundle verify run.iobundle
  iobundle verify run.iobundle -q || echo "bundle damaged"

Reads every tensor file and compares its size and hash (XXH3-128; sha256 in format-1 bundles) with the manifest.
Exit code 0 when all match, 5 when a file is missing or differs or the manifest is invalid (a
damaged bundle: the code every command gives it), 2 when the path does not exist.""",
}


_EXAMPLES.update(_checks.EXAMPLES)
_EXAMPLES.update(_travel.EXAMPLES)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _add_logging_flags(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    # Subcommands leave the value unset unless given, so `iobundle -v inspect B` keeps the top-level count.
    default: Any = 0 if top_level else argparse.SUPPRESS
    group = parser.add_argument_group("logging")
    group.add_argument(
        "-v", "--verbose", action="count", default=default,
        help="more: info messages, and the warnings and log lines of torch, onnx, ... (-vv: debug)",
    )  # fmt: skip
    group.add_argument("-q", "--quiet", action="count", default=default, help="the verdict only (and errors)")


def _add_command(
    subparsers: Any,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    *,
    summary: str,
    description: str,
    bundle: str | None = None,
) -> argparse.ArgumentParser:
    """The subcommand ``name`` run by ``handler``, with the logging flags and, given its help, a BUNDLE argument."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=_EXAMPLES[name],
        formatter_class=_Formatter,
    )
    _add_logging_flags(parser, top_level=False)
    if bundle is not None:
        parser.add_argument("bundle", metavar="BUNDLE", help=bundle)
    parser.set_defaults(handler=handler)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iobundle",
        description=_DESCRIPTION,
        epilog=_EXAMPLES["iobundle"] + "\n\n" + _EXIT_HELP,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_logging_flags(parser, top_level=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _add_command(
        subparsers, "inspect", _cmd_inspect, bundle=_checks.BUNDLE,
        summary="summarise a bundle: calls, input shapes, constants, latency, dynamic shapes",
        description="Print how the bundle is stored (a directory or one packed file, local or at a URL), its "
        "format_version, whether it is redacted (and what it kept), a table of the recorded calls (inputs with "
        "shape and dtype, constants, latency), the versions that produced it, and the inferred dynamic shapes.",
    )  # fmt: skip
    p.add_argument(
        "--calls",
        choices=("auto", "all", "runs"),
        default="auto",
        help="all: one row per call; runs: one row per run of consecutive calls that differ only in tensor "
        f"sizes; auto (default): all up to {_render.MAX_CALL_ROWS} calls, runs beyond",
    )

    p = _add_command(
        subparsers, "shapes", _cmd_shapes, bundle=_checks.BUNDLE,
        summary="print the dynamic_shapes to give torch.export.export",
        description="Infer the dynamic_shapes argument of torch.export.export from the recorded calls. When no call "
        "passes every keyword name the others pass (a cross-attention VLM's prefill and decode calls), print the "
        "shapes of each group of calls passing the same names (export makes one program per group), each under a "
        'comment naming its calls and keywords (--json: a list under "$groups").',
    )  # fmt: skip
    _add_batch_flags(p)
    _programs.add_dynamic_flag(p)
    _checks.add_switch(
        p,
        "--dim-names",
        "name each dynamic dimension ('batch_size', 'past_sequence_length', 'x_dim_1'); dimensions equal in "
        "every call share a name",
    )
    _checks.add_switch(p, "--json", 'print JSON: dims as "DYNAMIC" or their name')

    _add_command(
        subparsers, "verify", _cmd_verify, bundle=_checks.BUNDLE,
        summary="check every tensor file's size and hash against the manifest",
        description="Check that every tensor file of the bundle is present and matches the size and hash "
        "recorded in manifest.json.",
    )  # fmt: skip

    p = _add_command(
        subparsers, "export", _programs.cmd_export, bundle=_checks.BUNDLE,
        summary="export a model with torch.export and ONNX from a bundle, checked on every call",
        description="Export the model returned by MODULE:FACTORY with the bundle's inferred arguments and "
        "dynamic shapes, check the exported program on every recorded call, and write an ONNX file.",
    )  # fmt: skip
    _checks.add_model_source(p)
    p.add_argument(
        "-o", "--output", metavar="MODEL.onnx", default="model.onnx", help="the ONNX file (default: %(default)s)"
    )
    _checks.add_switch(p, "--overwrite", "replace MODEL.onnx (and its program index) if it exists")
    _add_batch_flags(p)
    _programs.add_dynamic_flag(p)
    _programs.add_programs_flag(p)
    _programs.add_report_flag(p)
    _checks.add_switch(p, "--no-check", "write the ONNX file even if a recorded call differs")
    _checks.add_switch(
        p,
        "--dim-names",
        "name the graph's dynamic dimensions (batch_size, past_sequence_length, ...), as shapes --dim-names prints",
    )
    _checks.add_tolerance_flags(p, prefix="the check's ")

    p = _add_command(
        subparsers, "validate", _cmd_validate, bundle=_checks.BUNDLE,
        summary="run an ONNX model on every recorded call and compare with the recorded outputs",
        description="Run MODEL.onnx with onnxruntime on every recorded call of BUNDLE and compare its outputs "
        "with the recorded ones: one row per call and a verdict.",
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    _checks.add_comparison_flags(p)

    _checks.register(subparsers, _add_command)  # run, diff

    p = _add_command(
        subparsers, "demo", _cmd_demo,
        summary="capture, export and validate a tiny built-in decoder, end to end",
        description="Run the whole job on a tiny decoder that iobundle builds itself.",
    )  # fmt: skip
    p.add_argument(
        "directory", metavar="DIR", nargs="?", default="iobundle-demo", help="where to write (default: %(default)s)"
    )
    _checks.add_switch(
        p, "--llama", "use a tiny transformers LlamaForCausalLM and its generate() instead (needs transformers)"
    )
    _checks.add_switch(
        p, "--overwrite", "replace outputs in DIR that an earlier demo did not write (its own are replaced anyway)"
    )

    _travel.register(subparsers, _add_command)  # pack, unpack, redact, convert
    return parser


def _add_batch_flags(parser: argparse.ArgumentParser) -> None:
    _checks.add_list_flag(
        parser, "--batch", "NAME",
        "make the batch axis of this input dynamic (a name or a position; repeat or separate with commas)",
    )  # fmt: skip
    _checks.add_switch(
        parser,
        "--batch-all",
        "make the batch axis of every input dynamic (found from the sizes; inputs without one are left alone)",
    )


def _version() -> str:
    from iobundle._version import __version__

    return __version__


# --------------------------------------------------------------------------- handlers


def _cmd_inspect(args: argparse.Namespace) -> int:
    with collector_paused():  # every object it builds dies with the command
        return _inspect(args)


def _inspect(args: argparse.Namespace) -> int:
    bundle = _open_bundle(args.bundle)
    shapes: Any = None
    shapes_error: str | None = None
    groups: list[Any] = []
    try:
        shapes = bundle.infer_dynamic_spec()
    except ReplayError as exc:  # the rest of the report is still worth printing
        try:
            groups = bundle.infer_group_shapes()  # calls that align group by group (keyword names differ)
        except ReplayError:
            groups = []
        if not groups:
            shapes_error = str(exc)
    model = None
    if bundle.manifest.model is not None:
        from iobundle.replay import describe_bundle_model

        model = describe_bundle_model(bundle, registry=False)  # a file-reading command imports no transformers
    _render.out(
        _render.format_inspect(
            args.bundle,
            bundle.manifest,
            dynamic_shapes=shapes,
            dynamic_shapes_error=shapes_error,
            group_shapes=groups,
            model=model,
            packed=bundle.packed,
            remote=bundle.remote,
            calls_shown="none" if _checks.quiet(args) else args.calls,
        )
    )
    problems = damaged_files(bundle, args.bundle)
    for problem in problems:
        _render.out(f"damaged    {problem}")
    _programs.warn_static_dims(bundle)
    return EXIT_DAMAGED if problems else EXIT_OK


def _cmd_shapes(args: argparse.Namespace) -> int:
    bundle = _open_bundle(args.bundle)
    spec = _batch_spec(args, bundle)
    dynamic = _programs.dynamic_spec(args, bundle)
    refuse_damaged(bundle, args.bundle)
    groups = bundle.infer_group_shapes(spec, args.dim_names, dynamic=dynamic)
    if groups:  # no call passes every keyword name: one set of shapes per group, as export makes one program each
        _render.out(
            _render_shapes.format_group_shapes_json(groups, batch=bool(spec))
            if args.json
            else _render_shapes.format_group_shapes(groups)
        )
        return EXIT_OK
    shapes = bundle.infer_dynamic_spec(set_batch_dimension_for=spec, dim_names=args.dim_names, dynamic=dynamic)
    _programs.warn_static_dims(bundle, spec, dynamic)
    batch_axes = bundle.infer_batch_axes(spec) if spec else None
    if args.json:
        _render.out(_render_shapes.format_dynamic_shapes_json(shapes, batch_axes))
    else:
        _render.out(_render_shapes.format_dynamic_shapes(shapes))
        if batch_axes is not None:
            _render.out(_render_shapes.format_batch_axes(batch_axes))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    bundle = _open_bundle(args.bundle)
    problems = [f"{args.bundle}: {p}" for p in _checks.with_progress(args, bundle.verify)]
    _render.out(_render.format_verify(bundle.manifest, problems, quiet=_checks.quiet(args)))
    return EXIT_DAMAGED if problems else EXIT_OK


def _check_program_index(path: str) -> None:
    """A program index given as the model is the model's file: when it cannot be read, the model cannot (exit 2)."""
    from iobundle.errors import BundleError, ModelLoadError
    from iobundle.schema import load_program_index

    try:
        load_program_index(path)
    except BundleError as exc:
        raise ModelLoadError(f"{exc} (the model given to validate)") from exc


def _cmd_validate(args: argparse.Namespace) -> int:
    options = _checks.comparison_options(args)
    if str(args.model).endswith(".json") and os.path.isfile(args.model):
        _check_program_index(args.model)
    bundle = _open_bundle(args.bundle)
    report = _checks.with_progress(args, bundle.validate, args.model, tolerances=options)
    return _checks.finish_comparison(args, report, [bundle])


# `python -c` puts the current folder first on sys.path (unless PYTHONSAFEPATH is set), where a folder named
# iobundle would shadow the installed package: the child drops it (what `python -P` does, from Python 3.11 on).
_CHILD = (
    "import sys; getattr(sys.flags, 'safe_path', False) or sys.path.pop(0); "
    "from iobundle.cli import main; sys.exit(main())"
)


def _run_step(argv: list[str]) -> int:
    """Run ``iobundle ARGV`` in a fresh interpreter that imports the installed package, its output passed through."""
    import subprocess

    _render.out(f"$ iobundle {' '.join(argv)}")
    sys.stdout.flush()
    return subprocess.run([sys.executable, "-c", _CHILD, *argv], check=False).returncode


def _claim_demo_outputs(directory: str, names: list[str], *, overwrite: bool) -> None:
    """Refuse an output there that no earlier demo wrote (its marker lists what it wrote), then list these in it."""
    import json

    from iobundle.errors import BundleExistsError

    marker = os.path.join(directory, ".iobundle-demo.json")
    try:
        with open(marker, encoding="utf-8") as f:
            ours = set(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        ours = set()
    for name in names:
        if not overwrite and name not in ours and os.path.lexists(os.path.join(directory, name)):
            raise BundleExistsError(
                f"'{os.path.join(directory, name)}' is there and an earlier `iobundle demo` did not write it; "
                "the demo replaces only its own outputs."
            )
    try:
        os.makedirs(directory, exist_ok=True)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({"written_by": "iobundle demo", "files": sorted(ours | set(names))}, f)
    except OSError as exc:
        raise BundleWriteError(f"Cannot write into {directory}: {exc.strerror or exc}.") from exc


def _cmd_demo(args: argparse.Namespace) -> int:
    import time

    from iobundle.demo import DEMO_FACTORY, capture_demo, capture_llama_demo

    if args.llama:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(
                "iobundle demo --llama needs transformers: pip install 'iobundle[transformers]'."
            ) from exc
    directory = os.path.abspath(args.directory)
    stem, bundle_name = ("llama", "llama.iobundle") if args.llama else ("model", "demo.iobundle")
    onnx_path = os.path.join(directory, f"{stem}.onnx")
    report = os.path.join(directory, f"{stem}-report.md")
    _claim_demo_outputs(directory, [bundle_name, f"{stem}.onnx", f"{stem}-report.md"], overwrite=args.overwrite)
    begin = time.perf_counter()
    if args.llama:
        bundle, n_calls = capture_llama_demo(directory)
        what, source = "LlamaForCausalLM.forward during generate()", ["--from-bundle"]
    else:
        bundle, n_calls = capture_demo(directory)
        what, source = "TinyDecoder.forward during a generation loop", ["--model", DEMO_FACTORY]
    _render.out(
        f"captured {n_calls} calls of {what} (1 prefill + {n_calls - 1} decode) "
        f"in {time.perf_counter() - begin:.2f}s -> {bundle}"
    )
    steps = [
        ["inspect", str(bundle)],
        ["export", str(bundle), *source, "-o", onnx_path, "--batch-all", "--overwrite"],
        ["validate", str(bundle), onnx_path, "--report", report],
    ]
    for argv in steps:
        begin = time.perf_counter()
        code = _run_step(argv)
        _render.out(f"({argv[0]}: {time.perf_counter() - begin:.2f}s, exit code {code})\n")
        if code != EXIT_OK:
            return code
    _render.out(f"demo done: bundle {bundle}, ONNX model {onnx_path}, report {report}")
    return EXIT_OK


# --------------------------------------------------------------------------- main


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iobundle`` command with ``argv`` (default: ``sys.argv[1:]``) and return its exit code.

    An :class:`~iobundle.errors.IobundleError` is printed as ``error: <message>`` and a hint on
    stderr, without a traceback unless ``IOBUNDLE_DEBUG=1`` (then it is raised again).

    Example:
        >>> main(["verify", "run.iobundle"])
        OK: 2 files, 536 B, sizes and hashes match the manifest
        0
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.argv = list(sys.argv[1:] if argv is None else argv)
    with configure_logging(args.verbose, args.quiet) as args.log_level:
        try:
            return int(args.handler(args))
        except IobundleError as exc:
            _render.err(f"error: {exc}")
            if _debug():
                raise
            _render.err(f"hint: {hint_for(exc, args.command, overwrite=getattr(args, 'overwrite', False))}")
            return exit_code_for(exc)
        except KeyboardInterrupt:
            _render.err("error: interrupted (what was printed above stays true)")
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # `iobundle inspect B | head`: the reader left, nothing left to say
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_OK
