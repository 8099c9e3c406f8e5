"""Run an ONNX model with onnxruntime on every recorded call and compare with the recorded outputs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.errors import ModelLoadError, ReplayError
from iobundle.replay._compare import Scratch, compare_outputs
from iobundle.replay._export import INPUT_SLOTS_KEY, OUTPUT_NAMES_KEY
from iobundle.replay._inference import align_calls, aligned_tensors, placeholder_inputs

__all__ = ["ValidationReport", "check_discrepancies", "validate_onnx"]


def _session(onnx_model: str | os.PathLike[str] | onnx.ModelProto) -> tuple[Any, dict[str, str]]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        if isinstance(onnx_model, onnx.ModelProto):
            meta = {p.key: p.value for p in onnx_model.metadata_props}
            return ort.InferenceSession(
                onnx_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            ), meta
        path = Path(onnx_model)
        if not path.is_file():
            raise ModelLoadError(f"ONNX model '{path}' does not exist.")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return session, dict(session.get_modelmeta().custom_metadata_map)
    except ModelLoadError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"onnxruntime cannot load the model '{onnx_model}': {first}") from exc


def _input_mapping(session: Any, meta: dict[str, str], n_slots: int) -> list[tuple[str, int]]:
    """Graph input name -> aligned slot, from the metadata written at export, else by position."""
    names = [i.name for i in session.get_inputs()]
    if INPUT_SLOTS_KEY in meta:
        slots = json.loads(meta[INPUT_SLOTS_KEY])
        missing = [n for n in names if n not in slots]
        if missing:
            raise ReplayError(f"ONNX inputs {missing} are not recorded inputs (mapping in the model's metadata).")
        return [(n, int(slots[n])) for n in names]
    if len(names) != n_slots:
        raise ReplayError(
            f"The ONNX model has {len(names)} inputs but the recorded calls hold {n_slots} tensors, and the model "
            "carries no iobundle input mapping. Export it with `iobundle export` to embed one."
        )
    return list(zip(names, range(n_slots)))


def _summary(tensors: Sequence[Any]) -> str:
    parts = []
    for t in tensors:
        if t is None:
            parts.append("None")
        else:
            parts.append(f"{'x'.join(map(str, t.shape)) or 'scalar'}:{str(t.dtype).replace('torch.', '')}")
    return ", ".join(parts)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.contiguous().numpy()


def check_discrepancies(
    rc: RecordedCalls,
    onnx_model: str | os.PathLike[str] | onnx.ModelProto,
    *,
    atol: float = 1e-4,
    rtol: float = 0.1,
    hist: Sequence[float] = (0.1, 0.01),
    progress_bar: bool = False,
    include_io: bool = True,
    skip_none: bool = True,
) -> list[dict[str, Any]]:
    """Run ``onnx_model`` with onnxruntime on every recorded call; one dict per call (DataFrame-ready).

    Each row has ``SUCCESS, abs, rel, sum, n, dnan``, one ``>h`` count per threshold of ``hist``,
    ``index, duration_torch, ort_duration, n_inputs, n_none, n_empty``, ``absent_inputs`` (inputs
    absent at capture and fed a non-empty stand-in, zeros or a ``value_if_missing`` placeholder:
    such a row is reported with ``SUCCESS=None`` when it differs, never as a numeric mismatch;
    zero-length stand-ins for absent caches mean the same as absence and are checked normally),
    ``error`` when the run failed,
    and with ``include_io`` the ``inputs`` and ``outputs`` summaries.

    ``onnx_model`` may also be a program index (``*.programs.json``, written by ``iobundle export``
    when one program cannot serve every call): each call then runs through the program whose
    structure it has, and each row names it in a ``program`` column.

    Raises:
        ReplayError: The model cannot be loaded or its inputs do not match the recorded calls.
    """
    if not isinstance(onnx_model, onnx.ModelProto) and str(onnx_model).endswith(".json"):
        from iobundle.replay._phases import check_program_index

        return check_program_index(
            rc, onnx_model, atol=atol, rtol=rtol, hist=hist, progress_bar=progress_bar, include_io=include_io,
            skip_none=skip_none,
        )  # fmt: skip
    session, meta = _session(onnx_model)
    alignment = align_calls(rc)
    mapping = _input_mapping(session, meta, len(alignment.owners))
    output_names = json.loads(meta[OUTPUT_NAMES_KEY]) if OUTPUT_NAMES_KEY in meta else None
    scratch = Scratch()
    rows: list[dict[str, Any]] = []
    indices: Any = range(len(alignment.calls))
    if progress_bar:
        try:
            from tqdm import tqdm

            indices = tqdm(indices)
        except ImportError:
            pass
    for i in indices:
        call = alignment.calls[i]
        slots = alignment.slots[i]
        tensors = aligned_tensors(rc, alignment, slots)
        feeds = {name: _to_numpy(tensors[slot]) for name, slot in mapping}
        expected = [rc.store.get(k) for k in tensor_keys(call.outputs)] if call.outputs else []
        row: dict[str, Any] = {}
        begin = time.perf_counter()
        try:
            obtained = session.run(output_names, feeds)
            error = None
        except Exception as exc:
            obtained, error = None, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        ort_duration = time.perf_counter() - begin
        if error is not None or obtained is None:
            row.update(SUCCESS=False, error=error, abs=float("nan"), rel=float("nan"), sum=float("nan"), n=0, dnan=0)
            row.update({f">{h}": 0 for h in hist})
        else:
            row.update(
                compare_outputs(
                    expected, obtained, atol=atol, rtol=rtol, hist=hist, skip_none=skip_none, scratch=scratch
                ).as_row()
            )
        absent = placeholder_inputs(alignment, call, slots)
        if absent and row["SUCCESS"] is False:
            row["SUCCESS"] = None
        row.update(
            index=call.index,
            duration_torch=call.latency,
            ort_duration=ort_duration,
            n_inputs=len(mapping),
            n_none=sum(1 for s in slots if s is None),
            n_empty=sum(1 for t in tensors if t.numel() == 0),
            absent_inputs=",".join(map(str, absent)),
        )
        if include_io:
            row["inputs"] = _summary(tensors)
            row["outputs"] = _summary(expected)
        rows.append(row)
    return rows


@dataclass
class ValidationReport:
    """The rows of :func:`check_discrepancies` plus a verdict."""

    rows: list[dict[str, Any]]
    atol: float
    rtol: float
    seconds: float

    @property
    def n_failed(self) -> int:
        return sum(1 for r in self.rows if r["SUCCESS"] is False)

    @property
    def ok(self) -> bool:
        return self.n_failed == 0

    def verdict(self) -> str:
        n = len(self.rows)
        passed = sum(1 for r in self.rows if r["SUCCESS"])
        return f"{'PASS' if self.ok else 'FAIL'}: {passed}/{n} calls within atol={self.atol:g} rtol={self.rtol:g}"


def validate_onnx(
    rc: RecordedCalls, onnx_model: str | os.PathLike[str] | onnx.ModelProto, *, atol: float = 1e-4, rtol: float = 0.1
) -> ValidationReport:
    """Validate ``onnx_model`` on every recorded call; see :func:`check_discrepancies`."""
    begin = time.perf_counter()
    rows = check_discrepancies(rc, onnx_model, atol=atol, rtol=rtol, include_io=False)
    return ValidationReport(rows=rows, atol=atol, rtol=rtol, seconds=time.perf_counter() - begin)
