"""``iobundle pack | unpack | redact | upgrade | convert``: bundles that travel, bug reports without private data, converters.

:func:`register` adds the subcommands to the parser of :mod:`iobundle.cli._main`. Handlers import
the library inside their body (``iobundle --help`` loads no torch), print through
:mod:`iobundle.cli._render`, and draw progress bars on stderr (a terminal only, not with ``-q``)
from the library's ``on_progress`` events.
"""

from __future__ import annotations

import argparse
from typing import Any

from iobundle.cli import _render
from iobundle.cli._checks import AddCommand, add_output, add_switch, quiet, with_progress
from iobundle.errors import CLIError

__all__ = ["EXAMPLES", "register"]

EXAMPLES = {
    "pack": """\
examples:
  iobundle pack run.iobundle -o run.iobundle.tar
  iobundle validate run.iobundle.tar model.onnx      # every command reads the packed file in place
  iobundle pack run.iobundle -o s3://bucket/runs/run.iobundle.tar   # with iobundle[remote]

One uncompressed tar file (manifest.json first, then every file of the bundle), to attach or
upload. Tensor members stay where they are in the file: load_bundle and every command
memory-map them in place, nothing is extracted. `tar tf` lists it.""",
    "unpack": """\
examples:
  iobundle unpack run.iobundle.tar -o run.iobundle
  iobundle unpack bug-report.iobundle.tar -o /tmp/bug --overwrite

The archive is untrusted: links, devices, paths leaving the directory, duplicates and
members past its end are refused before anything is written, and every file's size and
XXH3-128 digest are checked against the manifest (--no-verify skips the hashes).""",
    "redact": """\
examples:
  iobundle redact run.iobundle -o bug-report.iobundle
  iobundle redact run.iobundle -o bug-report.iobundle --keep-model      # self-contained, no private inputs
  iobundle redact run.iobundle -o bug.iobundle && iobundle pack bug.iobundle -o bug.iobundle.tar

Every recorded input tensor is replaced by a synthetic one of the same dtype and shape:
integers within the observed range (token ids stay valid), masks stay masks (their two
values, at the observed frequency), increasing positions still increase, floats drawn with
the observed mean and spread. Recorded outputs and stored weights are dropped unless kept.
`iobundle export` works from the result (it checks the exported program against the eager
model on the synthetic inputs); `iobundle validate` says there is nothing to compare against
(exit code 4) when the outputs were dropped.""",
    "upgrade": """\
examples:
  iobundle upgrade old.iobundle new.iobundle
  iobundle upgrade killed-stream.iobundle finished.iobundle   # a journal without its manifest

The new bundle is written in the newest format version (segments are safetensors files),
verified, and each tensor compared with the old one's; the old bundle is never changed.""",
    "convert": """\
examples:
  iobundle convert run.iobundle --to onnx-testdata testdata --model model.onnx
  onnx_test_runner testdata/..                                   # onnxruntime's test runner
  iobundle convert run.iobundle --to npz arrays                  # arrays/call_000000.npz, ...
  iobundle convert run.iobundle --to npz all-calls.npz           # one file, keys call_000000/...

onnx-testdata: test_data_set_N/input_K.pb and output_K.pb per recorded call, TensorProtos named
after the model's graph inputs and outputs, mapped as `iobundle validate` maps them.
npz: keys are the tensors' paths in the call (args.0, kwargs.input_ids, outputs.logits, ...);
bfloat16 and float8 become float32.""",
}

TRAVELLER = "the bundle (directory, packed file or URL)"  # BUNDLE's help here (BUNDLE says "a directory, ...")


def register(subparsers: Any, add_command: AddCommand) -> None:
    """Add ``pack``, ``unpack``, ``redact``, ``upgrade`` and ``convert`` to ``subparsers``."""
    p = add_command(
        subparsers, "pack", _cmd_pack, bundle="the bundle directory",
        summary="pack a bundle directory into one file (uncompressed tar, read in place)",
        description="Write the bundle directory BUNDLE as one uncompressed tar file that every command reads in place.",
    )  # fmt: skip
    add_output(p, "FILE", "the packed file (a path or a URL)")
    add_switch(p, "--overwrite", "replace FILE if it exists")
    add_switch(
        p, "--no-verify", "pack without checking first that every file has the size and hash the manifest records"
    )

    p = add_command(
        subparsers, "unpack", _cmd_unpack,
        summary="unpack a packed bundle into a directory, refusing hostile entries",
        description="Check the packed bundle FILE (its entries and every file's size and hash), then write its files to DIR.",
    )  # fmt: skip
    p.add_argument("archive", metavar="FILE", help="the packed bundle (a path or a URL)")
    add_output(p, "DIR", "the bundle directory to write")
    add_switch(p, "--overwrite", "replace DIR if it holds a bundle")
    add_switch(p, "--no-verify", "skip the hash check of the members (sizes are still checked)")

    p = add_command(
        subparsers, "redact", _cmd_redact, bundle=TRAVELLER,
        summary="copy a bundle with synthetic inputs and no outputs, for bug reports",
        description="Write a copy of BUNDLE whose recorded inputs are synthetic (same dtypes and shapes), "
        "without the recorded outputs and stored weights unless kept.",
    )  # fmt: skip
    add_output(p, "OUT", "the redacted bundle directory (or URL)")
    add_switch(p, "--keep-outputs", "keep the recorded outputs (computed on real inputs)")
    add_switch(p, "--keep-model", "keep the model config and weights the bundle stores")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic values (default: %(default)s)")
    add_switch(p, "--overwrite", "replace OUT if it is not empty")

    p = add_command(
        subparsers, "upgrade", _cmd_upgrade, bundle=TRAVELLER,
        summary="rewrite a bundle of an older format version in the newest one, beside it",
        description="Write BUNDLE (any format version, or a killed stream's journal) to OUT in the newest format "
        "version, then verify OUT and compare every tensor with BUNDLE's. BUNDLE is never changed.",
    )  # fmt: skip
    p.add_argument("output", metavar="OUT", help="the new bundle directory (or URL), outside BUNDLE")
    add_switch(p, "--overwrite", "replace OUT if it holds a bundle")

    p = add_command(
        subparsers, "convert", _cmd_convert, bundle=TRAVELLER,
        summary="write the recorded calls as ONNX test data or numpy .npz files",
        description="Convert the recorded calls of BUNDLE to another tool's format.",
    )  # fmt: skip
    p.add_argument("--to", required=True, choices=["onnx-testdata", "npz"], help="the format to write")
    p.add_argument("output", metavar="DIR_OR_FILE", help="where to write (npz: a directory, or one FILE.npz)")
    p.add_argument("--model", metavar="MODEL.onnx", help="the ONNX model (onnx-testdata: names and input mapping)")
    add_switch(p, "--overwrite", "write into a non-empty directory")


