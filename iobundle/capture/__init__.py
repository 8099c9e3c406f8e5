"""Record a model's calls and write bundles. Needs torch, safetensors and pydantic; never onnx.

:class:`CallRecorder` wraps a model's method for the duration of a ``with`` block, snapshots
each call's inputs before it runs and its outputs after, and keeps the calls in memory or
streams them to a bundle; ``save()`` writes a bundle. Inference, export and validation are
replay's; :class:`iobundle.InputObserver` offers both stages together.
"""

from __future__ import annotations

__all__ = [
    "CallRecorder",
    "NodeType",
    "ObservationWarning",
    "RecordedCalls",
    "register_node_type",
    "save_recorded_calls",
    "transformers_pytree_nodes",
]

from iobundle.calls import NodeType, RecordedCalls, register_node_type, transformers_pytree_nodes
from iobundle.capture._recorder import CallRecorder, ObservationWarning
from iobundle.capture._writer import save_recorded_calls
