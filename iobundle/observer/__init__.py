"""``InputObserver``: both stages in memory, the drop-in API of the observers iobundle replaces.

It records with :class:`iobundle.capture.CallRecorder` and infers, exports and validates with
:class:`iobundle.replay.RecordedCallsAPI`, on top of both; neither imports it.
"""

from __future__ import annotations

__all__ = [
    "InputCandidate",
    "InputObserver",
    "ModuleObservers",
    "ObservationInfo",
    "ObservationWarning",
    "observe_modules",
    "redact_bundle",
    "upgrade_bundle",
]

from iobundle.capture import ObservationWarning
from iobundle.observer._modules import ModuleObservers, observe_modules
from iobundle.observer._observer import InputObserver
from iobundle.observer._redact_bundle import redact_bundle
from iobundle.observer._upgrade import upgrade_bundle
from iobundle.replay import InputCandidate, ObservationInfo
