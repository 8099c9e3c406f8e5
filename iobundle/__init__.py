"""iobundle: record a PyTorch model's calls into a portable bundle, replay them offline to export and validate.

``import iobundle`` is cheap: the public names below import torch only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iobundle._version import __version__
from iobundle.errors import (
    AlignmentError,
    BundleError,
    BundleExistsError,
    BundleNotFoundError,
    BundleWriteError,
    CaptureError,
    CLIError,
    DynamicShapeError,
    ExportError,
    IntegrityError,
    IobundleError,
    ManifestError,
    MissingDependencyError,
    ModelLoadError,
    ReplayError,
    TensorFileError,
    ToleranceError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
    UnsupportedInputError,
)

__all__ = [
    # Capture and replay
    "Bundle",
    "InputObserver",
    "__version__",
    "load_bundle",
    # Errors
    "AlignmentError",
    "BundleError",
    "BundleExistsError",
    "BundleNotFoundError",
    "BundleWriteError",
    "CLIError",
    "CaptureError",
    "DynamicShapeError",
    "ExportError",
    "IntegrityError",
    "IobundleError",
    "ManifestError",
    "MissingDependencyError",
    "ModelLoadError",
    "ReplayError",
    "TensorFileError",
    "ToleranceError",
    "UnsafeBundleError",
    "UnsupportedFormatVersionError",
    "UnsupportedInputError",
]

if TYPE_CHECKING:
    from iobundle.observer import InputObserver
    from iobundle.replay import Bundle, load_bundle

_LAZY = {"InputObserver": "iobundle.observer", "Bundle": "iobundle.replay", "load_bundle": "iobundle.replay"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iobundle' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
