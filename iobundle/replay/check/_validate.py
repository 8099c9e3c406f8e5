"""Run an ONNX model with onnxruntime on every recorded call and compare with the recorded outputs."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import onnx

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.errors import ModelLoadError, NothingToCompareError, ReplayError, ToleranceError
from iobundle.replay.check._compare import OutputCheck, Scratch, compare_call, histogram_labels, output_paths
from iobundle.replay.check._tolerances import Tolerances, check_error_stat_name
from iobundle.replay.check._widen import HALF_TYPES, float32_copy, half_types
from iobundle.replay.infer import (
    align_calls,
    aligned_tensors,
    call_sizes,
    call_structures,
    call_values,
    phase_calls,
    placeholder_inputs,
)
from iobundle.schema import load_program_index, program_structures, sizes_match, values_match

# ONNX metadata that export writes and validation reads back.
INPUT_SLOTS_KEY = "iobundle.input_slots"
OUTPUT_NAMES_KEY = "iobundle.output_names"
OUTPUT_PATHS_KEY = "iobundle.output_paths"


__all__ = ["ValidationReport", "check_discrepancies", "validate_onnx"]

logger = logging.getLogger(__name__)


def _is_proto(value: object) -> bool:
    """Whether ``value`` is a loaded ``onnx.ModelProto`` (onnx is imported only when some model is one)."""
    return type(value).__name__ == "ModelProto" and type(value).__module__.startswith("onnx")


def _no_half_support(error: Exception) -> bool:
    """Whether onnxruntime refused the model for a half type: no kernel for it, or an operator it does not type."""
    text = str(error)
    if "Could not find an implementation" in text:
        return True
    return "Type Error" in text and any(f"tensor({name})" in text for name in HALF_TYPES.values())


@dataclass(frozen=True)
class Session:
    """An onnxruntime session on the model, its metadata, and how it runs the recorded dtype."""

    session: Any
    metadata: dict[str, str]
    widened: tuple[str, ...] = ()
    """The half-precision types turned to float32 in the validation copy; empty when the model ran as it is."""

    @property
    def ran(self) -> str:
        """``bfloat16 program validated through a float32 copy``, or empty when the model ran as it is."""
        return f"{' and '.join(self.widened)} program validated through a float32 copy" if self.widened else ""


def onnx_model_file(model: str | os.PathLike[str]) -> Path:
    """The path of the ONNX model file ``model``; a ModelLoadError when there is none."""
    path = Path(model)
    if not path.is_file():
        raise ModelLoadError(
            f"ONNX model '{path}' does not exist.",
            hint="check the path of the ONNX model (`iobundle export -o` writes one)",
        )
    return path


def _open_session(ort: Any, source: Any, options: Any) -> Any:
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _session(onnx_model: str | os.PathLike[str] | onnx.ModelProto | torch.onnx.ONNXProgram) -> Session:
    """Load ``onnx_model`` in onnxruntime's CPU provider.

    A half-precision model (bfloat16, float16) that the provider has no kernel for is loaded as
    its float32 copy (:func:`float32_copy`, in memory): the graph the user deploys, with its
    values widened, so validation still compares it with the recorded outputs. So is a model
    with a bfloat16 input (e.g. a cache recorded under ``torch.autocast``): numpy has no bfloat16
    to feed it with.
    """
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if isinstance(onnx_model, torch.onnx.ONNXProgram):  # as torch's observer takes
        onnx_model = onnx_model.model_proto
    proto = onnx_model if isinstance(onnx_model, onnx.ModelProto) else None
    try:
        source = proto.SerializeToString() if proto is not None else str(onnx_model_file(onnx_model))
        try:
            session = _open_session(ort, source, options)
        except Exception as exc:
            if not _no_half_support(exc) or not half_types(loaded := proto or onnx.load(source)):
                raise
            return _widened_session(ort, loaded, options, {p.key: p.value for p in loaded.metadata_props})
        meta = dict(session.get_modelmeta().custom_metadata_map)
        if any(i.type == "tensor(bfloat16)" for i in session.get_inputs()):
            return _widened_session(ort, proto or onnx.load(source), options, meta)
        return Session(session, meta)
    except ModelLoadError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"onnxruntime cannot load the model '{onnx_model}': {first}") from exc


def _widened_session(ort: Any, model: onnx.ModelProto, options: Any, meta: dict[str, str]) -> Session:
    copy, widened = float32_copy(model)
    logger.info("onnxruntime has no %s kernel here: validating a float32 copy of the graph", "/".join(widened))
    return Session(_open_session(ort, copy.SerializeToString(), options), meta, tuple(widened))


@dataclass(frozen=True)
class IobundleMetadata:
    """What ``iobundle export`` wrote into a model's metadata, checked (see :func:`read_metadata`)."""

    input_slots: dict[str, int] | None
    """Graph input name -> slot of the aligned recorded inputs; None when the model carries no mapping."""
    output_names: list[str] | None
    """The graph outputs in the order of the recorded outputs; None when absent."""
    output_paths: dict[str, str] | None = None
    """Graph output name -> the name of the recorded output it reproduces (:func:`output_paths`); None in
    models exported before outputs were named, whose outputs are matched by position."""


