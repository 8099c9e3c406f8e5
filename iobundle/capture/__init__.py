"""Record a model's calls and write bundles. Needs torch, safetensors and pydantic; never onnx."""

from __future__ import annotations

__all__ = ["InputObserver", "NodeType", "ObservationInfo", "ObservationWarning", "RecordedCalls", "register_node_type"]

import importlib

from iobundle.capture._calls import RecordedCalls
from iobundle.capture._observer import InputObserver, ObservationInfo, ObservationWarning
from iobundle.capture._registry import NodeType, register_node_type, register_provider

register_provider("transformers", lambda: importlib.import_module("iobundle.capture._transformers").register_all())
