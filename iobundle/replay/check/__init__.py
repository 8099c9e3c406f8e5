"""Check a model against recorded calls: compare outputs, validate an ONNX model, re-run a model.

Below ``export`` (which compares its programs with these tools) and above ``infer``.
Validation needs onnx and onnxruntime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import lazy_names

__all__ = [
    # Compare outputs
    "DTYPE_TOLERANCES",
    "TOLERANCE_OPTION_DOCS",
    "Comparison",
    "ErrorStats",
    "OutputCheck",
    "Scratch",
    "Tolerances",
    "check_error_stat_name",
    "compare_call",
    "compare_outputs",
    "flatten_outputs",
    "output_leaves",
    "output_paths",
    "refuse_unknown_outputs",
    "refuse_unused",
    "tolerance_options",
    # Validate an ONNX model
    "INPUT_SLOTS_KEY",
    "OUTPUT_NAMES_KEY",
    "OUTPUT_PATHS_KEY",
    "ValidationReport",
    "check_discrepancies",
    "input_mapping",
    "model_label",
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
        DTYPE_TOLERANCES,
        TOLERANCE_OPTION_DOCS,
        Comparison,
        ErrorStats,
        OutputCheck,
        Scratch,
        Tolerances,
        check_error_stat_name,
        compare_call,
        compare_outputs,
        flatten_outputs,
        output_leaves,
        output_paths,
        tolerance_options,
    )
    from iobundle.replay.check._rerun import rerun_model
    from iobundle.replay.check._validate import (
        INPUT_SLOTS_KEY,
        OUTPUT_NAMES_KEY,
        OUTPUT_PATHS_KEY,
        ValidationReport,
        check_discrepancies,
        input_mapping,
        model_label,
        output_mapping,
        read_metadata,
        recorded_output_names,
        refuse_unknown_outputs,
        refuse_unused,
        validate_onnx,
    )
    from iobundle.replay.check._widen import float32_copy

# Imported when first used: the comparison value (and its decorator) load neither torch nor onnx,
# so RecordedCallsAPI can use them at class definition without paying for the room.
_LAZY = {
    "Comparison": "iobundle.replay.check._compare",
    "DTYPE_TOLERANCES": "iobundle.replay.check._compare",
    "TOLERANCE_OPTION_DOCS": "iobundle.replay.check._compare",
    "ErrorStats": "iobundle.replay.check._compare",
    "INPUT_SLOTS_KEY": "iobundle.replay.check._validate",
    "OUTPUT_NAMES_KEY": "iobundle.replay.check._validate",
    "OUTPUT_PATHS_KEY": "iobundle.replay.check._validate",
    "OutputCheck": "iobundle.replay.check._compare",
    "Scratch": "iobundle.replay.check._compare",
    "Tolerances": "iobundle.replay.check._compare",
    "ValidationReport": "iobundle.replay.check._validate",
    "check_discrepancies": "iobundle.replay.check._validate",
    "check_error_stat_name": "iobundle.replay.check._compare",
    "compare_call": "iobundle.replay.check._compare",
    "compare_outputs": "iobundle.replay.check._compare",
    "flatten_outputs": "iobundle.replay.check._compare",
    "float32_copy": "iobundle.replay.check._widen",
    "input_mapping": "iobundle.replay.check._validate",
    "model_label": "iobundle.replay.check._validate",
    "output_leaves": "iobundle.replay.check._compare",
    "output_mapping": "iobundle.replay.check._validate",
    "output_paths": "iobundle.replay.check._compare",
    "read_metadata": "iobundle.replay.check._validate",
    "recorded_output_names": "iobundle.replay.check._validate",
    "refuse_unknown_outputs": "iobundle.replay.check._validate",
    "refuse_unused": "iobundle.replay.check._validate",
    "rerun_model": "iobundle.replay.check._rerun",
    "tolerance_options": "iobundle.replay.check._compare",
    "validate_onnx": "iobundle.replay.check._validate",
}

__getattr__ = lazy_names(__name__, _LAZY)
