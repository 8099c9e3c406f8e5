"""Align recorded calls and infer from them: ``torch.export`` arguments, dynamic shapes, dim names.

Works on :class:`iobundle.calls.RecordedCalls` (from memory or from a bundle) and needs torch
only: never onnx, onnxruntime or transformers (unless the calls hold transformers objects).
Dynamic shapes and static-axis hints need no torch for a bundle: a dynamic dimension is
:data:`DYNAMIC` until :func:`to_torch_dims` converts it. Each stage is a module: align
(``_align``), dynamic shapes (``_dynamic``, its marker ``_dynamic_dim``; per keyword group ``_groups``), batch axes (``_batch``), arguments
(``_arguments``), dim names (``_dim_names``), static axes (``_static_dims``), what the calls
hold (``_info``). Internal tier: the public names are :mod:`iobundle.replay`'s.
"""

from __future__ import annotations

__all__ = [
    # Align calls
    "Alignment",
    "align_call",
    "align_calls",
    "call_shape",
    "call_sizes",
    "call_values",
    "call_structure",
    "call_structures",
    "owner_name",
    "phase_calls",
    # Dynamic shapes, batch axes and dim names
    "DYNAMIC",
    "BatchAxis",
    "BatchSpec",
    "DimNamesSpec",
    "DynamicSpec",
    "batch_axes",
    "fed_shapes",
    "find_batch_axes",
    "flat_dynamic_dims",
    "GroupShapes",
    "infer_dynamic_shapes",
    "infer_group_shapes",
    "name_dims",
    "derive_dims",
    "named_dims_hint",
    "onnx_axis_names",
    "rename_onnx_axes",
    "to_export_dims",
    "to_torch_dims",
    # Static axes that look dynamic
    "StaticDimHint",
    "static_dim_hints",
    # Arguments
    "aligned_tensors",
    "infer_arguments",
    "placeholder_inputs",
    "received_arguments",
    "remove_inputs",
    "select_call",
    "spread_var_keyword",
    # What the calls hold
    "InputCandidate",
    "ObservationInfo",
]

from iobundle.replay.infer._align import (
    Alignment,
    BatchSpec,
    DynamicSpec,
    align_call,
    align_calls,
    call_shape,
    call_sizes,
    call_structure,
    call_structures,
    call_values,
    owner_name,
    phase_calls,
)
from iobundle.replay.infer._arguments import (
    aligned_tensors,
    infer_arguments,
    placeholder_inputs,
    received_arguments,
    remove_inputs,
    select_call,
    spread_var_keyword,
)
from iobundle.replay.infer._batch import BatchAxis, batch_axes, find_batch_axes
from iobundle.replay.infer._dim_names import (
    DimNamesSpec,
    derive_dims,
    name_dims,
    named_dims_hint,
    onnx_axis_names,
    rename_onnx_axes,
    to_export_dims,
)
from iobundle.replay.infer._dynamic import fed_shapes, flat_dynamic_dims, infer_dynamic_shapes
from iobundle.replay.infer._dynamic_dim import DYNAMIC, to_torch_dims
from iobundle.replay.infer._groups import GroupShapes, infer_group_shapes
from iobundle.replay.infer._info import InputCandidate, ObservationInfo
from iobundle.replay.infer._static_dims import StaticDimHint, static_dim_hints
