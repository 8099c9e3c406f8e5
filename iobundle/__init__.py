"""iobundle: record a PyTorch model's calls into a portable bundle, replay them offline to export and validate.

``import iobundle`` is cheap: the public names below import torch only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iobundle.errors import (
    AlignmentError,
    BundleError,
    BundleExistsError,
    BundleNotFoundError,
    CaptureError,
    ExportError,
    IntegrityError,
    IobundleError,
    ManifestError,
    ReplayError,
    TensorFileError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
)

__version__ = "0.1.0"

__all__ = [
    # Errors
    "AlignmentError",
    # Capture and replay
    "Bundle",
    "BundleError",
    "BundleExistsError",
    "BundleNotFoundError",
    "CaptureError",
    "ExportError",
    "InputObserver",
    "IntegrityError",
    "IobundleError",
    "ManifestError",
    "ReplayError",
    "TensorFileError",
    "UnsafeBundleError",
    "UnsupportedFormatVersionError",
    "__version__",
    "load_bundle",
]

if TYPE_CHECKING:
    from iobundle.capture import InputObserver
    from iobundle.replay import Bundle, load_bundle

_LAZY = {"InputObserver": "iobundle.capture", "Bundle": "iobundle.replay", "load_bundle": "iobundle.replay"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iobundle' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
