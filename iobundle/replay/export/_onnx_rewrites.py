"""Rewrites of an exported program's graph, before ``torch.onnx.export``, for ops ONNX cannot express.

Each rewrite replaces an op by another that computes the same value and that the ONNX
exporter translates. They are applied to every program :func:`iobundle.replay.export_onnx`
converts, and listed on the export report's options when they changed something.

``aten._is_all_true -> aten.all``
    ``torch._check_tensor_all(cond)`` (which transformers' ``torch_compilable_check`` calls
    while tracing, e.g. Gemma-3's "image features and image tokens match" check) records
    ``aten._is_all_true(cond)``, a 0-d bool tensor, then asserts its value. The exporter has
    no translation for it; ``aten.all(cond)`` is the same 0-d bool tensor.

``aten.rsub.Scalar`` of an integer tensor and a float
    ``1.0 - mask`` with an integer or boolean ``mask`` (ProphetNet's and XLNet's attention
    masks, Mllama's cross-attention mask) records ``aten.rsub.Scalar(mask, 1.0)``, whose
    result is float. torch's decomposition of it, which ``torch.onnx.export`` runs, emits
    ``aten.sub.Tensor(1.0, mask)`` with the number first, an op no schema takes: the
    conversion stops with "Failed to decompose the FX graph". The rewrite casts the tensor
    to the result's dtype first (``aten._to_copy``); ``rsub`` of a float tensor decomposes
    and gives the same values.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["rewrite_for_onnx"]

logger = logging.getLogger(__name__)


def _promoting_rsub(node: torch.fx.Node) -> torch.dtype | None:
    """The float dtype of ``node`` when it is ``rsub`` of an integer (or bool) tensor and a float; else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.rsub.Scalar:
        return None
    operand, result = node.args[0], node.meta.get("val")
    value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return None
    if value.dtype.is_floating_point or value.dtype.is_complex or not result.dtype.is_floating_point:
        return None
    return result.dtype


def rewrite_for_onnx(ep: torch.export.ExportedProgram) -> list[str]:
    """Apply the rewrites of the module docstring to ``ep``'s graph in place; return what was rewritten."""
    done: list[str] = []
    replacements = {torch.ops.aten._is_all_true.default: torch.ops.aten.all.default}
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in replacements:
            before = str(node.target)
            node.target = replacements[node.target]
            done.append(f"{before} -> {node.target}")
        elif (dtype := _promoting_rsub(node)) is not None:
            operand = node.args[0]
            with graph.inserting_before(node):
                cast = graph.call_function(torch.ops.aten._to_copy.default, (operand,), {"dtype": dtype})
            cast.meta["val"] = operand.meta["val"].to(dtype)
            node.args = (cast, *node.args[1:])
            done.append(f"{node.target} of an integer tensor -> {node.target} of its {dtype} cast")
    if done:
        ep.graph_module.recompile()
        logger.info("rewrote for ONNX: %s", ", ".join(done))
    return list(dict.fromkeys(done))
