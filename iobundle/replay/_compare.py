"""Compare expected and obtained output tensors: errors, histogram counts, pass/fail."""

from __future__ import annotations

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


def compare_outputs(
    expected: Sequence[Any],
    obtained: Sequence[Any],
    *,
    atol: float,
    rtol: float,
    hist: Sequence[float] = (0.1, 0.01),
    skip_none: bool = True,
) -> Comparison:
    """Compare two lists of tensors (torch or numpy) position by position."""
    result = Comparison(hist=dict.fromkeys(hist, 0))
    if len(expected) != len(obtained):
        result.success = False
        result.error = f"{len(obtained)} outputs, expected {len(expected)}"
        return result
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
            return result
        if a.dtype != b.dtype and not (a.dtype.kind == b.dtype.kind == "f"):
            result.success = False
            result.error = f"output {i}: dtype {b.dtype}, expected {a.dtype}"
            return result
        if a.size == 0:
            continue
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
    return result
