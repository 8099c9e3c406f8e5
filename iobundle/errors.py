"""The exception tree of iobundle. Stdlib imports only.

Every error a user can trigger is a subclass of :class:`IobundleError`, so
``except iobundle.IobundleError`` catches everything iobundle raises on purpose::

    IobundleError
    ├── MissingDependencyError(ImportError)    an optional package is missing; says what to install
    ├── CLIError                               bad flag combination on the command line
    ├── BundleError
    │   ├── BundleNotFoundError(FileNotFoundError)
    │   ├── BundleExistsError(FileExistsError)
    │   ├── BundleWriteError(OSError)          disk full, permission denied, ...
    │   ├── ArchiveError(ValueError)           a packed bundle is not a valid archive, or holds a link, a
    │   │                                      path out, a duplicate, a member past its end (.member)
    │   ├── ManifestError(ValueError)          manifest.json unreadable or invalid
    │   │   ├── UnsupportedFormatVersionError  .found, .supported
    │   │   └── UnsafeBundleError              a path outside the bundle, an unknown node type, a limit
    │   └── TensorFileError                    a tensor file missing, truncated, corrupt or inconsistent
    │       └── IntegrityError                 a file's size or XXH3-128 digest differs from the manifest
    ├── CaptureError
    │   ├── ObserverArgumentError(ValueError)  a method the model lacks, a value_if_missing name or
    │   │                                      position outside the signature, a bad include_model
    │   ├── ObserverArgumentTypeError(TypeError)  a value_if_missing key that is neither a name nor a position
    │   ├── ObserverStateError(RuntimeError)   nothing observed yet, a nested streaming block
    │   └── UnsupportedInputError(TypeError)   .call_index, .arg_path
    └── ReplayError
        ├── AlignmentError(RuntimeError)       recorded calls do not line up
        │   └── InputSelectionError(ValueError)  remove_inputs / dim_names / infer_arguments: a position
        │                                        outside the signature, a variadic, an argument of the wrong kind
        ├── DynamicShapeError(RuntimeError)    calls disagree on a tensor's rank
        ├── ModelLoadError                     a model (MODULE:FACTORY, an ONNX file) cannot be loaded
        ├── ExportError                        torch.export / torch.onnx failed, or .report says which calls differ
        ├── ToleranceError(ValueError)         a per-output tolerance names no output, an unknown error statistic
        └── NothingToCompareError              the bundle holds no recorded outputs (redacted without them)

Errors that fit both worlds
---------------------------

The observers iobundle replaces (``torch.onnx.InputObserver``, yobx's and onnx-diagnostic's
``InputObserver``) raise builtin exceptions, and code written for them catches those. Each
class above that stands for one of their conditions also derives from the builtin they raise
for it, so such code runs unchanged:

=================================================  ============================  ========================
condition (what the anchors raise)                 iobundle raises               also a
=================================================  ============================  ========================
calls cannot be aligned: different constants,      AlignmentError                RuntimeError
an argument flattening to another number of
tensors, no call holding every keyword, no call
recorded, a call index out of range
nothing observed yet (``infer_*``,                 ObserverStateError            RuntimeError
``remove_inputs`` before any ``with``)
a tensor changes rank across calls                 DynamicShapeError             RuntimeError
``observer(model, method_name=...)`` of a          ObserverArgumentError         ValueError
method the model lacks; a ``value_if_missing``
name or position outside the signature
a ``value_if_missing`` key of the wrong type       ObserverArgumentTypeError     TypeError
``remove_inputs`` of a position outside the        InputSelectionError           ValueError (and
signature or of a variadic that cannot go;                                       RuntimeError, as an
``infer_arguments`` of an unexpected type; a                                     AlignmentError)
bad ``dim_names``
a value that cannot be recorded                    UnsupportedInputError         TypeError
=================================================  ============================  ========================

Where the anchors raise ``NotImplementedError`` (a ``value_if_missing`` position beyond the
arguments given, a best call that is not aligned, calls holding different numbers of aligned
tensors), iobundle handles the case instead (see ``docs/PARITY.md``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlignmentError",
    "ArchiveError",
    "BundleError",
    "BundleExistsError",
    "BundleNotFoundError",
    "BundleWriteError",
    "CLIError",
    "CaptureError",
    "DynamicShapeError",
    "ExportError",
    "InputSelectionError",
    "ToleranceError",
    "IntegrityError",
    "IobundleError",
    "ManifestError",
    "MissingDependencyError",
    "ModelLoadError",
    "NothingToCompareError",
    "ObserverArgumentError",
    "ObserverArgumentTypeError",
    "ObserverStateError",
    "ReplayError",
    "TensorFileError",
    "UnsafeBundleError",
    "UnsupportedFormatVersionError",
    "UnsupportedInputError",
]


class IobundleError(Exception):
    """Root of every error iobundle raises on purpose.

    ``hint`` (keyword only) says what to do about this condition when the class's own hint (the
    command line's, :mod:`iobundle.cli._exits`) would not fit it.
    """

    def __init__(self, *args: Any, hint: str | None = None) -> None:
        super().__init__(*args)
        self.hint = hint


class MissingDependencyError(IobundleError, ImportError):
    """An optional dependency is not installed; the message gives the pip command."""


class CLIError(IobundleError):
    """Bad usage of the command line; printed as one line, without a traceback."""


class BundleError(IobundleError):
    """A bundle cannot be read or written."""


class BundleNotFoundError(BundleError, FileNotFoundError):
    """The path is not a bundle (missing, or no manifest.json in it)."""


class BundleExistsError(BundleError, FileExistsError):
    """The target directory already holds files and ``overwrite`` is False."""


class BundleWriteError(BundleError, OSError):
    """Writing a bundle failed (disk full, permission denied, ...)."""


class ArchiveError(BundleError, ValueError):
    """A packed bundle is not a valid uncompressed tar, or holds an entry a bundle may not; ``.member`` names it."""

    def __init__(self, message: str, *, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member


class ManifestError(BundleError, ValueError):
    """``manifest.json`` is unreadable or does not match the format."""


class UnsupportedFormatVersionError(ManifestError):
    """The manifest declares a format or version this iobundle cannot read."""

    def __init__(self, message: str, *, found: Any, supported: Any) -> None:
        super().__init__(message)
        self.found = found
        self.supported = supported


class UnsafeBundleError(ManifestError):
    """The manifest asks for something a bundle may never do (escape its directory, name unknown code, exceed a limit)."""


class TensorFileError(BundleError):
    """A tensor file is missing, truncated, corrupt, or disagrees with the manifest."""


class IntegrityError(TensorFileError):
    """A file's size or XXH3-128 digest differs from what the manifest records."""