def read_metadata(meta: Mapping[str, str], model: str, n_slots: int) -> IobundleMetadata:
    """Read and check the iobundle metadata of the ONNX model ``model`` (its file, for messages).

    The metadata comes from a file the user gave, so nothing in it is trusted: each key must hold
    the JSON ``iobundle export`` writes (slots: an object of integers in ``[0, n_slots)``; output
    names: a list of strings; output paths: an object of strings, no two alike).

    Raises:
        ModelLoadError: A key holds something else; the message names the model and the key.
    """

    def refuse(key: str, what: str) -> ModelLoadError:
        return ModelLoadError(
            f"ONNX model '{model}': its metadata '{key}' {what}. Re-export the model with `iobundle export`, "
            f"or remove the key (inputs are then matched by position)."
        )

    def parse(key: str) -> Any:
        try:
            return json.loads(meta[key])
        except (json.JSONDecodeError, TypeError) as exc:
            raise refuse(key, f"is not JSON ({exc})") from None

    slots: dict[str, int] | None = None
    if INPUT_SLOTS_KEY in meta:
        raw = parse(INPUT_SLOTS_KEY)
        if not isinstance(raw, dict):
            raise refuse(INPUT_SLOTS_KEY, f"is a JSON {type(raw).__name__}, not an object of input name -> slot")
        bad = [k for k, v in raw.items() if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n_slots]
        if bad:
            raise refuse(
                INPUT_SLOTS_KEY,
                f"maps {bad} to {[raw[k] for k in bad]}, not to slots 0..{n_slots - 1} of the recorded inputs",
            )
        slots = raw
    names: list[str] | None = None
    if OUTPUT_NAMES_KEY in meta:
        raw = parse(OUTPUT_NAMES_KEY)
        if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
            raise refuse(OUTPUT_NAMES_KEY, "is not a JSON list of output names")
        names = raw
    paths: dict[str, str] | None = None
    if OUTPUT_PATHS_KEY in meta:
        raw = parse(OUTPUT_PATHS_KEY)
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise refuse(OUTPUT_PATHS_KEY, "is not a JSON object of graph output name -> recorded output name")
        twice = sorted({v for v in raw.values() if list(raw.values()).count(v) > 1})
        if twice:
            raise refuse(OUTPUT_PATHS_KEY, f"names the recorded outputs {twice} more than once")
        paths = raw
    return IobundleMetadata(input_slots=slots, output_names=names, output_paths=paths)


def input_mapping(names: Sequence[str], metadata: IobundleMetadata, n_slots: int) -> list[tuple[str, int]]:
    """Graph input name -> aligned slot, from the metadata written at export, else by position.

    Validation and ``iobundle convert --to onnx-testdata`` both map recorded tensors to graph inputs here.
    """
    slots = metadata.input_slots
    if slots is not None:
        missing = [n for n in names if n not in slots]
        if missing:
            raise ModelLoadError(
                f"ONNX inputs {missing} are not recorded inputs (mapping in the model's metadata): the model was "
                "exported from another bundle."
            )
        return [(n, slots[n]) for n in names]
    if len(names) != n_slots:
        raise ModelLoadError(
            f"The ONNX model has {len(names)} inputs but the recorded calls hold {n_slots} tensors, and the model "
            "carries no iobundle input mapping. Export it with `iobundle export` to embed one."
        )
    return list(zip(names, range(n_slots)))


