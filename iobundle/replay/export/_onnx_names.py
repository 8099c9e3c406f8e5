"""Name an ONNX graph's outputs after the recorded outputs they reproduce (``logits``, not ``linear_14``).

``torch.onnx.export`` names each graph output after the node that computes it. The recorded
outputs have names users know, the ones validation reports and per-output tolerances take
(:func:`iobundle.replay.check.output_paths`); :func:`name_graph_outputs` gives the graph
outputs those names. ONNX wants every value of a graph named once, so:

- an output that is also a graph input, an initializer or an earlier output (a model that
  returns an input, a weight or one tensor twice) gets its own value through an ``Identity``;
- an intermediate value that already bears a wanted name is renamed (nobody sees it);
- a wanted name that a graph input or initializer bears is given to the output with a suffix
  (``attention_mask.output``), and the mapping written into the model says which output it is.

``torch.onnx.export`` also renames an input the program returns as it is (``y`` becomes
``y_orig``, the output keeping ``y``); once the outputs bear their own names,
:func:`name_graph_inputs` gives such an input its name back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["name_graph_inputs", "name_graph_outputs"]

logger = logging.getLogger(__name__)


def name_graph_outputs(model: Any, names: Sequence[str]) -> dict[str, str]:
    """Rename the outputs of the ``onnx_ir`` model ``model`` after ``names`` (one per output, in order), in place.

    Returns:
        Graph output name -> the recorded name it stands for, in output order. The two are equal
        unless the name was taken by a graph input or an initializer (see the module docstring).

    Raises:
        ValueError: ``names`` does not hold one distinct name per graph output.
    """
    graph = model.graph
    if len(names) != len(graph.outputs) or len(set(names)) != len(names):
        raise ValueError(f"{len(graph.outputs)} graph outputs cannot be named after {list(names)}")
    import onnx_ir as ir

    seen: set[int] = set()
    for i, value in enumerate(list(graph.outputs)):
        if value.is_graph_input() or value.is_initializer() or id(value) in seen:
            copy = ir.Node("", "Identity", [value], num_outputs=1)
            graph.append(copy)
            copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
            value = copy.outputs[0]
            graph.outputs[i] = value
        seen.add(id(value))
    outputs = list(graph.outputs)
    own = {id(v) for v in outputs}
    by_name = {v.name: v for v in _values(graph) if v.name and id(v) not in own}
    taken = set(by_name) | set(names)
    fixed = {v.name for v in by_name.values() if v.is_graph_input() or v.is_initializer()}
    mapping: dict[str, str] = {}
    for value, name in zip(outputs, names):
        graph_name = _fresh(f"{name}.output", taken) if name in fixed else name
        other = by_name.pop(name, None)
        if other is not None and name not in fixed:  # an intermediate value: it gives way
            other.name = _fresh(name, taken)
        taken.add(graph_name)
        value.name = graph_name
        mapping[graph_name] = name
    logger.debug("named the ONNX outputs %s", list(mapping))
    return mapping


def name_graph_inputs(model: Any, names: Sequence[str]) -> None:
    """Give the inputs of the ``onnx_ir`` model ``model`` the program's input ``names`` (in order) where free."""
    graph = model.graph
    if len(names) != len(graph.inputs):
        return
    taken = {v.name for v in _values(graph)} | {v.name for v in graph.outputs}
    for value, name in zip(graph.inputs, names):
        if value.name != name and name not in taken:
            taken.discard(value.name)
            value.name = name
            taken.add(name)


def _fresh(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first not in ``taken`` (which gains it)."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _values(graph: Any) -> Iterator[Any]:
    """Every value of ``graph`` and of its subgraphs (ONNX names share one scope), with repeats."""
    for g in (graph, *graph.subgraphs()):
        yield from g.inputs
        yield from g.initializers.values()
    for node in graph.all_nodes():
        yield from node.outputs
