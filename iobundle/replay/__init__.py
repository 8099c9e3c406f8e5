"""Open bundles offline; align and infer, export (torch.export, ONNX) and validate (onnxruntime) from them.

:class:`RecordedCallsAPI` is the inference, export and validation API over recorded calls;
:class:`Bundle` offers it from disk and :class:`iobundle.InputObserver` from memory, so both
run the same code. Needs torch; onnx,
onnxruntime and onnxscript only to export and validate. The names below are imported when first
used: ``import iobundle.replay`` and opening a bundle load no onnx. Each job is a room with its own
public face: :mod:`iobundle.replay.infer`, :mod:`iobundle.replay.export`, :mod:`iobundle.replay.check`;
packing, converting and redacting are :mod:`iobundle.travel`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import lazy_names

__all__ = [
    "DYNAMIC",
    "ArchiveRoot",
    "BatchCheck",
    "Bundle",
    "CallCheck",
    "DiffReport",
    "ErrorStats",
    "ExportReport",
    "ExportResult",
    "InputCandidate",
    "ObservationInfo",
    "Phase",
    "ProgramSet",
    "StaticDimHint",
    "RecordedCallsAPI",
    "OutputCheck",
    "ProgressEvent",
    "Report",
    "StoredModel",
    "Tolerances",
    "ValidationReport",
    "build_export_report",
    "build_report",
    "check_discrepancies",
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
    "recorded_calls",
    "rerun_model",
    "validate_onnx",
]

if TYPE_CHECKING:
    from iobundle._progress import ProgressEvent
    from iobundle.replay._api import RecordedCallsAPI, recorded_calls
    from iobundle.replay._archive import ArchiveRoot
    from iobundle.replay._bundle import Bundle, load_bundle
    from iobundle.replay._diff import DiffReport, diff_bundles
    from iobundle.replay._factory import model_from_factory
    from iobundle.replay._model_load import StoredModel, describe_bundle_model, load_bundle_model
    from iobundle.replay._report import Report, build_export_report, build_report
    from iobundle.replay.check import (
        ErrorStats,
        OutputCheck,
        Tolerances,
        ValidationReport,
        check_discrepancies,
        rerun_model,
        validate_onnx,
    )
    from iobundle.replay.export import (
        BatchCheck,
        CallCheck,
        ExportReport,
        ExportResult,
        Phase,
        ProgramSet,
        export_onnx,
        export_program,
        export_programs,
        partition_calls,
    )
    from iobundle.replay.infer import DYNAMIC, InputCandidate, ObservationInfo, StaticDimHint, static_dim_hints

_LAZY = {
    "DYNAMIC": "iobundle.replay.infer",
    "ArchiveRoot": "iobundle.replay._archive",
    "BatchCheck": "iobundle.replay.export",
    "Bundle": "iobundle.replay._bundle",
    "CallCheck": "iobundle.replay.export",
    "DiffReport": "iobundle.replay._diff",
    "ErrorStats": "iobundle.replay.check",
    "ExportReport": "iobundle.replay.export",
    "ExportResult": "iobundle.replay.export",
    "InputCandidate": "iobundle.replay.infer",
    "ObservationInfo": "iobundle.replay.infer",
    "OutputCheck": "iobundle.replay.check",
    "Phase": "iobundle.replay.export",
    "ProgramSet": "iobundle.replay.export",
    "ProgressEvent": "iobundle._progress",
    "RecordedCallsAPI": "iobundle.replay._api",
    "recorded_calls": "iobundle.replay._api",
    "Report": "iobundle.replay._report",
    "StaticDimHint": "iobundle.replay.infer",
    "StoredModel": "iobundle.replay._model_load",
    "Tolerances": "iobundle.replay.check",
    "ValidationReport": "iobundle.replay.check",
    "build_export_report": "iobundle.replay._report",
    "build_report": "iobundle.replay._report",
    "check_discrepancies": "iobundle.replay.check",
    "describe_bundle_model": "iobundle.replay._model_load",
    "diff_bundles": "iobundle.replay._diff",
    "export_onnx": "iobundle.replay.export",
    "export_program": "iobundle.replay.export",
    "export_programs": "iobundle.replay.export",
    "load_bundle": "iobundle.replay._bundle",
    "load_bundle_model": "iobundle.replay._model_load",
    "model_from_factory": "iobundle.replay._factory",
    "partition_calls": "iobundle.replay.export",
    "rerun_model": "iobundle.replay.check",
    "static_dim_hints": "iobundle.replay.infer",
    "validate_onnx": "iobundle.replay.check",
}


__getattr__ = lazy_names(__name__, _LAZY)
