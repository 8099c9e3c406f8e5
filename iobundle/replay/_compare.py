"""Compare expected and obtained output tensors: errors, histogram counts, pass/fail."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Comparison", "compare_outputs"]


@dataclass
class Comparison:
    """How far a list of obtained outputs is from the expected ones.

    ``abs`` and ``rel`` are the largest absolute and relative errors; ``hist`` counts the
    elements whose absolute error exceeds each threshold; ``dnan`` counts positions where
    exactly one side is NaN. ``success`` holds when shapes and dtypes agree, NaNs agree and
    every element is within ``atol`` or within ``rtol`` of the expected value. A bit-exact
    result is a success (abs is 0.0).
    """

    success: bool = True
    abs: float = 0.0
    rel: float = 0.0
    sum: float = 0.0
    n: int = 0
    dnan: int = 0
    hist: dict[float, int] = field(default_factory=dict)
    error: str | None = None

    def as_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"SUCCESS": self.success, "abs": self.abs, "rel": self.rel, "sum": self.sum, "n": self.n}
        row["dnan"] = self.dnan
        row.update({f">{h}": c for h, c in self.hist.items()})
        if self.error:
            row["error"] = self.error
        return row


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        if t.dtype.is_floating_point and t.element_size() < 4:
            t = t.float()  # bfloat16 / float8 have no numpy dtype
        return t.numpy()
    return np.asarray(value)


class Scratch:
    """Work buffers reused from one comparison to the next (one per dtype and slot, grown as needed)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[np.dtype[Any], int], np.ndarray] = {}

    def get(self, dtype: np.dtype[Any], size: int, slot: int = 0) -> np.ndarray:
        buf = self._buffers.get((dtype, slot))
        if buf is None or buf.size < size:
            buf = self._buffers[(dtype, slot)] = np.empty(size, dtype=dtype)
        return buf[:size]


CHUNK_ELEMENTS = 1 << 16
"""The fast path works through an output in pieces of this many elements: its few work buffers
stay in the CPU cache, and are reused (no page faults) from piece to piece and call to call."""

_ULP_MARGIN = 1.0 - 2.0**-20
"""A float32 difference or product is within 2**-24 (relative) of the exact one: elements that fail
the tolerance by this margin in float32 are re-checked exactly in float64 (as the general path does)."""


def _work_dtype(a: np.ndarray, b: np.ndarray) -> np.dtype[Any] | None:
    """The dtype the fast path computes in: the float dtype both sides share (float32 at least)."""
    if a.dtype.kind != "f" or b.dtype.kind != "f":
        return None
    if a.dtype == b.dtype:
        return a.dtype if a.dtype.itemsize >= 4 else np.dtype(np.float32)
    if a.dtype.itemsize <= 4 and b.dtype.itemsize <= 4:
        return np.dtype(np.float32)  # e.g. float16 on one side, float16 upcast to float32 on the other
    return None


def _accumulate(
    result: Comparison,
    a: np.ndarray,
    b: np.ndarray,
    *,
    atol: float,
    rtol: float,
    hist: Sequence[float],
    scratch: Scratch,
) -> None:
    """Add the comparison of one pair of non-empty arrays (same shape) to ``result``."""
    work = _work_dtype(a, b)
    if work is not None:
        fast = _compare_finite(a.reshape(-1), b.reshape(-1), work, atol, rtol, hist, scratch)
        if fast is not None:
            m, total, counts, rel, ok = fast
            result.abs = max(result.abs, m)
            result.rel = max(result.rel, rel)
            result.sum += total
            result.n += int(a.size)
            for h, c in zip(hist, counts):
                result.hist[h] += c
            result.success = result.success and ok
            return
    elif a.dtype.kind in "biu" and b.dtype.kind in "biu" and np.array_equal(a, b):
        result.n += int(a.size)  # equal integers: every error is 0
        return
    _accumulate_general(result, a, b, atol=atol, rtol=rtol, hist=hist)


