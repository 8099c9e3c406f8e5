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
    "ConvertResult",
    "DiffReport",
    "ErrorStats",
    "ExportReport",
    "InputCandidate",
    "ObservationInfo",
    "Phase",
    "ProgramSet",
    "StaticDimHint",
    "PackResult",
    "RecordedCallsAPI",
    "OutputCheck",
    "ProgressEvent",
    "Report",
    "StoredModel",
    "Tolerances",
    "ValidationReport",
    "build_report",
    "check_discrepancies",
    "convert_to_npz",
    "convert_to_onnx_testdata",
    "copy_model_files",
    "describe_bundle_model",
    "diff_bundles",
    "export_onnx",
    "export_program",
    "export_programs",
    "load_bundle",
    "load_bundle_model",
    "model_from_factory",
    "partition_calls",
    "static_dim_hints",
    "pack_bundle",
    "redact_calls",
    "unpack_bundle",
    "rerun_model",
    "validate_onnx",
]

from iobundle._progress import ProgressEvent
from iobundle.replay._api import RecordedCallsAPI
from iobundle.replay._archive import PackResult, pack_bundle, unpack_bundle
from iobundle.replay._bundle import Bundle, load_bundle
from iobundle.replay._diff import DiffReport, diff_bundles
from iobundle.replay._factory import model_from_factory
from iobundle.replay._model_load import StoredModel, describe_bundle_model, load_bundle_model
from iobundle.replay._report import Report, build_report
from iobundle.replay.check._compare import ErrorStats, OutputCheck, Tolerances
from iobundle.replay.check._rerun import rerun_model
from iobundle.replay.check._validate import ValidationReport, check_discrepancies, validate_onnx
from iobundle.replay.export._dims import BatchCheck, StaticDimHint, static_dim_hints
from iobundle.replay.export._export import CallCheck, ExportReport, export_onnx, export_program
from iobundle.replay.export._phases import Phase, ProgramSet, export_programs, partition_calls
from iobundle.replay.infer._info import InputCandidate, ObservationInfo
from iobundle.travel._convert import ConvertResult, convert_to_npz, convert_to_onnx_testdata
from iobundle.travel._redact import copy_model_files, redact_calls
