"""``InputObserver``: both stages in memory, the drop-in API of the observers iobundle replaces.

It records with :class:`iobundle.capture.CallRecorder` and infers, exports and validates with
:class:`iobundle.replay.RecordedCallsAPI`, on top of both; neither imports it.
"""

from __future__ import annotations

__all__ = ["InputCandidate", "InputObserver", "ObservationInfo", "ObservationWarning"]

from iobundle.capture import ObservationWarning
from iobundle.observer._observer import InputObserver
from iobundle.replay import InputCandidate, ObservationInfo
