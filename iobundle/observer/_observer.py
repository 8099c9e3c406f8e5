"""``InputObserver``: record the calls of a model's method, infer export arguments, export, validate, save."""

from __future__ import annotations

from iobundle.capture import CallRecorder
from iobundle.replay import RecordedCallsAPI

__all__ = ["InputObserver"]


class InputObserver(CallRecorder, RecordedCallsAPI):
    """Record the calls a model's method receives; infer export arguments and dynamic shapes; save a bundle.

    A drop-in replacement for ``torch.onnx.InputObserver`` that can also write what it saw to disk.

    Args:
        value_if_missing: Placeholders for arguments present only in some calls, by name or position
            (``{"pixel_values": torch.empty((0, 3, 224, 224))}``). They serve argument and shape
            inference only; the model never receives them.

    Example:
        >>> observer = InputObserver()
        >>> with observer(model, store_n_calls=4):
        ...     model.generate(input_ids, max_new_tokens=3)
        >>> observer.save("run.iobundle")
        >>> ep = torch.export.export(model, (), kwargs=observer.infer_arguments(),
        ...                          dynamic_shapes=observer.infer_dynamic_shapes())
    """
