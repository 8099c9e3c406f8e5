"""Open bundles offline; align and infer, export (torch.export, ONNX) and validate (onnxruntime) from them.

:class:`RecordedCallsAPI` is the inference, export and validation API over recorded calls;
:class:`Bundle` offers it from disk and :class:`iobundle.InputObserver` from memory, so both
run the same code. Needs torch, onnx, onnxruntime and onnxscript.
"""

from __future__ import annotations

__all__ = [
    "BatchCheck",
    "Bundle",
    "CallCheck",
    "ExportReport",
    "ObservationInfo",
    "Phase",
    "ProgramSet",
    "RecordedCallsAPI",
    "RecordedInputs",
    "StaticDimHint",
    "StoredModel",
    "ValidationReport",
    "check_discrepancies",
    "describe_bundle_model",
    "export_onnx",
    "export_program",
    "export_programs",
    "load_bundle",
    "load_bundle_model",
    "model_from_factory",
    "partition_calls",
    "static_dim_hints",
    "validate_onnx",
]

from iobundle.replay._api import RecordedCallsAPI
from iobundle.replay._bundle import Bundle, load_bundle
from iobundle.replay._dims import BatchCheck, StaticDimHint, static_dim_hints
from iobundle.replay._export import CallCheck, ExportReport, export_onnx, export_program
from iobundle.replay._factory import model_from_factory
from iobundle.replay._info import ObservationInfo, RecordedInputs
from iobundle.replay._model_load import StoredModel, describe_bundle_model, load_bundle_model
from iobundle.replay._phases import Phase, ProgramSet, export_programs, partition_calls
from iobundle.replay._validate import ValidationReport, check_discrepancies, validate_onnx