def _compare_finite(
    a: np.ndarray,
    b: np.ndarray,
    work: np.dtype[Any],
    atol: float,
    rtol: float,
    hist: Sequence[float],
    scratch: Scratch,
) -> tuple[float, float, list[int], float, bool] | None:
    """``(abs, sum, hist counts, rel, within)`` of flat ``a`` and ``b`` computed in ``work``, piece by piece.

    None as soon as a piece holds a NaN or an infinity (on either side, or from an overflow).
    """
    size = min(a.size, CHUNK_ELEMENTS)
    diff_buf, scale_buf = scratch.get(work, size, 0), scratch.get(work, size, 1)
    m, total, rel, ok = 0.0, 0.0, 0.0, True
    counts = [0] * len(hist)
    for start in range(0, a.size, CHUNK_ELEMENTS):
        ac, bc = a[start : start + CHUNK_ELEMENTS], b[start : start + CHUNK_ELEMENTS]
        diff, scale = diff_buf[: ac.size], scale_buf[: ac.size]
        np.subtract(ac, bc, out=diff, dtype=work)
        np.abs(diff, out=diff)
        mc = float(diff.max())  # a NaN on either side, inf - inf or an overflow propagate to the max
        if not math.isfinite(mc):
            return None
        if mc == 0.0:
            continue  # bit-exact piece: adds nothing
        m = max(m, mc)
        total += float(diff.sum(dtype=np.float64))
        for i, h in enumerate(hist):
            if mc > h:
                counts[i] += int(np.count_nonzero(diff > h))
        np.abs(ac, out=scale, dtype=work)
        if ok and mc > atol * _ULP_MARGIN:
            over = (diff > atol * _ULP_MARGIN) & (diff > scale * (rtol * _ULP_MARGIN))
            idx = np.flatnonzero(over)
            if idx.size:  # the candidates, decided exactly as the general path does (in float64)
                a64 = ac[idx].astype(np.float64)
                d64 = np.abs(a64 - bc[idx].astype(np.float64))
                ok = not bool(np.any((d64 > atol) & (d64 > rtol * np.abs(a64))))
        np.maximum(scale, 1e-12, out=scale)
        np.divide(diff, scale, out=scale)
        rc = float(scale.max())
        if not math.isfinite(rc):  # the float32 ratio overflowed: redo it in float64
            rc = float((diff.astype(np.float64) / np.maximum(np.abs(ac.astype(np.float64)), 1e-12)).max())
        rel = max(rel, rc)
    return m, total, counts, rel, ok


def _accumulate_general(
    result: Comparison, a: np.ndarray, b: np.ndarray, *, atol: float, rtol: float, hist: Sequence[float]
) -> None:
    """Every case (NaN, inf, mixed dtypes, complex, integers that differ), in float64."""
    if a.dtype.kind in "fc":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        dnan = int(np.count_nonzero(nan_a != nan_b))
        diff = np.abs(np.where(nan_a | nan_b, 0.0, a64 - b64))
        both_inf = np.isinf(a64) & np.isinf(b64) & (a64 == b64)
        diff = np.where(both_inf, 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
    else:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        dnan = 0
        diff = np.abs(a64 - b64)
    scale = np.abs(np.where(np.isfinite(a64), a64, 0.0))
    result.dnan += dnan
    result.abs = max(result.abs, float(diff.max()))
    result.rel = max(result.rel, float((diff / np.maximum(scale, 1e-12)).max()))
    result.sum += float(diff.sum())
    result.n += int(diff.size)
    for h in hist:
        result.hist[h] += int(np.count_nonzero(diff > h))
    within = (diff <= atol) | (diff <= rtol * scale)
    if dnan or not bool(within.all()):
        result.success = False


def compare_outputs(
    expected: Sequence[Any],
    obtained: Sequence[Any],
    *,
    atol: float,
    rtol: float,
    hist: Sequence[float] = (0.1, 0.01),
    skip_none: bool = True,
    scratch: Scratch | None = None,
) -> Comparison:
    """Compare two lists of tensors (torch or numpy) position by position.

    Float outputs of one dtype that are finite on both sides take a fast path: the difference
    is computed in that dtype (float16 and bfloat16 in float32), piece by piece into reused
    buffers, and the few elements out of tolerance are re-checked in float64. Anything else
    (NaN, inf, mixed dtypes, integers that differ) goes through float64, with the NaN/inf
    bookkeeping. Both give the same verdicts and counts (errors may differ in the last float32
    bit). Pass one ``scratch`` to successive calls to reuse its buffers.
    """
    scratch = scratch if scratch is not None else Scratch()
    result = Comparison(hist=dict.fromkeys(hist, 0))
    if len(expected) != len(obtained):
        result.success = False
        result.error = f"{len(obtained)} outputs, expected {len(expected)}"
        return result
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf and overflows are handled, not warned about
        _compare_all(result, expected, obtained, atol=atol, rtol=rtol, hist=hist, skip_none=skip_none, scratch=scratch)
    return result


def _compare_all(
    result: Comparison,
    expected: Sequence[Any],
    obtained: Sequence[Any],
    *,
    atol: float,
    rtol: float,
    hist: Sequence[float],
    skip_none: bool,
    scratch: Scratch,
) -> None:
    for i, (e, o) in enumerate(zip(expected, obtained)):
        if e is None or o is None:
            if (e is None) != (o is None) and not skip_none:
                result.success = False
                result.error = f"output {i}: missing"
            continue
        a, b = _as_numpy(e), _as_numpy(o)
        if a.shape != b.shape:
            result.success = False
            result.error = f"output {i}: shape {tuple(b.shape)}, expected {tuple(a.shape)}"
            return
        if a.dtype != b.dtype and not (a.dtype.kind == b.dtype.kind == "f"):
            result.success = False
            result.error = f"output {i}: dtype {b.dtype}, expected {a.dtype}"
            return
        if a.size == 0:
            continue
        _accumulate(result, a, b, atol=atol, rtol=rtol, hist=hist, scratch=scratch)
