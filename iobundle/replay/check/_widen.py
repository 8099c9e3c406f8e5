"""A float32 validation copy of a half-precision ONNX graph, for a runtime without half kernels.

onnxruntime's CPU provider has no bfloat16 kernel for most operators (``Could not find an
implementation for Mul(14)``), and few float16 ones. :func:`float32_copy` rewrites, in memory,
the same graph with every bfloat16 / float16 element type turned to float32: its initializers
and constants (values converted), its inputs, outputs and intermediate types, and the casts that
name a half type. The operators and their order stay as exported; the file on disk is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["HALF_TYPES", "float32_copy", "half_types"]

HALF_TYPES = {16: "bfloat16", 10: "float16"}
"""ONNX element types (``TensorProto.BFLOAT16``, ``TensorProto.FLOAT16``) the copy turns to float32."""


def _widen_tensor(tensor: onnx.TensorProto) -> None:
    import numpy as np
    from onnx import numpy_helper

    values = numpy_helper.to_array(tensor).astype(np.float32)
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))


def _widen_nodes(nodes: Iterable[onnx.NodeProto], seen: set[int]) -> None:
    from onnx import AttributeProto, TensorProto

    for node in nodes:
        for attr in node.attribute:
            if attr.type == AttributeProto.INT and attr.name == "to" and attr.i in HALF_TYPES:
                seen.add(attr.i)
                attr.i = TensorProto.FLOAT
            elif attr.type == AttributeProto.TENSOR and attr.t.data_type in HALF_TYPES:
                seen.add(attr.t.data_type)
                _widen_tensor(attr.t)
            elif attr.type == AttributeProto.GRAPH:
                _widen_graph(attr.g, seen)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _widen_graph(g, seen)


def _widen_graph(graph: onnx.GraphProto, seen: set[int]) -> None:
    from onnx import TensorProto

    for tensor in graph.initializer:
        if tensor.data_type in HALF_TYPES:
            seen.add(tensor.data_type)
            _widen_tensor(tensor)
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type in HALF_TYPES:
            seen.add(tensor_type.elem_type)
            tensor_type.elem_type = TensorProto.FLOAT
    _widen_nodes(graph.node, seen)


def half_types(model: onnx.ModelProto) -> list[str]:
    """The half-precision types (``bfloat16``, ``float16``) the graph's inputs, outputs or initializers hold,
    or its casts name (a float32 program traced under ``torch.autocast`` casts to the autocast dtype)."""
    graph = model.graph
    types = {t.data_type for t in graph.initializer}
    types |= {i.type.tensor_type.elem_type for i in [*graph.input, *graph.output]}
    for nodes in [graph.node, *(f.node for f in model.functions)]:
        types |= {a.i for n in nodes if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    return sorted(HALF_TYPES[t] for t in types if t in HALF_TYPES)


def float32_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The same graph with every half-precision type turned to float32, and the types it replaced.

    ``model`` is left as it is. The copy keeps the graph's nodes, names and metadata; its local
    functions are rewritten too.
    """
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    seen: set[int] = set()
    _widen_graph(copy.graph, seen)
    for function in copy.functions:
        _widen_nodes(function.node, seen)
    return copy, sorted(HALF_TYPES[t] for t in seen)
