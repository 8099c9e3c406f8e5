"""Compare expected and obtained output tensors: errors, histogram counts, pass/fail.

Two levels: :func:`compare_outputs` decides a whole call quickly (largest errors, ``>h`` counts);
:func:`error_stats` describes one output (max, mean, median and a quantile of its absolute and
relative errors, a log-scale histogram) and :func:`stat_passes` decides it with the statistic
the user chose (Polygraphy's ``--check-error-stat``), with per-output tolerances from
:class:`Tolerances`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls import tensor_paths
from iobundle.replay.check._quantiles import median_and_quantile
from iobundle.replay.check._tolerances import Tolerances
from iobundle.schema import Node

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = lazy_module("numpy", globals(), "np")

__all__ = [
    "HISTOGRAM_EDGES",
    "Comparison",
    "ErrorStats",
    "OutputCheck",
    "compare_call",
    "compare_outputs",
    "error_stats",
    "flatten_outputs",
    "histogram_labels",
    "output_paths",
    "stat_passes",
]

HISTOGRAM_EDGES = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""Upper edges of the error histogram's bins; before them a bin of exact matches, after them ``> 1``."""


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
        row.update(dnan=self.dnan, **{f">{h}": c for h, c in self.hist.items()})
        return row | ({"error": self.error} if self.error else {})


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
            result.abs, result.rel = max(result.abs, m), max(result.rel, rel)
            result.sum, result.n = result.sum + total, result.n + a.size
            result.hist.update({h: result.hist[h] + c for h, c in zip(hist, counts)})
            result.success = result.success and ok
            return
    elif a.dtype.kind in "biu" and b.dtype.kind in "biu" and np.array_equal(a, b):
        result.n += int(a.size)  # equal integers: every error is 0
        return
    # Every other case (NaN, inf, mixed dtypes, complex, integers that differ), in float64.
    out = _describe(a, b, atol=atol, rtol=rtol, quantile=None, hist=hist)
    out.add_to(result)
    result.success = result.success and out.stats.within


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
        if float(scale.min()) < 1e-12:  # a reduction costs less than the maximum taken everywhere
            np.maximum(scale, 1e-12, out=scale)
        np.divide(diff, scale, out=scale)
        rc = float(scale.max())
        if not math.isfinite(rc):  # the float32 ratio overflowed: redo it in float64
            rc = float((diff.astype(np.float64) / np.maximum(np.abs(ac.astype(np.float64)), 1e-12)).max())
        rel = max(rel, rc)
    return m, total, counts, rel, ok


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
    small: dict[tuple[Any, Any], list[tuple[np.ndarray, np.ndarray]]] = {}  # by dtypes: compared as one
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
            break
        if a.dtype != b.dtype and not (a.dtype.kind == b.dtype.kind == "f"):
            result.success = False
            result.error = f"output {i}: dtype {b.dtype}, expected {a.dtype}"
            break
        if a.size >= CHUNK_ELEMENTS:
            _accumulate(result, a, b, atol=atol, rtol=rtol, hist=hist, scratch=scratch)
        elif a.size:
            small.setdefault((a.dtype, b.dtype), []).append((a.reshape(-1), b.reshape(-1)))
    for pairs in small.values():  # every count is a sum or a maximum: one pass over them all costs less than one each
        a, b = (np.concatenate(side) for side in zip(*pairs))
        _accumulate(result, a, b, atol=atol, rtol=rtol, hist=hist, scratch=scratch)


# --------------------------------------------------------------------------- statistics of one output


def histogram_labels() -> list[str]:
    """The labels of the bins of :attr:`ErrorStats.hist`: ``0``, ``<=1e-08``, ``(1e-08, 1e-07]``, ..., ``>1``."""
    labels = ["0", f"<={HISTOGRAM_EDGES[0]:g}"]
    labels += [f"({lo:g}, {hi:g}]" for lo, hi in itertools.pairwise(HISTOGRAM_EDGES)]
    return [*labels, f">{HISTOGRAM_EDGES[-1]:g}"]


