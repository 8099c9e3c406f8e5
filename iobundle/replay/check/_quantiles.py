"""The median and a quantile of an output's errors, equal to numpy's, without sorting all of them.

``np.median`` and ``np.quantile`` partition the whole array around each order statistic they
need (and its minimum and maximum): on a few million errors that costs more than running the
model. :func:`median_and_quantile` finds the order statistics in a window of the values
instead: a sample of the array (at random positions, fixed seed) bounds where each one lies,
one counting pass checks the bounds, and only the values between them are partitioned. A window
that misses (the check fails) falls back to partitioning the whole array, so the result never depends on the sample.
The median and the quantile are then computed from the order statistics exactly as numpy
computes them (the mean of the two middle values; the ``linear`` method's interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from iobundle._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy", globals(), "np")

__all__ = ["median_and_quantile"]

SAMPLE = 4096
"""About how many values the sample holds; arrays up to 16 times this size are partitioned whole."""


def _sample_indices(n: int) -> np.ndarray:
    """:data:`SAMPLE` random positions in ``n`` values (fixed seed); a stride would see a few columns of a matrix."""
    return np.sort(np.random.default_rng(n).integers(0, n, SAMPLE))


def _order_stats(x: np.ndarray, ranks: Sequence[int]) -> list[float]:
    """The values of ranks ``ranks`` (sorted, in ``[0, x.size)``) of the NaN-free flat ``x``, which may be reordered."""
    n = x.size
    if n <= 16 * SAMPLE:
        x.partition(list(ranks))
        return [float(x[r]) for r in ranks]
    sample = np.sort(x[_sample_indices(n)])
    m = sample.size
    p = (ranks[0] + ranks[-1]) / 2 / n
    margin = 4.0 * math.sqrt(m * p * (1.0 - p)) + 8.0  # four standard deviations of the sample's rank, and some
    first, last = math.floor(ranks[0] / n * m - margin), math.ceil(ranks[-1] / n * m + margin)
    lo = float(sample[first]) if first > 0 else -math.inf
    hi = float(sample[last]) if last < m else math.inf
    inside = np.greater_equal(x, lo) if first > 0 else None
    below = n - int(np.count_nonzero(inside)) if inside is not None else 0
    if lo == hi:  # the window holds one value
        window_size = int(np.count_nonzero(x == lo))
        if below <= ranks[0] and ranks[-1] < below + window_size:
            return [lo] * len(ranks)
    else:
        upper = np.less_equal(x, hi)
        window = x[upper if inside is None else np.logical_and(inside, upper, out=upper)]
        if below <= ranks[0] and ranks[-1] < below + window.size:
            window.partition([r - below for r in ranks])
            return [float(window[r - below]) for r in ranks]
    x.partition(list(ranks))  # the sample misled the window: select in the whole array
    return [float(x[r]) for r in ranks]


def _linear(n: int, q: float) -> tuple[int, int, float]:
    """numpy's ``linear`` method: the two ranks a quantile lies between and the weight of the second."""
    virtual = (n - 1) * q
    if virtual >= n - 1:
        return n - 1, n - 1, virtual + 1.0  # numpy takes the last value (its index -1) on both sides
    previous = math.floor(virtual)
    return previous, previous + 1, virtual - previous


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's interpolation between ``a`` and ``b`` (from the nearer end, as ``np.quantile`` does)."""
    diff = b - a
    return b - diff * (1.0 - t) if t >= 0.5 else a + diff * t


def median_and_quantile(x: np.ndarray, q: float) -> tuple[float, float]:
    """``(np.median(x), np.quantile(x, q))`` of a flat, non-empty float64 array without NaN; ``x`` is reordered.

    Equal to numpy's values (not approximately): the same order statistics, combined by the
    same float operations.
    """
    n = x.size
    half = n // 2
    middle = [half - 1, half] if n % 2 == 0 else [half]
    previous, following, gamma = _linear(n, q)
    values = dict(zip(middle, _order_stats(x, middle)))
    rest = sorted({previous, following} - set(values))
    if rest:  # the quantile's ranks: a window of their own
        values.update(zip(rest, _order_stats(x, rest)))
    median = (values[half - 1] + values[half]) / 2 if n % 2 == 0 else values[half]
    return median, _lerp(values[previous], values[following], gamma)
