"""Save an exported program as ONNX: outputs named after the recorded ones, the input map in its metadata."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls
from iobundle.errors import BundleExistsError, ExportError
from iobundle.replay.check import (
    INPUT_SLOTS_KEY,
    OUTPUT_NAMES_KEY,
    OUTPUT_PATHS_KEY,
    Tolerances,
    output_paths,
)
from iobundle.replay.export._call_checks import ExportReport
from iobundle.replay.export._dims import _Plan
from iobundle.replay.export._export import ExportResult, export_program
from iobundle.replay.export._trace import export_context
from iobundle.replay.infer import DimNamesSpec, DynamicSpec, onnx_axis_names, rename_onnx_axes

__all__ = ["export_onnx", "save_onnx"]

logger = logging.getLogger(__name__)


# Weights from this size on are saved as external data (MODEL.onnx.data beside MODEL.onnx): written
# tensor by tensor, where an inline save first builds the whole protobuf, then its serialised bytes,
# two more copies of the weights (benchmarks/large.py measured the export's peak at 4.7x the weights).
EXTERNAL_DATA_BYTES = 256 * 1024**2


def export_onnx(
    rc: RecordedCalls, model: torch.nn.Module, path: str | os.PathLike[str], *,
    set_batch_dimension_for: Collection[int | str] | bool | None = None, strict: bool = False, check: bool = True,
    dynamic: DynamicSpec = None, dim_names: DimNamesSpec = False, on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
) -> str:  # fmt: skip
    """Export ``model`` to ONNX at ``path`` through ``torch.export`` (checked on every call first).

    The graph's outputs are named after the recorded outputs (``logits``, the names validation
    reports and ``output_atol`` takes; see :func:`iobundle.replay.check.output_paths`). The ONNX
    file carries, in its metadata, which recorded tensor feeds which graph input and which
    recorded output each graph output reproduces, so validation maps them through the exported
    program's signature rather than by guessing from names. With ``dim_names``, the graph's symbolic
    dimensions bear the names (``batch_size``, ``past_sequence_length``, ...). Weights of 256 MiB
    or more are saved as external data, ``<path>.data`` beside the file. The arguments are those
    of :func:`export_program`, the tolerance keywords of the check included.

    Raises:
        ExportError: ``torch.export`` or ``torch.onnx.export`` failed, or (with ``check``) the
            exported program does not reproduce a recorded call.
        BundleExistsError: ``path`` (or ``<path>.data``) is a symbolic link: nothing is written through one.
        ToleranceError: A per-output tolerance names no recorded output (before anything is traced).

    .. versionchanged:: 0.2
        ``output_atol``, ``output_rtol`` and ``tolerances``, as :func:`export_program` takes them.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
    result = export_program(
        rc, model, set_batch_dimension_for=set_batch_dimension_for, strict=strict, check=check, dynamic=dynamic,
        dim_names=dim_names, on_progress=on_progress, tolerances=tolerances,
    )  # fmt: skip
    return save_onnx(rc, result, path, on_progress=on_progress)


def save_onnx(
    rc: RecordedCalls,
    result: ExportResult,
    path: str | os.PathLike[str],
    *,
    on_progress: ProgressCallback | None = None,
) -> str:
    """Convert the program of :func:`export_program`'s ``result`` from ``rc`` to ONNX at ``path``; return the path.

    Weights of 256 MiB or more are saved as external data, ``<path>.data`` beside the file.

    Raises:
        ExportError: ``torch.onnx.export`` failed, or the program does not take the recorded tensors.
        BundleExistsError: ``path`` (or ``<path>.data``) is a symbolic link: nothing is written through one.
    """
    for target in (Path(path), Path(f"{path}.data")):
        if target.is_symlink():
            raise BundleExistsError(
                f"'{target}' is a symbolic link; iobundle never writes through one. Remove it, or choose another path."
            )
    ep, report, plan = result.program, result.report, result.plan
    sig = ep.graph_signature
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    inputs = [
        s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)
    ]
    outputs = [
        s.arg.name for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT and isinstance(s.arg, TensorArgument)
    ]
    n_slots = len(plan.alignment.owners)
    if len(inputs) != n_slots:
        raise ExportError(
            f"The exported program takes {len(inputs)} tensor inputs but the recorded calls hold {n_slots}.",
            report=report,
        )
    begin = time.perf_counter()
    notify(on_progress, "torch.onnx.export", 0, 1)
    try:
        from iobundle.replay.export._onnx_optimizer import linear_rewrite_rules
        from iobundle.replay.export._onnx_rewrites import converted_folding, rewrite_for_onnx

        report.options += [f"rewritten for ONNX: {r}" for r in rewrite_for_onnx(ep)]
        with (
            export_context(rc, oblivious=False, report=ExportReport(traced_call=report.traced_call)),
            linear_rewrite_rules(),  # the optimizer's O(nodes²) rules left out
        ):
            program = converted_folding(
                ep, lambda: torch.onnx.export(ep, (), dynamo=True, verbose=False), report.options
            )
        assert program is not None
        if plan.dim_names is not None:
            rename_onnx_axes(program.model, onnx_axis_names(ep, inputs, plan.dim_names))
        # Outputs are named after the recorded outputs they reproduce, and the metadata maps them.
        recorded = _recorded_names(plan, len(program.model.graph.outputs))
        if recorded is not None:
            from iobundle.replay.export._onnx_names import name_graph_inputs, name_graph_outputs

            program.model.metadata_props[OUTPUT_PATHS_KEY] = json.dumps(name_graph_outputs(program.model, recorded))
            name_graph_inputs(program.model, inputs)
        # The ONNX graph takes the user inputs in the program's order, but may rename one (an input
        # also returned as an output may stay ``<name>_orig``): map the ONNX names by position.
        graph_inputs = [v.name for v in program.model.graph.inputs]
        names = graph_inputs if len(graph_inputs) == len(inputs) else inputs
        program.model.metadata_props[INPUT_SLOTS_KEY] = json.dumps(dict(zip(names, range(len(names)))))
        program.model.metadata_props[OUTPUT_NAMES_KEY] = json.dumps([v.name for v in program.model.graph.outputs])
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = sum(
            v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None
        )
        program.save(str(path), external_data=weights >= EXTERNAL_DATA_BYTES)
    except ExportError:
        raise
    except Exception as exc:
        from iobundle.replay.export._onnx_rewrites import untranslated_op

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = untranslated_op(str(exc), ep) or f"{type(exc).__name__}: {first}"
        raise ExportError(f"torch.onnx.export failed: {why}", report=report) from exc
    report.onnx_seconds = time.perf_counter() - begin
    notify(on_progress, "torch.onnx.export", 1, 1)
    logger.info("exported %s (%d inputs, %d outputs)", path, len(inputs), len(outputs))
    return str(path)


def _recorded_names(plan: _Plan, n_outputs: int) -> list[str] | None:
    """The recorded outputs' names (:func:`output_paths`) of the traced call, else of the first call that has
    ``n_outputs`` of them; None when no call does (a redacted bundle): the graph keeps its node names."""
    calls = [plan.alignment.calls[plan.traced], *plan.alignment.calls]
    for call in calls:
        names = output_paths(call.outputs) if call.outputs is not None else []
        if len(names) == n_outputs and len(set(names)) == n_outputs:
            return names
    return None
