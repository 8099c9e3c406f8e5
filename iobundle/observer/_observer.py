"""``InputObserver``: record the calls of a model's method, infer export arguments, export, validate, save."""

from __future__ import annotations

from typing import Any

from iobundle.capture import CallRecorder
from iobundle.errors import ObserverArgumentError, ObserverStateError
from iobundle.replay import ObservationInfo, RecordedCallsAPI

__all__ = ["InputObserver"]


class InputObserver(CallRecorder, RecordedCallsAPI):
    """Record the calls a model's method receives; infer export arguments and dynamic shapes; save a bundle.

    A drop-in replacement for ``torch.onnx.InputObserver`` that can also write what it saw to disk.

    Args:
        value_if_missing: Placeholders for arguments present only in some calls, by name or position
            (``{"pixel_values": torch.empty((0, 3, 224, 224))}``). They serve argument and shape
            inference only; the model never receives them.
        missing: The name onnx-diagnostic's observer gives ``value_if_missing``; give one or the other.

    Raises:
        ObserverArgumentError: Both ``value_if_missing`` and ``missing`` are given.

    Example:
        >>> observer = InputObserver()
        >>> with observer(model, store_n_calls=4):
        ...     model.generate(input_ids, max_new_tokens=3)
        >>> observer.save("run.iobundle")
        >>> ep = torch.export.export(model, (), kwargs=observer.infer_arguments(),
        ...                          dynamic_shapes=observer.infer_dynamic_shapes())
    """

    def __init__(
        self, value_if_missing: dict[str | int, Any] | None = None, *, missing: dict[str | int, Any] | None = None
    ) -> None:
        if missing is not None:
            if value_if_missing is not None:
                raise ObserverArgumentError(
                    "InputObserver: give value_if_missing or missing (its older name), not both."
                )
            value_if_missing = missing
        super().__init__(value_if_missing)

    @property
    def info(self) -> ObservationInfo | None:  # type: ignore[override]
        """Per-call records (``info.inputs[i]``, ``info.flat_outputs``, ``info.latencies``); None before any call."""
        try:
            return ObservationInfo(self._recorded())
        except ObserverStateError:  # no `with observer(model):` block yet, as the observers it replaces say
            return None
