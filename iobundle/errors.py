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
    │   ├── ManifestError(ValueError)          manifest.json unreadable or invalid
    │   │   ├── UnsupportedFormatVersionError  .found, .supported
    │   │   └── UnsafeBundleError              a path outside the bundle, an unknown node type, a limit
    │   └── TensorFileError                    a tensor file missing, truncated, corrupt or inconsistent
    │       └── IntegrityError                 a file's size or sha256 differs from the manifest
    ├── CaptureError
    │   └── UnsupportedInputError(TypeError)   .call_index, .arg_path
    └── ReplayError
        ├── AlignmentError                     recorded calls do not line up
        ├── DynamicShapeError                  calls disagree on a tensor's rank
        ├── ModelLoadError                     a model (MODULE:FACTORY, an ONNX file) cannot be loaded
        ├── ExportError                        torch.export / torch.onnx failed, or .report says which calls differ
        ├── ToleranceError(ValueError)         a per-output tolerance names no output, an unknown error statistic
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlignmentError",
    "BundleError",
    "BundleExistsError",
    "BundleNotFoundError",
    "BundleWriteError",
    "CLIError",
    "CaptureError",
    "DynamicShapeError",
    "ExportError",
    "ToleranceError",
    "IntegrityError",
    "IobundleError",
    "ManifestError",
    "MissingDependencyError",
    "ModelLoadError",
    "ReplayError",
    "TensorFileError",
    "UnsafeBundleError",
    "UnsupportedFormatVersionError",
    "UnsupportedInputError",
]


class IobundleError(Exception):
    """Root of every error iobundle raises on purpose."""


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
    """A file's size or sha256 differs from what the manifest records."""


class CaptureError(IobundleError):
    """Recording calls failed in a way the caller must fix."""


class UnsupportedInputError(CaptureError, TypeError):
    """A value passed to the observed method cannot be recorded."""

    def __init__(self, message: str, *, call_index: int | None = None, arg_path: str | None = None) -> None:
        super().__init__(message)
        self.call_index = call_index
        self.arg_path = arg_path


class ReplayError(IobundleError):
    """Inference, export or validation from recorded calls failed."""


class AlignmentError(ReplayError):
    """The recorded calls cannot be aligned on one structure."""


class DynamicShapeError(ReplayError):
    """The recorded calls disagree on a tensor in a way no dynamic shape can describe."""


class ModelLoadError(ReplayError):
    """A model cannot be loaded: a ``MODULE:FACTORY`` reference, an ONNX file, a model stored in a bundle."""


class ExportError(ReplayError):
    """Exporting failed, or the exported program disagrees with recorded calls (see ``.report``)."""

    def __init__(self, message: str, *, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class ToleranceError(ReplayError, ValueError):
    """The comparison options are wrong: a per-output tolerance that names no output, an unknown statistic."""
