"""Rewrites of an exported program's graph, before ``torch.onnx.export``, for ops ONNX cannot express.

Each rewrite replaces an op by another that computes the same value and that the ONNX
exporter translates. They are applied to every program :func:`iobundle.replay.export_onnx`
converts, and listed on the export report's options when they changed something.

``aten._is_all_true -> aten.all``
    ``torch._check_tensor_all(cond)`` (which transformers' ``torch_compilable_check`` calls
    while tracing, e.g. Gemma-3's "image features and image tokens match" check) records
    ``aten._is_all_true(cond)``, a 0-d bool tensor, then asserts its value. The exporter has
    no translation for it; ``aten.all(cond)`` is the same 0-d bool tensor.
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
    for node in graph.nodes:
        if node.op == "call_function" and node.target in replacements:
            before = str(node.target)
            node.target = replacements[node.target]
            done.append(f"{before} -> {node.target}")
    if done:
        ep.graph_module.recompile()
        logger.info("rewrote for ONNX: %s", ", ".join(done))
    return list(dict.fromkeys(done))