def output_mapping(graph_outputs: Sequence[str], metadata: IobundleMetadata, model: str) -> dict[str, str] | None:
    """Recorded output name -> graph output name, from the metadata written at export.

    None for a model that carries no such mapping (exported before outputs were named after the
    recorded ones): its outputs are matched by position.

    Raises:
        ModelLoadError: The mapping names an output the graph does not have.
    """
    paths = metadata.output_paths
    if paths is None:
        return None
    unknown = [n for n in paths if n not in graph_outputs]
    if unknown:
        raise ModelLoadError(
            f"ONNX model '{model}': its metadata '{OUTPUT_PATHS_KEY}' names {unknown}, which are not outputs of the "
            f"graph ({', '.join(graph_outputs)}). Re-export the model with `iobundle export`, or remove the key "
            "(outputs are then matched by position)."
        )
    return {recorded: graph for graph, recorded in paths.items()}


# onnxruntime's name of each element type a bundle may hold (NodeArg.type is "tensor(<name>)").
_ORT_TYPES = {
    torch.float32: "float", torch.float64: "double", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}  # fmt: skip


def refuse_mismatched_inputs(
    rc: RecordedCalls,
    alignment: Any,
    session: Any,
    mapping: Sequence[tuple[str, int]],
    label: str,
    widened: Sequence[str] = (),
) -> None:
    """Compare each graph input's element type and rank with the recorded tensors it is fed, before any run.

    In a float32 copy (``widened``: the half types it replaced) a ``float`` input takes those types.

    Raises:
        ModelLoadError: Some differ (one line naming each input): the model was not exported from this bundle.
    """
    inputs = {i.name: i for i in session.get_inputs()}
    columns = list(zip(*alignment.slots)) if alignment.slots else []
    problems = []
    for name, slot in mapping:
        key = next((k for k in columns[slot] if k is not None), None) if slot < len(columns) else None
        graph = inputs.get(name)
        if key is None or graph is None:
            continue
        dtype, rank = rc.store.dtype(key), len(rc.store.shape(key))
        wanted = str(graph.type).removeprefix("tensor(").removesuffix(")")
        graph_rank = len(graph.shape) if isinstance(graph.shape, list) else None
        recorded = _ORT_TYPES.get(dtype, str(dtype).replace("torch.", ""))
        recorded = "float" if recorded in widened else recorded
        if wanted != recorded or (graph_rank is not None and graph_rank != rank):
            problems.append(f"{name} takes {wanted} of rank {graph_rank}, the bundle holds {recorded} of rank {rank}")
    if problems:
        raise ModelLoadError(
            f"{label} does not fit the bundle: {'; '.join(problems)}. Give the ONNX model exported from this "
            "bundle (iobundle export BUNDLE ...)."
        )


def model_label(onnx_model: object) -> str:
    """How messages name a model: its path, or ``<in-memory ONNX model>``."""
    return os.fspath(onnx_model) if isinstance(onnx_model, (str, os.PathLike)) else "<in-memory ONNX model>"


def _summary(tensors: Sequence[Any]) -> str:
    shapes = ["None" if t is None else f"{'x'.join(map(str, t.shape)) or 'scalar'}:{t.dtype}" for t in tensors]
    return ", ".join(shapes).replace("torch.", "")


def _to_numpy(t: torch.Tensor, widened: Sequence[str] = ()) -> np.ndarray:
    """The feed of one input; a half-precision tensor as float32 for a float32 copy (``widened``)."""
    t = t.detach().cpu()
    if widened and str(t.dtype).replace("torch.", "") in widened:
        t = t.float()
    return t.contiguous().numpy()


