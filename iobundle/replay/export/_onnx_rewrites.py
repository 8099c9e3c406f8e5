"""Rewrites of an exported program's graph, before ``torch.onnx.export``, for ops ONNX cannot express.

Each rewrite replaces an op by another that computes the same value and that the ONNX exporter
translates. They are applied to every program :func:`iobundle.replay.export_onnx` converts, and
listed on the export report's options when they changed something.

``aten._is_all_true -> aten.all``
    ``torch._check_tensor_all(cond)`` (transformers' ``torch_compilable_check``, e.g. Gemma-3's
    "image features and image tokens match") records ``aten._is_all_true(cond)``, which the
    exporter cannot translate; ``aten.all(cond)`` is the same 0-d bool tensor.

``aten.rsub.Scalar`` of an integer tensor and a float
    ``1.0 - mask`` with an integer or boolean ``mask`` (ProphetNet's, XLNet's and Mllama's masks)
    decomposes to ``aten.sub.Tensor(1.0, mask)``, number first, which no schema takes ("Failed to
    decompose the FX graph"). The rewrite casts the tensor to the result's dtype first.

``aten.batch_norm`` in training mode
    normalises with the batch's statistics; the exporter translates it in inference mode, with the
    running statistics. Given none, the translation takes the batch's (the program does not output them).

What depends only on constants and weights, folded (when the conversion lacks a translation)
    A value computed from numbers, constants, parameters and buffers alone (``Normal(0,
    1).icdf(...)`` reaches the exporter as ``prims.erf_inv``, which has no translation) is
    computed once and becomes a constant (:func:`fold_constants`): each such node whose op has no
    translation, and each small one (at most :data:`FOLD_NUMEL` elements) a node depending on the
    inputs uses. Larger values (a transposed weight) stay in the graph, so no weight is stored
    twice; random ops and mutated buffers are never folded. Only when the conversion failed for
    want of a translation (:func:`converted_folding`): a program that converts is left as it is.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FOLD_NUMEL", "converted_folding", "fold_constants", "rewrite_for_onnx", "untranslated_op"]

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


FOLD_NUMEL = 4096
"""The size up to which a value computed from constants and weights alone is folded (see the module docstring)."""


def _constant_inputs(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The placeholders of ``ep`` that hold constants, parameters or buffers it does not mutate, by node name."""
    from torch.export.graph_signature import InputKind

    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    found: dict[str, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        if (
            spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
            or spec.target in mutated
        ):
            continue
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        if isinstance(value, torch.Tensor):
            found[spec.arg.name] = value
    return found


def _foldable(node: torch.fx.Node, constant: set[torch.fx.Node]) -> bool:
    """Whether ``node`` computes a value from the nodes of ``constant`` and numbers (or numbers alone), deterministically."""
    import operator

    if node.op != "call_function" or not all(n in constant for n in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    # An op writing into its input is folded only when that input is a value computed here (a fresh copy).
    schema = node.target._schema
    written = [
        a for a, arg in zip(node.args, schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write
    ]
    return all(isinstance(a, torch.fx.Node) and a.op == "call_function" for a in written)


@functools.cache
def _registry() -> Any:
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    return ONNXRegistry.from_torchlib()


def _translated(target: object) -> bool:
    """Whether the ONNX exporter has a translation registered for op ``target`` (decompositions aside)."""
    if not isinstance(target, torch._ops.OpOverload):
        return True  # ``operator.getitem`` of a node's several outputs: folded only when small
    return bool(_registry().is_registered(target))


def fold_constants(ep: torch.export.ExportedProgram) -> list[str]:
    """Fold, in place, what ``ep`` computes from constants and weights alone (see the module docstring); return
    the ops folded, one entry per op (``aten.erfinv.default``)."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    values: dict[torch.fx.Node, Any] = {}
    placeholders = _constant_inputs(ep)
    graph = ep.graph_module.graph
    constant = {n for n in graph.nodes if n.op == "placeholder" and n.name in placeholders}
    for node in graph.nodes:
        if _foldable(node, constant):
            constant.add(node)
    chosen = []
    for node in graph.nodes:
        if node not in constant or node.op == "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        frontier = any(u not in constant for u in node.users) and node.meta["val"].numel() <= FOLD_NUMEL
        if frontier or not _translated(node.target):
            chosen.append(node)
    if not chosen:
        return []

    def value(node: torch.fx.Node) -> Any:
        if node not in values:
            if node.op == "placeholder":
                values[node] = placeholders[node.name]
            else:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
                with torch.no_grad():
                    values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        return values[node]

    # The new constants go before the user inputs, as torch.export orders its placeholders.
    specs = ep.graph_signature.input_specs
    first_user = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    folded: list[str] = []
    tensors = [value(node) for node in chosen]  # before any node is replaced
    first = sum(1 for name in ep.constants if name.startswith("iobundle_folded_"))  # folded by an earlier call
    for i, (node, tensor) in enumerate(zip(chosen, tensors), start=first):
        assert isinstance(tensor, torch.Tensor)
        name = f"iobundle_folded_{i}"
        ep.constants[name] = tensor.detach().clone()
        where = (
            graph.inserting_before(holders[first_user])
            if first_user < len(holders)
            else graph.inserting_after(holders[-1])
        )
        with where:
            holder = graph.placeholder(f"c_{name}")
        holder.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(holder)
        specs.insert(first_user + i - first, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(holder.name), name))
        folded.append(str(node.target))
    graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return list(dict.fromkeys(folded))


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
        elif node.target is torch.ops.aten.batch_norm.default and node.args[5] is True and node.args[3] is not None:
            node.args = (*node.args[:3], None, None, *node.args[5:])
            done.append("aten.batch_norm in training mode -> the batch's statistics (no running statistics)")
    if done:
        ep.graph_module.recompile()
        logger.info("rewrote for ONNX: %s", ", ".join(done))
    return list(dict.fromkeys(done))


_NO_FUNCTION = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>")


def converted_folding(ep: torch.export.ExportedProgram, convert: Callable[[], Any], options: list[str]) -> Any:
    """``convert()``; when it fails for want of an op's translation, or on a guard on data-dependent sizes (the
    decompositions retrace sizes read from constant values: a program traced with an input's values fixed),
    again after :func:`fold_constants` folded something, saying so on ``options``. A program that converts
    is converted as it is."""
    try:
        return convert()
    except Exception as exc:
        folded = fold_constants(ep) if _NO_FUNCTION.search(str(exc)) or "data-dependent" in str(exc) else []
        if not folded:
            raise
    options.append(f"rewritten for ONNX: values computed from constants and weights alone folded ({', '.join(folded)})")
    return convert()


def untranslated_op(message: str, ep: torch.export.ExportedProgram) -> str | None:
    """When the ONNX conversion failed for want of a translation of an op: the op and the module using it, in one
    line (``no ONNX translation for prims.erf_inv, used by module 'gate' (Gate)``); None for another failure.

    The op is named as the exporter names it, after its decompositions; the module is that of the
    first node of ``ep`` whose op's name ends with that name, underscores aside
    (``aten.special_erfinv`` is decomposed into ``prims.erf_inv``).
    """
    found = _NO_FUNCTION.search(message)
    if found is None:
        return None
    op = found.group(1)
    where = ""
    bare = op.rsplit(".", 1)[-1].replace("_", "")
    for node in ep.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0].replace("_", "")
        if node.op == "call_function" and name.endswith(bare):
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            path, kind = stack[-1] if stack else ("", "")
            kind = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])
            where = f", used by module {path!r} ({kind})" if path else f", used by the model's own code ({kind})"
            break
    return (
        f"no ONNX translation for {op}{where}: it depends on the inputs, so it cannot be folded into a constant; "
        "rewrite that code with ops ONNX has, or register a translation with torch.onnx"
    )
