"""Check a model against recorded calls: compare outputs, validate an ONNX model, re-run a model.

Below ``export`` (which compares its programs with these tools) and above ``infer``.
Validation needs onnx and onnxruntime. Internal tier: the public names are :mod:`iobundle.replay`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import lazy_names

__all__ = [
    # Compare outputs
    "DTYPE_TOLERANCES",
    "Comparison",
    "ErrorStats",
    "OutputCheck",
    "Scratch",
    "Tolerances",
    "check_error_stat_name",
    "compare_call",
    "compare_outputs",
    "flatten_outputs",
    "output_paths",
    "refuse_unknown_outputs",
    "refuse_unused",
    # Validate an ONNX model
    "INPUT_SLOTS_KEY",
    "OUTPUT_NAMES_KEY",
    "OUTPUT_PATHS_KEY",
    "ValidationReport",
    "check_discrepancies",
    "input_mapping",
    "model_label",
    "onnx_model_file",
    "output_mapping",
    "read_metadata",
    "recorded_output_names",
    "validate_onnx",
    "float32_copy",
    # Re-run a model
    "rerun_model",
]

if TYPE_CHECKING:
    from iobundle.replay.check._compare import (
        Comparison,
        ErrorStats,
        OutputCheck,
        Scratch,
        compare_call,
        compare_outputs,
        flatten_outputs,
        output_paths,
    )
    from iobundle.replay.check._rerun import rerun_model
    from iobundle.replay.check._tolerances import DTYPE_TOLERANCES, Tolerances, check_error_stat_name
    from iobundle.replay.check._validate import (
        INPUT_SLOTS_KEY,
        OUTPUT_NAMES_KEY,
        OUTPUT_PATHS_KEY,
        ValidationReport,
        check_discrepancies,
        input_mapping,
        model_label,
        onnx_model_file,
        output_mapping,
        read_metadata,
        recorded_output_names,
        refuse_unknown_outputs,
        refuse_unused,
        validate_onnx,
    )
    from iobundle.replay.check._widen import float32_copy

# Imported when first used: the comparison value (Tolerances) loads neither torch nor onnx,
# so RecordedCallsAPI can use it at class definition without paying for the room.
__getattr__ = lazy_names(__name__)
