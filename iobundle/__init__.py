"""iobundle: record a PyTorch model's calls into a portable bundle, replay them offline to export and validate.

``import iobundle`` is cheap: the public names below import torch only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle import errors
from iobundle._lazy import lazy_names
from iobundle._version import __version__
from iobundle.errors import *  # noqa: F403 (the whole exception tree, listed once in errors.__all__)

__all__ = [
    # Capture and replay
    "Bundle",
    "InputCandidate",
    "InputObserver",
    "__version__",
    "load_bundle",
    "observe_modules",
    "redact_bundle",
    "upgrade_bundle",
]
__all__ += errors.__all__  # the exception tree

if TYPE_CHECKING:
    from iobundle.observer import InputCandidate, InputObserver, observe_modules, redact_bundle, upgrade_bundle
    from iobundle.replay import Bundle, load_bundle

__getattr__ = lazy_names(__name__)  # each name from where the TYPE_CHECKING block imports it
