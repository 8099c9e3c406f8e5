"""Record a model's calls and write bundles. Needs torch, safetensors and pydantic; never onnx."""

from __future__ import annotations

__all__ = [
    "InputObserver",
    "NodeType",
    "ObservationInfo",
    "ObservationWarning",
    "RecordedCalls",
    "register_node_type",
    "transformers_pytree_nodes",
]

import importlib
from contextlib import AbstractContextManager

from iobundle.capture._calls import RecordedCalls
from iobundle.capture._observer import InputObserver, ObservationInfo, ObservationWarning
from iobundle.capture._registry import NodeType, register_node_type, register_provider

register_provider("transformers", lambda: importlib.import_module("iobundle.capture._transformers").register_all())


def transformers_pytree_nodes() -> AbstractContextManager[None]:
    """Register transformers' caches with ``torch.utils._pytree`` for the duration of a ``with`` block.

    iobundle needs no registration to observe, save, load or export. This is for code that calls
    ``torch.export`` itself with a ``DynamicCache``/``EncoderDecoderCache``/``StaticCache`` among its
    inputs: the layouts are iobundle's (per-layer key and value tensors, nothing that varies between
    calls in the context). Any registration present before is restored on exit. Needs transformers.

    Example:
        >>> with transformers_pytree_nodes():
        ...     ep = torch.export.export(model, (), kwargs=bundle.infer_arguments(),
        ...                              dynamic_shapes=bundle.infer_dynamic_shapes())
    """
    from iobundle.capture._transformers import torch_pytree_nodes

    return torch_pytree_nodes()