def _moved(verb: str, result: Any, more: str) -> int:
    """Say what a pack or unpack ``result`` moved where in how long, then ``more``; the exit code."""
    _render.out(f"{verb} {result.files} files ({result.bytes} bytes) into {result.path} in {result.seconds:.2f}s{more}")
    return 0


def _output(args: argparse.Namespace, *, remote: bool) -> str:
    """``-o`` (or OUTPUT) through the one resolver of paths and URLs, before any work; never over the input."""
    from iobundle._locations import refuse_overlap
    from iobundle._remote import resolve_output

    output = str(resolve_output(args.output, remote=remote, what=f"iobundle {args.command}"))
    refuse_overlap(args.archive if args.command == "unpack" else args.bundle, output, f"iobundle {args.command}")
    return output


def _cmd_pack(args: argparse.Namespace) -> int:
    from iobundle import load_bundle
    from iobundle.cli._programs import refuse_damaged
    from iobundle.errors import IntegrityError
    from iobundle.travel import pack_bundle

    output = _output(args, remote=True)
    bundle = load_bundle(args.bundle)
    if args.no_verify:
        refuse_damaged(bundle, args.bundle)  # sizes only: a missing file cannot be packed
    else:
        problems = with_progress(args, bundle.verify)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IntegrityError(
                f"{args.bundle}: {problems[0].rstrip('.')}{more}; nothing packed. `iobundle verify {args.bundle}` lists the "
                "damaged files; --no-verify packs a bundle whose files changed anyway."
            )
        if not quiet(args):
            _render.out(f"verified {len(bundle.manifest.files)} tensor files: sizes and hashes match the manifest")
    result = with_progress(args, pack_bundle, args.bundle, output, overwrite=args.overwrite)
    return _moved("packed", result, f" ({result.bytes / max(result.seconds, 1e-9) / 1e6:.0f} MB/s)")


def _cmd_unpack(args: argparse.Namespace) -> int:
    from iobundle.travel import unpack_bundle

    output = _output(args, remote=False)
    result = with_progress(
        args, unpack_bundle, args.archive, output, overwrite=args.overwrite, verify=not args.no_verify
    )
    return _moved("unpacked", result, "" if args.no_verify else ", sizes and hashes checked")


def _cmd_redact(args: argparse.Namespace) -> int:
    from iobundle import redact_bundle

    output = _output(args, remote=True)
    manifest = with_progress(
        args, redact_bundle, args.bundle, output,
        keep_outputs=args.keep_outputs, keep_model=args.keep_model, seed=args.seed, overwrite=args.overwrite,
    )  # fmt: skip
    kept = [
        "outputs " + ("kept" if args.keep_outputs else "dropped"),
        "model " + ("kept" if manifest.model is not None else "dropped" if args.keep_model is False else "none"),
    ]
    _render.out(
        f"redacted {len(manifest.calls)} calls into {args.output}: {len(manifest.tensors)} tensors, "
        f"inputs synthetic (seed {args.seed}), {', '.join(kept)}"
    )
    return 0


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from iobundle import upgrade_bundle

    manifest = with_progress(args, upgrade_bundle, args.bundle, args.output, overwrite=args.overwrite)
    _render.out(
        f"upgraded {args.bundle} into {args.output} (format version {manifest.format_version}): "
        f"{len(manifest.calls)} calls, {len(manifest.tensors)} tensors, verified"
    )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from iobundle import load_bundle
    from iobundle.cli._programs import refuse_damaged
    from iobundle.travel import convert_to_npz, convert_to_onnx_testdata

    output = _output(args, remote=False)
    bundle = load_bundle(args.bundle)
    refuse_damaged(bundle, args.bundle)
    if args.to == "onnx-testdata":
        if not args.model:
            raise CLIError("--to onnx-testdata needs --model MODEL.onnx (its graph names the inputs and outputs).")
        result = with_progress(args, convert_to_onnx_testdata, bundle, args.model, output, overwrite=args.overwrite)
        _render.out(f"wrote {result.calls} test data sets ({len(result.paths)} files) into {args.output}")
    else:
        if args.model:
            raise CLIError("--model is for --to onnx-testdata; --to npz writes the recorded tensors as they are.")
        result = with_progress(args, convert_to_npz, bundle, output, overwrite=args.overwrite)
        _render.out(f"wrote {result.calls} calls into {len(result.paths)} .npz file(s) at {args.output}")
    return 0
