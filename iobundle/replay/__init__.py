"""Open bundles offline; align and infer, export (torch.export, ONNX) and validate (onnxruntime) from them.

:class:`RecordedCallsAPI` is the inference, export and validation API over recorded calls;
:class:`Bundle` offers it from disk and :class:`iobundle.InputObserver` from memory, so both
run the same code. Needs torch; onnx,
onnxruntime and onnxscript only to export and validate. The names below are imported when first
used: ``import iobundle.replay`` and opening a bundle load no onnx. Each job is a room with its own
public face: :mod:`iobundle.replay.infer`, :mod:`iobundle.replay.export`, :mod:`iobundle.replay.check`;
packing, converting and redacting are :mod:`iobundle.travel`'s. ``__all__`` is the public face; the other
names imported below serve iobundle's other parts (travel, observer, cli).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import lazy_names

__all__ = [
    # Open a bundle, infer from it
    "Bundle",
    "InputCandidate",
    "ObservationInfo",
    "ProgressEvent",
    "RecordedCallsAPI",
    "StaticDimHint",
    "StoredModel",
    "load_bundle",
    "load_bundle_model",
    # Export
    "BatchCheck",
    "CallCheck",
    "ExportReport",
    "ExportResult",
    "Phase",
    "ProgramSet",
    "cut_call",
    "export_onnx",
    "export_program",
    "export_programs",
    # Check, compare, report
    "DiffReport",
    "ErrorStats",
    "OutputCheck",
    "Report",
    "Tolerances",
    "ValidationReport",
    "build_report",
    "check_discrepancies",
    "diff_bundles",
    "rerun_model",
    "validate_onnx",
]

if TYPE_CHECKING:
    from iobundle._progress import ProgressEvent
    from iobundle.replay._api import RecordedCallsAPI
    from iobundle.replay._bundle import Bundle, load_bundle
    from iobundle.replay._diff import DiffReport, diff_bundles
    from iobundle.replay._model_load import StoredModel, load_bundle_model
    from iobundle.replay._report import Report, build_report
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
        cut_call,
        export_onnx,
        export_program,
        export_programs,
    )
    from iobundle.replay.infer import InputCandidate, ObservationInfo, StaticDimHint

if TYPE_CHECKING:  # not public: for iobundle's other parts (travel, cli) and the tests
    from iobundle.replay._api import recorded_calls  # noqa: F401
    from iobundle.replay._factory import model_from_factory  # noqa: F401
    from iobundle.replay._model_load import describe_bundle_model  # noqa: F401
    from iobundle.replay._report import build_export_report  # noqa: F401
    from iobundle.replay.export import partition_calls  # noqa: F401
    from iobundle.replay.infer import DYNAMIC, static_dim_hints  # noqa: F401

__getattr__ = lazy_names(__name__)