def _require_outputs(rc: RecordedCalls) -> None:
    """Refuse to validate calls that hold no recorded outputs: a comparison with nothing is no pass.

    Raises:
        NothingToCompareError: No ok call has recorded outputs.
    """
    ok = rc.ok_calls
    if ok and all(c.outputs is None for c in ok):
        raise NothingToCompareError(
            f"None of the {len(ok)} recorded calls has recorded outputs (a bundle redacted by `iobundle redact` "
            "without --keep-outputs has none): there is nothing to compare the model's outputs against. "
            "Validate with the original bundle, or run `iobundle export` on this one to check that the model "
            "exports and runs on these inputs."
        )


def check_discrepancies(
    rc: RecordedCalls, onnx_model: str | os.PathLike[str] | onnx.ModelProto | torch.onnx.ONNXProgram, *,
    hist: Sequence[float] = (0.1, 0.01), progress_bar: bool = False, include_io: bool = True, skip_none: bool = True,
    on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
    tolerances: Tolerances | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``onnx_model`` with onnxruntime on every recorded call; one dict per call (DataFrame-ready).

    Each row has ``SUCCESS, abs, rel, sum, n, dnan``, one ``>h`` count per threshold of ``hist``,
    ``index, duration_torch, ort_duration, n_inputs, n_none, n_empty``, ``absent_inputs`` (inputs
    absent at capture and fed a non-empty stand-in, zeros or a ``value_if_missing`` placeholder:
    such a row is reported with ``SUCCESS=None`` when it differs, never as a numeric mismatch;
    zero-length stand-ins for absent caches mean the same as absence and are checked normally),
    ``error`` when the run failed, ``ran`` when the model ran as its float32 copy (a half-precision
    model onnxruntime's CPU provider has no kernel for: ``bfloat16 program validated through a
    float32 copy``), and with ``include_io`` the ``inputs`` and ``outputs`` summaries.

    ``onnx_model`` may also be a program index (``*.programs.json``, written by ``iobundle export``
    when one program cannot serve every call): each call then runs through the program whose
    structure it has, and each row names it in a ``program`` column.

    With per-output tolerances or another ``check_error_stat`` than ``max``, each output is
    decided on its own (see :func:`iobundle.replay.validate_onnx`) and the rows also carry
    ``mean_abs``, ``median_abs``, ``quantile_abs`` and ``worst_output`` (the median and quantile are
    None unless selected: ``check_error_stat`` median or quantile, or ``Tolerances(quantiles=True)``).

    Args:
        rc: The recorded calls.
        onnx_model: A path or a loaded ``onnx.ModelProto``.
        hist: Thresholds of the ``>h`` count columns.
        progress_bar: Draw a tqdm bar when tqdm is installed (kept for compatibility; prefer ``on_progress``).
        include_io: Add the ``inputs`` and ``outputs`` summaries.
        skip_none: A None output on one side only is not a failure.
        on_progress: Called with a :class:`~iobundle.replay.ProgressEvent` after each call.
        atol: The absolute tolerance of every output (those recorded in half precision get their
            dtype's row of ``DTYPE_TOLERANCES`` instead).
        rtol: The relative tolerance of every output (likewise).
        output_atol: Absolute tolerances per output: its name in the output tree (``logits``,
            ``past_key_values[0]``), its ONNX name or an ``fnmatch`` pattern, e.g. ``{"logits": 1e-3}``.
        output_rtol: Relative tolerances per output, keyed like ``output_atol``.
        check_error_stat: The statistic of an output's errors that decides it: ``max`` (every element
            within tolerance), ``mean``, ``median`` or ``quantile``.
        error_quantile: The quantile of ``check_error_stat="quantile"`` (and of ``quantile_abs``).
        tolerances: The whole comparison as one value (:meth:`~iobundle.replay.check.Tolerances.build`
            builds it from the six above, which are ignored when it is given).

    Raises:
        NothingToCompareError: The calls hold no recorded outputs (a redacted bundle).
        ModelLoadError: The model cannot be loaded, or its inputs do not fit the recorded calls (names, element types, ranks; a ReplayError).
        ToleranceError: A statistic is unknown, or a per-output tolerance names no output.

    .. versionchanged:: 0.2
        ``output_atol``, ``output_rtol``, ``check_error_stat``, ``error_quantile``, ``on_progress``.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile)
    rows, _ = _run_checks(
        rc, onnx_model, tolerances=tolerances.for_calls(rc.ok_calls), hist=hist, progress_bar=progress_bar, include_io=include_io,
        skip_none=skip_none, per_output=tolerances.per_output, on_progress=on_progress,
    )  # fmt: skip
    return rows


