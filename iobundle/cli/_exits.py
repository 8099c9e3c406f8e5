"""Exit codes and hints: one code per condition, the same in every command, and what to do about each error.

The table here is the one the README's "Exit codes" section and ``iobundle --help`` show;
``tests/cli/test_exit_codes.py`` runs every command on the same damaged bundles against it. An
error's code and hint are those of the first class of its MRO found in :data:`EXIT_CODES` /
:data:`HINTS`.
"""

from __future__ import annotations

from typing import TypeVar

from iobundle.errors import (
    AlignmentError,
    ArchiveError,
    BundleExistsError,
    BundleNotFoundError,
    BundleWriteError,
    CLIError,
    DynamicShapeError,
    ExportError,
    IobundleError,
    ManifestError,
    MissingDependencyError,
    ModelLoadError,
    NothingToCompareError,
    TensorFileError,
    ToleranceError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
)

__all__ = [
    "DEBUG_ENV",
    "EXIT_CHECK_FAILED",
    "EXIT_DAMAGED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOTHING_TO_COMPARE",
    "EXIT_OK",
    "EXIT_USAGE",
    "exit_code_for",
    "hint_for",
]

DEBUG_ENV = "IOBUNDLE_DEBUG"

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
"""A check failed: a recorded call differs or fails to run (validate, run, export), the bundles differ (diff)."""
EXIT_USAGE = 2
"""Bad usage: a flag or its value, a path or URL that does not exist, an output that exists (without
--overwrite) or cannot be written, an unknown URL protocol, a missing optional dependency, a model
that cannot be loaded or does not fit the bundle (argparse also exits with 2)."""
EXIT_FAILED = 3
"""The bundle was read but the operation failed: calls that cannot be aligned, a rank that changes, ..."""
EXIT_NOTHING_TO_COMPARE = 4
"""validate, run: the bundle holds no recorded outputs (redacted without them); diff: a bundle holds no calls."""
EXIT_DAMAGED = 5
"""The bundle is damaged: manifest.json invalid or unsafe, a listed file missing, truncated or changed
(its size or hash differs), a packed file that is not a valid archive. verify included."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (what was printed until then stays printed)."""

EXIT_CODES: dict[type[IobundleError], int] = {
    CLIError: EXIT_USAGE,
    BundleNotFoundError: EXIT_USAGE,
    BundleExistsError: EXIT_USAGE,
    BundleWriteError: EXIT_USAGE,
    MissingDependencyError: EXIT_USAGE,
    ModelLoadError: EXIT_USAGE,
    ToleranceError: EXIT_USAGE,
    ManifestError: EXIT_DAMAGED,
    TensorFileError: EXIT_DAMAGED,
    ArchiveError: EXIT_DAMAGED,
    ExportError: EXIT_CHECK_FAILED,
    NothingToCompareError: EXIT_NOTHING_TO_COMPARE,
}
"""Anything not found here (alignment, dynamic shapes, other replay errors) is :data:`EXIT_FAILED`."""

_V = TypeVar("_V")

HINTS: dict[type[IobundleError], str] = {
    CLIError: "see 'iobundle {command} --help'",
    BundleNotFoundError: "check the path: give the directory written by observer.save(), a file written by "
    "`iobundle pack`, or the URL of either",
    BundleExistsError: "pass --overwrite to replace it, or choose another output path",
    BundleWriteError: "check that the output's folder exists and is writable, and that the disk has room",
    MissingDependencyError: "install what the message names, then run the command again",
    ModelLoadError: "check MODULE:FACTORY (importable from here, returning a torch.nn.Module) or the path of the "
    "ONNX model, and that the model was exported from this bundle",
    ToleranceError: "`iobundle inspect BUNDLE` lists the recorded outputs; NAME in --atol NAME=VALUE is one of their "
    "names or an fnmatch pattern",
    UnsupportedFormatVersionError: "upgrade iobundle (pip install -U iobundle) to read this bundle",
    UnsafeBundleError: "the bundle asks for something a bundle may never do: do not use it; ask its author for a "
    "bundle written by observer.save()",
    ManifestError: "the bundle is damaged or was not written by iobundle: copy it again, or ask its author for a "
    "fresh one",
    TensorFileError: "run `iobundle verify BUNDLE` to list every damaged file, then copy the bundle again (or record "
    "it again)",
    ArchiveError: "pack the bundle again with `iobundle pack`, or copy the file again",
    AlignmentError: "`iobundle inspect BUNDLE` shows the recorded calls; record calls that agree on their constants "
    "and structure",
    DynamicShapeError: "`iobundle inspect BUNDLE` shows each call's shapes; record calls of one rank per input",
    ExportError: "-v shows the exporter's own log lines; when recorded calls differ, the table above names them "
    "and --no-check writes the ONNX file anyway",
    NothingToCompareError: "record the bundle with its outputs (or `iobundle redact --keep-outputs`); "
    "`iobundle export` still checks the program against the eager model",
}

OVERWRITE_REFUSED = (
    "--overwrite replaces only what iobundle wrote there itself: choose another output path, or remove it yourself"
)


def _lookup(table: dict[type[IobundleError], _V], exc: IobundleError) -> _V | None:
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return None


def exit_code_for(exc: IobundleError) -> int:
    """The exit code for an error (see :data:`EXIT_CODES`; :data:`EXIT_FAILED` for anything else)."""
    code = _lookup(EXIT_CODES, exc)
    return EXIT_FAILED if code is None else code


def hint_for(exc: IobundleError, command: str, *, overwrite: bool = False) -> str:
    """What to do about ``exc``, in a few words; the debug variable for the full traceback.

    The error's own ``hint`` wins over its class's; an output that exists although ``--overwrite``
    was given is one iobundle never replaces, so passing it again is not the hint.
    """
    hint = exc.hint or (OVERWRITE_REFUSED if overwrite and isinstance(exc, BundleExistsError) else None)
    hint = hint or _lookup(HINTS, exc)
    debug = f"{DEBUG_ENV}=1 shows the full traceback"
    if hint is None:
        return f"set {debug.replace(' shows', ' to see')}"
    text = str(hint).format(command=command)
    return text if isinstance(exc, CLIError) else f"{text} ({debug})"
