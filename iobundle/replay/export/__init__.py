"""Export recorded calls' model: torch.export and ONNX, programs per phase, scoped patches, batch checks.

On top of ``infer`` and ``check`` (each exported program is checked against the recorded calls).
ONNX export needs onnx and onnxscript, imported when a program is converted.
Internal tier: the public names are :mod:`iobundle.replay`'s.
"""

from __future__ import annotations

__all__ = [
    # Export one program
    "CallCheck",
    "ExportReport",
    "ExportResult",
    "SplitProgram",
    "export_onnx",
    "export_program",
    "save_onnx",
    # Programs per phase
    "Phase",
    "ProgramSet",
    "ProgramsMode",
    "export_programs",
    "partition_calls",
    # The batch check
    "BatchCheck",
    "cut_call",
    "explain_guard",
]

from iobundle.replay.export._call_checks import CallCheck, ExportReport
from iobundle.replay.export._dims import BatchCheck, cut_call, explain_guard
from iobundle.replay.export._export import ExportResult, SplitProgram, export_program
from iobundle.replay.export._onnx_save import export_onnx, save_onnx
from iobundle.replay.export._phases import Phase, ProgramSet, ProgramsMode, export_programs, partition_calls