def _run_checks(
    rc: RecordedCalls,
    onnx_model: str | os.PathLike[str] | onnx.ModelProto | torch.onnx.ONNXProgram,
    *,
    tolerances: Tolerances,
    hist: Sequence[float],
    progress_bar: bool,
    include_io: bool,
    skip_none: bool,
    per_output: bool,
    on_progress: ProgressCallback | None,
) -> tuple[list[dict[str, Any]], list[OutputCheck]]:
    check_error_stat_name(tolerances.check_error_stat, tolerances.error_quantile)
    _require_outputs(rc)
    if isinstance(onnx_model, (str, os.PathLike)) and str(onnx_model).endswith(".json"):
        return check_program_index(
            rc, onnx_model, tolerances=tolerances, hist=hist, progress_bar=progress_bar,
            include_io=include_io, skip_none=skip_none, per_output=per_output, on_progress=on_progress,
        )  # fmt: skip
    loaded = _session(onnx_model)
    session, meta, widened = loaded.session, loaded.metadata, loaded.widened
    alignment = align_calls(rc)
    metadata = read_metadata(meta, model_label(onnx_model), len(alignment.owners))
    mapping = input_mapping([i.name for i in session.get_inputs()], metadata, len(alignment.owners))
    refuse_mismatched_inputs(rc, alignment, session, mapping, model_label(onnx_model), widened)
    session_outputs = [o.name for o in session.get_outputs()]
    by_name = output_mapping(session_outputs, metadata, model_label(onnx_model))
    output_names = metadata.output_names
    graph_outputs = output_names or session_outputs
    # A typo in a tolerance name is refused before the run, not after it.
    paths = [output_paths(call.outputs) for call in alignment.calls]
    refuse_unknown_outputs(
        tolerances,
        _name_groups(
            [p for p, c in zip(paths, alignment.calls) if c.outputs is not None],
            graph_outputs if by_name is None else by_name,
        ),
    )
    scratch = Scratch()
    rows: list[dict[str, Any]] = []
    checks: list[OutputCheck] = []
    indices: Any = range(len(alignment.calls))
    if progress_bar:
        try:
            from tqdm import tqdm

            indices = tqdm(indices)
        except ImportError:
            pass
    total = len(alignment.calls)
    notify(on_progress, "validate", 0, total)
    previous: dict[str, torch.Tensor] = {}  # a call's outputs, often the next call's inputs (a decoder's cache)
    for i in indices:
        call = alignment.calls[i]
        slots = alignment.slots[i]
        tensors = aligned_tensors(rc, alignment, slots, previous)
        feeds = {name: _to_numpy(tensors[slot], widened) for name, slot in mapping}
        keys = tensor_keys(call.outputs) if call.outputs else []
        expected = [rc.store.get(k) for k in keys]
        previous = dict(zip(keys, expected))
        names = paths[i]
        fetch, other_names, error = _fetched_outputs(names, by_name, output_names, graph_outputs, session_outputs)
        row: dict[str, Any] = {}
        begin = time.perf_counter()
        obtained = None
        if error is None:
            try:
                obtained = session.run(fetch, feeds)
            except Exception as exc:
                error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        ort_duration = time.perf_counter() - begin
        if error is not None or obtained is None:
            row.update(_failed_row(error, hist))
        else:
            cmp_row, call_checks = compare_call(
                expected, obtained, call_index=call.index, names=names, tolerances=tolerances.for_call(call), hist=hist,
                skip_none=skip_none, scratch=scratch, per_output=per_output, other_names=other_names,
            )  # fmt: skip
            row.update(cmp_row)
            checks.extend(call_checks)
        absent = placeholder_inputs(alignment, call, slots)
        if absent and row["SUCCESS"] is False:
            row["SUCCESS"] = None
            for c in checks:
                if c.call == call.index and c.success is False:
                    c.success = None
        row.update(
            index=call.index,
            duration_torch=call.latency,
            ort_duration=ort_duration,
            n_inputs=len(mapping),
            n_none=sum(1 for s in slots if s is None),
            n_empty=sum(1 for t in tensors if t.numel() == 0),
            absent_inputs=",".join(map(str, absent)),
        )
        if loaded.ran:
            row["ran"] = loaded.ran
        if include_io:
            row["inputs"] = _summary(tensors)
            row["outputs"] = _summary(expected)
        rows.append(row)
        logger.debug("call %d: %s", call.index, "ok" if row["SUCCESS"] else row.get("error") or "differs")
        notify(on_progress, "validate", len(rows), total, f"call {call.index}")
    return rows, checks


