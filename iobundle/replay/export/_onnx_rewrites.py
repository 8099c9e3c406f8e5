"""Rewrites of an exported program's graph, before ``torch.onnx.export``, for ops ONNX cannot express.

Each rewrite replaces an op by another that computes the same value and that the ONNX
exporter translates. They are applied to every program :func:`iobundle.replay.export_onnx`
converts, and listed on the export report's options when they changed something.

``aten._is_all_true -> aten.all``
    ``torch._check_tensor_all(cond)`` (which transformers' ``torch_compilable_check`` calls
    while tracing, e.g. Gemma-3's "image features and image tokens match" check) records
    ``aten._is_all_true(cond)``, a 0-d bool tensor, then asserts its value. The exporter has
    no translation for it; ``aten.all(cond)`` is the same 0-d bool tensor.

``aten.rsub.Scalar(integer tensor, float) -> aten.rsub.Scalar(float tensor, float)``
    ``1.0 - mask`` with an integer or bool ``mask`` (Mllama's cross-attention mask,
    ``(1.0 - cross_attention_mask).to(dtype)``) records ``aten.rsub.Scalar(mask, 1.0)``, whose
    result is a float tensor. The exporter decomposes it into ``aten.sub.Tensor(1.0, mask)``
    and its type-promotion pass, which casts ``mask`` to the result's dtype, then looks for an
    overload of ``sub`` taking a Python float first and finds none ("Cannot find a compatible
    OpOverload for aten.sub", a ``ConversionError`` at "Failed to decompose the FX graph").
    Casting the tensor to the result's dtype first is what ``rsub`` computes anyway (torch
    promotes before subtracting), so the value is the same, and nothing is left to promote.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["rewrite_for_onnx"]

logger = logging.getLogger(__name__)


def rewrite_for_onnx(ep: torch.export.ExportedProgram) -> list[str]:
    """Apply the rewrites of the module docstring to ``ep``'s graph in place; return what was rewritten."""
    done: list[str] = []
    replacements = {torch.ops.aten._is_all_true.default: torch.ops.aten.all.default}
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in replacements:
            before = str(node.target)
            node.target = replacements[node.target]
            done.append(f"{before} -> {node.target}")
        elif node.target is torch.ops.aten.rsub.Scalar and _cast_before_rsub(graph, node):
            done.append("aten.rsub.Scalar of an integer tensor: the tensor cast to the result's dtype first")
    if done:
        ep.graph_module.recompile()
        logger.info("rewrote for ONNX: %s", ", ".join(done))
    return list(dict.fromkeys(done))


def _cast_before_rsub(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """Make ``rsub(x, scalar)`` take ``x`` in the result's dtype when ``x`` is an integer or bool tensor."""
    x = node.args[0]
    result = node.meta.get("val")
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(result, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == result.dtype:
        return False
    with graph.inserting_before(node):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": result.dtype})
    cast.meta["val"] = value.to(result.dtype)
    node.replace_input_with(x, cast)
    return True