class CaptureError(IobundleError):
    """Recording calls failed in a way the caller must fix."""


class ObserverArgumentError(CaptureError, ValueError):
    """A bad argument to the observer: a method the model lacks, a ``value_if_missing`` key outside the signature."""


class ObserverArgumentTypeError(CaptureError, TypeError):
    """An argument of the observer has the wrong type (a ``value_if_missing`` key neither a name nor a position)."""


class ObserverStateError(CaptureError, RuntimeError):
    """The observer cannot do this now: nothing was observed yet, or a block already streams."""


class UnsupportedInputError(CaptureError, TypeError):
    """A value passed to the observed method cannot be recorded."""

    def __init__(self, message: str, *, call_index: int | None = None, arg_path: str | None = None) -> None:
        super().__init__(message)
        self.call_index = call_index
        self.arg_path = arg_path


class ReplayError(IobundleError):
    """Inference, export or validation from recorded calls failed."""


class AlignmentError(ReplayError, RuntimeError):
    """The recorded calls cannot be aligned on one structure."""


class InputSelectionError(AlignmentError, ValueError):
    """An input named or chosen by the caller cannot be used: unknown, a variadic, or of the wrong kind."""


class DynamicShapeError(ReplayError, RuntimeError):
    """The recorded calls disagree on a tensor in a way no dynamic shape can describe."""


class ModelLoadError(ReplayError):
    """A model cannot be loaded: a ``MODULE:FACTORY`` reference, an ONNX file, a model stored in a bundle."""


class ExportError(ReplayError):
    """Exporting failed, or the exported program disagrees with recorded calls (see ``.report``)."""

    def __init__(self, message: str, *, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class NothingToCompareError(ReplayError):
    """Validation was asked for, but the bundle holds no recorded outputs (``iobundle redact`` dropped them)."""


class ToleranceError(ReplayError, ValueError):
    """The comparison options are wrong: a per-output tolerance that names no output, an unknown statistic."""