def _failed_row(error: str | None, hist: Sequence[float]) -> dict[str, Any]:
    """The columns of a call that was not compared (its run failed, or no program serves it)."""
    row = {"SUCCESS": False, "error": error, "abs": math.nan, "rel": math.nan, "sum": math.nan, "n": 0, "dnan": 0}
    return row | {f">{h}": 0 for h in hist}


def _fetched_outputs(
    names: Sequence[str],
    by_name: Mapping[str, str] | None,
    output_names: list[str] | None,
    graph_outputs: Sequence[str],
    session_outputs: Sequence[str],
) -> tuple[list[str] | None, Sequence[str], str | None]:
    """The graph outputs to fetch for a call whose recorded outputs are ``names``, their names, and why not.

    By name when the model maps its outputs (:func:`output_mapping`), else by position.
    """
    if by_name is None or not names:
        return output_names, graph_outputs, None
    missing = [n for n in names if n not in by_name]
    if missing:
        why = (
            f"the recorded outputs {', '.join(missing)} are not outputs of the model (its outputs: "
            f"{', '.join(session_outputs)}); validate with the model exported from this bundle"
        )
        return None, [], why
    fetch = [by_name[n] for n in names]
    return fetch, fetch, None


@dataclass
class ValidationReport:
    """The rows of :func:`check_discrepancies` plus a verdict, and (from :func:`validate_onnx`) one check per output.

    Attributes:
        rows: One dict per call (see :func:`check_discrepancies`).
        seconds: Wall time of the whole validation.
        tolerances: The comparison: tolerances by dtype and per output, the deciding statistic.
        outputs: One :class:`OutputCheck` per output of each call (name, shape, dtype, statistics).
        subject: What was compared with the recorded outputs (the ONNX file, the eager model).
        kind: ``"validate"`` (onnxruntime), ``"run"`` (the eager model re-run) or ``"diff"`` (two bundles).
    """

    rows: list[dict[str, Any]]
    seconds: float
    tolerances: Tolerances = field(default_factory=Tolerances)
    outputs: list[OutputCheck] = field(default_factory=list)
    subject: str = ""
    kind: str = "validate"

    atol = property(
        attrgetter("tolerances.atol"),
        doc="The default absolute tolerance (float32's and every dtype outside the table).",
    )
    rtol = property(attrgetter("tolerances.rtol"), doc="The default relative tolerance.")
    check_error_stat = property(
        attrgetter("tolerances.check_error_stat"),
        doc="The statistic that decides an output (``max``, ``mean``, ``median``, ``quantile``).",
    )
    error_quantile = property(
        attrgetter("tolerances.error_quantile"),
        doc='The quantile reported (and checked with ``check_error_stat="quantile"``).',
    )

    @property
    def n_failed(self) -> int:
        return sum(1 for r in self.rows if r["SUCCESS"] is False)

    @property
    def ok(self) -> bool:
        return self.n_failed == 0

    @property
    def ran(self) -> str:
        """How the model ran when not as it is (``bfloat16 program validated through a float32 copy``), else empty."""
        return "; ".join(dict.fromkeys(str(r["ran"]) for r in self.rows if r.get("ran")))

    def histogram(self) -> list[tuple[str, int]]:
        """``(bin label, count)`` of the absolute errors of every compared element, every output of every call."""
        counts = zip(*(check.stats.hist for check in self.outputs if check.stats is not None))
        return list(zip(histogram_labels(), [sum(c) for c in counts] or [0] * len(histogram_labels())))

    def criterion(self) -> str:
        """The rule a call passed by: tolerances (with the dtypes' rows used) and statistic, e.g. ``atol=0.0001 rtol=0.1``."""
        text = self.tolerances.describe(c.dtype for c in self.outputs)
        if self.check_error_stat == "quantile":
            return f"{text}, on the {self.error_quantile:g} quantile of the errors"
        if self.check_error_stat != "max":
            return f"{text}, on the {self.check_error_stat} error"
        return text

    def verdict(self) -> str:
        """``PASS: 6/6 calls within atol=0.0001 rtol=0.1``, and how the model ran when not as it is."""
        n = len(self.rows)
        passed = sum(1 for r in self.rows if r["SUCCESS"])
        ran = f"; {self.ran}" if self.ran else ""
        return f"{'PASS' if self.ok else 'FAIL'}: {passed}/{n} calls within {self.criterion()}{ran}"


