"""onnxscript's optimizer, as ``torch.onnx.export`` runs it, without its rules that cost O(nodes²).

``torch.onnx.export(..., optimize=True)`` ends with ``onnxscript.optimizer.optimize_ir``, whose
rewrite pass tries onnxscript's default rules on every node. A rule whose pattern has several
output nodes (in onnxscript 0.7, ``SlicesSplit``: two ``Slice`` of one input become one ``Split``)
is matched by brute force, every node against every combination: nodes² steps per pass. On a
narrow Llama-shaped decoder (``benchmarks/layers.py``: 1648 and 3184 nodes at 6 and 12 layers)
the optimizer took 20 s and 101 s, where every other step of the export was at most linear.

While ``torch.onnx.export`` runs, :func:`linear_rewrite_rules` gives onnxscript's default rule
list without such rules; every other pass and rule runs as before. The rewrite lost never fired
on any graph measured (torch's ``Slice`` nodes carry a ``steps`` input its pattern does not
take): the optimized graphs were the same, node for node, and the optimizer 2.7-3.4x faster.
Where onnxscript's module lacks the rule list (another onnxscript), nothing is changed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["linear_rewrite_rules"]

logger = logging.getLogger(__name__)

# The attribute of ``onnxscript.rewriter`` that ``optimize_ir`` reads its rewrite rules from.
_RULES_ATTRIBUTE = "_DEFAULT_REWRITE_RULES"


def _several_outputs(rule: Any) -> bool:
    """Whether ``rule``'s pattern has several output nodes (matched by brute force)."""
    pattern = getattr(rule, "_target_pattern", None)
    return pattern is not None and getattr(pattern, "has_single_output_node", True) is False


@contextlib.contextmanager
def linear_rewrite_rules() -> Iterator[list[str]]:
    """Leave onnxscript's rewrite rules with several output nodes out of its optimizer, scoped.

    Yields the names of the rules left out (empty where none are, or onnxscript has no such
    list); the list is put back on exit, even on error.
    """
    try:
        from onnxscript import rewriter
    except ImportError:  # torch.onnx.export will say what is missing
        yield []
        return
    rules = getattr(rewriter, _RULES_ATTRIBUTE, None)
    if not isinstance(rules, tuple | list):
        yield []
        return
    left_out = [str(getattr(rule, "name", None) or rule) for rule in rules if _several_outputs(rule)]
    if not left_out:
        yield []
        return
    setattr(rewriter, _RULES_ATTRIBUTE, type(rules)(rule for rule in rules if not _several_outputs(rule)))
    logger.debug("onnxscript's optimizer runs without the rewrite rules %s (matched in O(nodes²))", left_out)
    try:
        yield left_out
    finally:
        setattr(rewriter, _RULES_ATTRIBUTE, rules)