@dataclass
class ErrorStats:
    """Statistics of the element-wise errors of one output (absolute ``|e - o|``, relative ``/|e|``).

    An element where exactly one side is NaN counts as an infinite error (``dnan`` counts them);
    NaN on both sides, or the same infinity, is an exact match. ``hist`` counts the absolute
    errors per bin of :data:`HISTOGRAM_EDGES` (labels: :func:`histogram_labels`). ``within``
    says whether every element is within ``atol`` or within ``rtol``. The medians and quantiles
    are None when they were not selected (:attr:`Tolerances.quantiles`).
    """

    n: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    median_abs: float | None = 0.0
    quantile_abs: float | None = 0.0
    max_rel: float = 0.0
    mean_rel: float = 0.0
    median_rel: float | None = 0.0
    quantile_rel: float | None = 0.0
    dnan: int = 0
    within: bool = True
    hist: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_EDGES) + 2))

    def stat(self, name: str) -> tuple[float | None, float | None]:
        """``(absolute, relative)`` value of the statistic ``name`` (one of :data:`ERROR_STATS`)."""
        return getattr(self, f"{name}_abs"), getattr(self, f"{name}_rel")


def _errors(a: np.ndarray, b: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """Flat float64 ``(abs errors, |expected|, where exactly one side is NaN, largest error)`` of two non-empty
    arrays of one shape.

    In ``scratch``'s reused buffers (fresh memory costs a page fault per page). The NaN and infinity
    bookkeeping runs only when some error is not finite. The mask is None when no element is NaN on one side only.
    """
    a64, b64 = scratch.get(np.dtype(np.float64), a.size, 2), scratch.get(np.dtype(np.float64), a.size, 3)
    diff = scratch.get(np.dtype(np.float64), a.size, 4)
    np.copyto(a64, a.reshape(-1), casting="unsafe")
    np.copyto(b64, b.reshape(-1), casting="unsafe")
    with np.errstate(over="ignore", invalid="ignore"):
        np.subtract(a64, b64, out=diff)
        np.abs(diff, out=diff)
        peak = float(diff.max())
        if math.isfinite(peak):  # a NaN or an infinity on either side shows in the max
            return diff, np.abs(a64, out=a64), None, peak
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        one_nan = nan_a != nan_b
        diff[(nan_a & nan_b) | (np.isinf(a64) & (a64 == b64))] = 0.0
        diff[one_nan | np.isnan(diff)] = np.inf
        scale = np.abs(np.where(np.isfinite(a64), a64, 0.0))
    return diff, scale, one_nan if one_nan.any() else None, float(diff.max())


@dataclass
class _Output:
    """One pass over one output: its statistics, and its part of the call's row.

    The row (:class:`Comparison`) counts an element NaN on one side only as an error of 0 (its
    ``dnan`` says so), where the statistics count it as infinite.
    """

    stats: ErrorStats
    abs: float
    rel: float
    sum: float
    total: float = 0.0
    """The sum of the statistics' absolute errors (one-sided NaNs as infinite)."""
    diff: np.ndarray | None = None
    """Every absolute error, in no particular order, when the median and quantile were selected; else None."""
    over: dict[float, int] = field(default_factory=dict)
    """How many errors (one-sided NaNs excluded) exceed each row threshold that is no edge of the histogram."""

    def add_to(self, result: Comparison) -> None:
        """Add this output's part to the row ``result`` (as :func:`compare_outputs` counts it)."""
        result.abs, result.rel, result.sum = max(result.abs, self.abs), max(result.rel, self.rel), result.sum + self.sum
        result.n, result.dnan = result.n + self.stats.n, result.dnan + self.stats.dnan
        result.hist.update({h: count + self.exceeding(h) for h, count in result.hist.items()})

    def exceeding(self, h: float) -> int:
        """How many errors exceed ``h`` for the row's ``>h`` column (one-sided NaNs excluded)."""
        if self.stats.max_abs <= h:
            return 0
        if h in HISTOGRAM_EDGES:
            return sum(self.stats.hist[HISTOGRAM_EDGES.index(h) + 2 :]) - self.stats.dnan
        return self.over[h]


def _describe(
    a: np.ndarray, b: np.ndarray, *, atol: float, rtol: float, quantile: float | None, hist: Sequence[float] = (),
    scratch: Scratch | None = None, slot: int = 0,
) -> _Output:  # fmt: skip
    """Every statistic of one output in one pass over its errors (:class:`ErrorStats`), and its part of the row.

    The errors are computed in float64 piece by piece (:data:`CHUNK_ELEMENTS`), in ``scratch``'s reused
    buffers, which stay in the CPU cache. The median and ``quantile`` of the errors need all of them
    (kept in ``slot``'s buffer for the call's own, :func:`_call_errors`): with ``quantile`` None they are
    not computed (None). ``hist`` are the row's thresholds (counted here when they are no edge of the histogram).
    """
    scratch = scratch if scratch is not None else Scratch()
    a, b, n = a.reshape(-1), b.reshape(-1), int(a.size)
    f64 = np.dtype(np.float64)
    kept = (scratch.get(f64, n, 8 + slot), scratch.get(f64, n, 5)) if quantile is not None else None
    top = total = top_rel = total_rel = row_abs = row_rel = row_sum = 0.0
    dnan, within, greater = 0, True, [0] * (len(HISTOGRAM_EDGES) + 1)
    over = dict.fromkeys((h for h in hist if h not in HISTOGRAM_EDGES), 0)
    if not n:
        return _Output(ErrorStats(), 0.0, 0.0, 0.0, diff=None if kept is None else kept[0], over=over)
    for start in range(0, n, CHUNK_ELEMENTS):
        stop = min(n, start + CHUNK_ELEMENTS)
        diff, scale, one_nan, peak = _errors(a[start:stop], b[start:stop], scratch)
        nans, part = 0 if one_nan is None else int(np.count_nonzero(one_nan)), float(diff.sum())
        dnan, top, total = dnan + nans, max(top, peak), total + part
        within = within and (peak <= atol or bool(np.all((diff <= atol) | (diff <= rtol * scale))))
        for i, edge in enumerate((0.0, *HISTOGRAM_EDGES)):
            if peak <= edge:
                break
            greater[i] += int(np.count_nonzero(diff > edge))
        for h in over:
            over[h] += int(np.count_nonzero(diff > h)) - nans if peak > h else 0
        rel = np.maximum(scale, 1e-12, out=scale) if float(scale.min()) < 1e-12 else scale
        with np.errstate(over="ignore", invalid="ignore"):
            np.divide(diff, rel, out=rel)
        peak_rel = float(rel.max())
        top_rel, total_rel = max(top_rel, peak_rel), total_rel + float(rel.sum())
        if one_nan is None:
            row_abs, row_rel, row_sum = max(row_abs, peak), max(row_rel, peak_rel), row_sum + part
        else:  # the row's errors count those elements as 0
            row_abs = max(row_abs, float(np.where(one_nan, 0.0, diff).max()))
            row_rel = max(row_rel, float(np.where(one_nan, 0.0, rel).max()))
            row_sum += float(np.where(one_nan, 0.0, diff).sum())
        if kept is not None:
            kept[0][start:stop], kept[1][start:stop] = diff, rel
    counts = [n - greater[0], *(lo - hi for lo, hi in itertools.pairwise(greater)), greater[-1]]
    stats = ErrorStats(
        n=n, max_abs=top, mean_abs=total / n, max_rel=top_rel, mean_rel=total_rel / n, dnan=dnan,
        within=dnan == 0 and within, hist=counts,
    )  # fmt: skip
    if kept is None or quantile is None:
        stats.median_abs = stats.quantile_abs = stats.median_rel = stats.quantile_rel = None
    else:
        stats.median_rel, stats.quantile_rel = median_and_quantile(kept[1], quantile)
        stats.median_abs, stats.quantile_abs = median_and_quantile(kept[0], quantile)
    return _Output(stats, row_abs, row_rel, row_sum, total, None if kept is None else kept[0], over)


def error_stats(expected: Any, obtained: Any, *, atol: float, rtol: float, quantile: float = 0.99) -> ErrorStats:
    """Describe how far ``obtained`` is from ``expected`` (torch or numpy, same shape), element by element.

    Args:
        expected: The reference values.
        obtained: The values to check, of the same shape.
        atol: Absolute tolerance (for :attr:`ErrorStats.within`).
        rtol: Relative tolerance (for :attr:`ErrorStats.within`).
        quantile: The quantile reported as ``quantile_abs`` / ``quantile_rel``, in [0, 1].
    """
    return _describe(_as_numpy(expected), _as_numpy(obtained), atol=atol, rtol=rtol, quantile=quantile).stats


def stat_passes(stats: ErrorStats, *, atol: float, rtol: float, check_error_stat: str = "max") -> bool:
    """Whether one output passes under the statistic ``check_error_stat`` (see :data:`ERROR_STATS`)."""
    if stats.dnan:
        return False
    if check_error_stat == "max":
        return stats.within
    value_abs, value_rel = stats.stat(check_error_stat)
    assert value_abs is not None and value_rel is not None, "compare_call selects the statistic it decides by"
    return value_abs <= atol or value_rel <= rtol


def output_paths(node: Node | None) -> list[str]:
    """A readable name for each tensor of an output tree, in flattening order.

    A lone tensor is ``output``; the fields of a dict or a ``ModelOutput`` are their names
    (``logits``, ``past_key_values``); items of sequences and caches are indexed
    (``output[1]``, ``past_key_values[3]``); nested names are joined with dots. This is the
    path syntax of ``iobundle.calls`` (``tensor_paths``), the one ``--atol NAME=...`` takes.
    """
    return [name for name, _ in tensor_paths(node)]


# --------------------------------------------------------------------------- one call, output by output


@dataclass
class OutputCheck:
    """How one output of one recorded call compares (see :func:`compare_call`).

    ``success`` is None when the output was not compared (absent on one side).
    """

    call: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    atol: float
    rtol: float
    success: bool | None
    stats: ErrorStats | None = None
    error: str | None = None
    other_name: str | None = None
    """The output's name on the other side when it differs (an ONNX graph output)."""

    def as_row(self) -> dict[str, Any]:
        """A flat dict (DataFrame-ready): call, name, shape, dtype, tolerances, success, statistics."""
        row: dict[str, Any] = {
            "call": self.call,
            "output": self.name,
            "onnx_name": self.other_name or "",
            "shape": "x".join(map(str, self.shape)) or "scalar",
            "dtype": self.dtype,
            "atol": self.atol,
            "rtol": self.rtol,
            "SUCCESS": self.success,
        }
        stats = self.stats or ErrorStats()
        for key in ("n", "max_abs", "mean_abs", "median_abs", "quantile_abs", "max_rel", "mean_rel"):
            row[key] = getattr(stats, key)
        row.update(median_rel=stats.median_rel, quantile_rel=stats.quantile_rel, dnan=stats.dnan)
        row["error"] = self.error or ""
        return row


def _recorded_dtype(value: Any) -> str:
    """The dtype name of a recorded tensor (torch or numpy): ``bfloat16``, ``float32``; empty for None."""
    return "" if value is None else str(getattr(value, "dtype", "")).replace("torch.", "")


def compare_call(
    expected: Sequence[Any],
    obtained: Sequence[Any],
    *,
    call_index: int,
    names: Sequence[str],
    tolerances: Tolerances,
    hist: Sequence[float] = (0.1, 0.01),
    skip_none: bool = True,
    scratch: Scratch | None = None,
    per_output: bool = True,
    other_names: Sequence[str] | None = None,
) -> tuple[dict[str, Any], list[OutputCheck]]:
    """Compare the outputs of one call: the row of :func:`compare_outputs`, and one check per output.

    With ``per_output`` each output is decided with its own tolerances (by name and by recorded
    dtype) and ``tolerances.check_error_stat`` (the row's ``SUCCESS`` then follows them), and the
    row gains ``mean_abs``, ``median_abs``, ``quantile_abs`` (over every element of the call's
    outputs) and ``worst_output``. Outputs recorded in a dtype of ``tolerances.by_dtype``
    (float16, bfloat16) are always decided one by one.
    """
    check_error_stat = tolerances.check_error_stat
    wanted = tolerances.quantiles or check_error_stat in ("median", "quantile")  # the median and quantile
    quantile = tolerances.error_quantile if wanted else None
    per_output = per_output or any(_recorded_dtype(e) in tolerances.by_dtype for e in expected)
    if not per_output or len(expected) != len(obtained):
        cmp = compare_outputs(
            expected, obtained, atol=tolerances.atol, rtol=tolerances.rtol, hist=hist, skip_none=skip_none,
            scratch=scratch,
        )  # fmt: skip
        return cmp.as_row(), []
    # One pass per output gives its statistics and its part of the row (as compare_outputs counts it).
    result = Comparison(hist=dict.fromkeys(hist, 0))
    checks: list[OutputCheck] = []
    described: list[_Output] = []
    stopped = False  # the row stops at a shape or dtype mismatch, as compare_outputs does
    for i, (e, o) in enumerate(zip(expected, obtained)):
        a, b = (None if e is None else _as_numpy(e)), (None if o is None else _as_numpy(o))
        name = names[i] if i < len(names) else f"output[{i}]"
        other = other_names[i] if other_names is not None and i < len(other_names) else None
        other = other if other != name else None
        ref, array = (e, a) if a is not None else (o, b)
        array = array if array is not None else np.zeros(0)
        dtype = _recorded_dtype(ref) or str(array.dtype)
        atol, rtol = tolerances.for_output(name, other or "", dtype=dtype)
        check = OutputCheck(
            call=call_index, name=name, other_name=other, shape=tuple(int(d) for d in array.shape),
            dtype=dtype, atol=atol, rtol=rtol, success=None,
        )  # fmt: skip
        checks.append(check)
        if a is None or b is None:
            if (a is None) != (b is None) and not skip_none:
                check.success, check.error = False, "missing"
                if not stopped:
                    result.success, result.error = False, f"output {i}: missing"
            continue
        if a.shape != b.shape:
            check.success, check.error = False, f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
        elif a.dtype != b.dtype and not (a.dtype.kind == b.dtype.kind == "f"):
            check.success, check.error = False, f"dtype {b.dtype}, expected {a.dtype}"
        if check.error:
            if not stopped:
                result.success, result.error, stopped = False, f"output {i}: {check.error}", True
            continue
        out = _describe(a, b, atol=atol, rtol=rtol, quantile=quantile, hist=hist, scratch=scratch, slot=len(described))
        check.stats = out.stats
        check.success = stat_passes(out.stats, atol=atol, rtol=rtol, check_error_stat=check_error_stat)
        described.append(out)
        if not stopped:
            out.add_to(result)
    row = result.as_row()
    row.update(_call_errors(described, quantile))
    scored = [c for c in checks if c.stats is not None or c.error]
    worst = max(scored, key=lambda c: math.inf if c.error or c.stats is None else c.stats.max_abs, default=None)
    exact = worst is not None and not worst.error and worst.stats is not None and worst.stats.max_abs == 0.0
    row["worst_output"] = worst.name if worst is not None and not exact else ""  # none is worse when all match
    if result.error is None and not result.dnan:
        row["SUCCESS"] = all(c.success is not False for c in checks)
    else:
        row["SUCCESS"] = False
    return row, checks


def _call_errors(described: Sequence[_Output], quantile: float | None) -> dict[str, float | None]:
    """``mean_abs``, ``median_abs``, ``quantile_abs`` over every element of a call's compared outputs.

    The median and quantile are None when ``quantile`` is None (not selected: :attr:`Tolerances.quantiles`).
    """
    if len(described) == 1:  # the output's own statistics
        stats = described[0].stats
        return {"mean_abs": stats.mean_abs, "median_abs": stats.median_abs, "quantile_abs": stats.quantile_abs}
    n = sum(d.stats.n for d in described)
    if not n:
        return {"mean_abs": 0.0, "median_abs": 0.0, "quantile_abs": 0.0}
    median = value = None
    if quantile is not None:
        median, value = median_and_quantile(np.concatenate([d.diff for d in described if d.diff is not None]), quantile)
    return {"mean_abs": sum(d.total for d in described) / n, "median_abs": median, "quantile_abs": value}


def flatten_outputs(value: Any) -> list[torch.Tensor]:
    """The tensors of an output value, in the order recorded outputs are stored."""
    from iobundle.calls import TensorCollector, record_value, tensor_keys

    collector = TensorCollector(lambda t: t)
    node = record_value(value, collector, path="output", on_opaque=lambda *_: None)
    return [collector.tensors[k] for k in tensor_keys(node)]