def validate_onnx(
    rc: RecordedCalls,
    onnx_model: str | os.PathLike[str] | onnx.ModelProto | torch.onnx.ONNXProgram,
    *,
    on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
    tolerances: Tolerances | None = None,
) -> ValidationReport:  # fmt: skip
    """Validate ``onnx_model`` on every recorded call, output by output; see :func:`check_discrepancies`.

    Each output of each call is compared on its own: its tolerances are ``output_atol`` /
    ``output_rtol`` for its name (its path in the output tree such as ``logits`` or
    ``past_key_values[0]``, or its ONNX name; ``fnmatch`` patterns allowed), else those of the
    dtype it was recorded in (:data:`~iobundle.replay.check.DTYPE_TOLERANCES`: float16 and
    bfloat16 are looser), else ``atol`` / ``rtol``. With ``check_error_stat="max"`` every element
    must be within ``atol`` or within ``rtol``; with ``mean``, ``median`` or ``quantile`` that
    statistic of the absolute errors must be within ``atol``, or that of the relative errors
    within ``rtol``. ``tolerances`` gives all of this as one value (the other options are then
    ignored).

    A half-precision model that onnxruntime's CPU provider has no kernel for runs as its float32
    copy (the same graph, values widened, in memory); the verdict says so.

    Raises:
        ModelLoadError: The model cannot be loaded, or its inputs do not fit the recorded calls (names, element types, ranks; a ReplayError).
        ToleranceError: A statistic is unknown, or a per-output tolerance names no output.

    Example:
        >>> report = validate_onnx(rc, "model.onnx", output_atol={"logits": 1e-3}, check_error_stat="median")
        >>> report.verdict()
        'PASS: 6/6 calls within atol=0.0001 rtol=0.1 (logits: atol=0.001), on the median error'

    .. versionchanged:: 0.2
        Per-output checks (``outputs``), ``output_atol``, ``output_rtol``, ``check_error_stat``,
        ``error_quantile``, ``on_progress``.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile)
    begin = time.perf_counter()
    tolerances = tolerances.for_calls(rc.ok_calls)  # the report names the calls under torch.autocast
    rows, checks = _run_checks(
        rc, onnx_model, tolerances=tolerances, hist=(0.1, 0.01), progress_bar=False, include_io=False,
        skip_none=True, per_output=True, on_progress=on_progress,
    )  # fmt: skip
    refuse_unused(tolerances, checks)
    subject = str(onnx_model) if not _is_proto(onnx_model) else "an onnx.ModelProto"
    return ValidationReport(
        rows=rows, seconds=time.perf_counter() - begin, outputs=checks, tolerances=tolerances, subject=subject
    )


def refuse_unused(tolerances: Tolerances, checks: Sequence[OutputCheck]) -> None:
    """A per-output tolerance that matches no compared output is a typo: say which names exist."""
    if not checks:  # nothing was compared (every run failed): the rows say why, not the tolerances
        return
    refuse_unknown_outputs(tolerances, [(c.name, c.other_name or "") for c in checks])


def recorded_output_names(
    calls: Sequence[Any], other_names: Sequence[str] | Mapping[str, str] | None = None
) -> list[tuple[str, ...]]:
    """The names of every output of ``calls``: their :func:`output_paths`, each with its other name.

    ``other_names`` are the model's names of the outputs: a list by position, or a mapping from
    the recorded name (:func:`output_mapping`).

    Read from the manifest alone (no tensor is loaded), so tolerances can be checked before a run.
    """
    return _name_groups([output_paths(call.outputs) for call in calls if call.outputs is not None], other_names)


def _name_groups(
    calls: Sequence[Sequence[str]], other_names: Sequence[str] | Mapping[str, str] | None
) -> list[tuple[str, ...]]:
    """:func:`recorded_output_names` of calls whose outputs' names are ``calls``."""
    groups: dict[tuple[str, ...], None] = {}
    for names in calls:
        for i, name in enumerate(names):
            if isinstance(other_names, Mapping):
                other = other_names.get(name, "")
            else:
                other = other_names[i] if other_names is not None and i < len(other_names) else ""
            groups[(name, other)] = None
    return list(groups)


def refuse_unknown_outputs(tolerances: Tolerances, groups: Sequence[Sequence[str]]) -> None:
    """Refuse a per-output tolerance that matches none of the outputs ``groups`` (each given as its names).

    Raises:
        ToleranceError: A key matches no output; the message lists the outputs.
    """
    if not groups:
        return
    unused = tolerances.unused(groups)
    if unused:
        known = list(dict.fromkeys(n for g in groups for n in g if n))
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        raise ToleranceError(
            f"Per-output tolerance for {', '.join(map(repr, unused))} matches no output. Outputs: {shown}. "
            "Use one of these names or an fnmatch pattern (e.g. 'past_key_values*')."
        )


def check_program_index(
    rc: RecordedCalls,
    index_path: str | os.PathLike[str],
    **options: Any,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Validate every recorded call with the program of ``index_path`` whose structure it has.

    Calls are assigned by structure (:func:`call_structures`), then, among the programs of that
    structure, by their size rules (a program split by the sizes another refused), not by index,
    so an index also validates another bundle of the same model. The calls of each program are validated with
    ``options`` as one ONNX file is; each of its rows gets a ``program`` column. A call that no program serves is a failed row saying so.

    Raises:
        ManifestError: The index cannot be read.
        ModelLoadError: A program's ONNX file cannot be loaded.
    """
    index_path = Path(index_path)
    index = load_program_index(index_path)
    assigned: dict[str, list[int]] = {p.name: [] for p in index.programs}
    rows: list[dict[str, Any]] = []
    checks: list[Any] = []
    calls = {call.index: call for call in rc.ok_calls}
    for index_of_call, structure in call_structures(rc):
        call = calls[index_of_call]
        shaped = [p for p in index.programs if structure in program_structures(p)]
        alone = phase_calls(rc, [index_of_call])
        aligned = align_calls(alone)
        fits = (p for p in shaped if sizes_match(p, call_sizes(alone, aligned, 0)))
        program = next((p for p in fits if values_match(p, call_values(alone, aligned, 0))), None)
        if program is None:
            odd = ", ".join(f"{k} {v}" for k, v in structure.items() if v != "present") or "every input present"
            if shaped:  # the structure is served, not these sizes
                odd += "; its sizes meet no size rule: " + "; ".join(f"{p.name}: {p.describe_sizes()}" for p in shaped)
            why = f"no program of {index_path.name} serves call {call.index} ({odd}); programs: "
            row: dict[str, Any] = {"SUCCESS": False, "index": call.index, "program": None}
            row.update(_failed_row(why + ", ".join(p.name for p in index.programs), options.get("hist", (0.1, 0.01))))
            rows.append(row | {"duration_torch": call.latency, "ort_duration": 0.0, "absent_inputs": ""})
            continue
        assigned[program.name].append(call.index)
    for program in index.programs:
        if not assigned[program.name]:
            continue
        sub = phase_calls(rc, assigned[program.name])
        try:
            program_rows, program_checks = _run_checks(sub, index_path.parent / program.file, **options)
        except ReplayError as exc:
            raise type(exc)(f"{index_path.name}, program {program.name}: {exc}") from exc
        for row in program_rows:
            row["program"] = program.name
        rows.extend(program_rows)
        checks.extend(program_checks)
    return sorted(rows, key=lambda r: r["index"]), checks
