"""``median_and_quantile``: numpy's median and quantile, exactly, by selecting in a window of the values."""

from __future__ import annotations

import numpy as np
import pytest

from iobundle.replay.check._quantiles import SAMPLE, _sample_indices, median_and_quantile


def arrays() -> dict[str, np.ndarray]:
    g = np.random.default_rng(7)
    n = 40 * SAMPLE + 3  # large enough for the windowed selection
    rounded = np.abs(
        g.standard_normal(n).astype(np.float32).astype(np.float64) - g.standard_normal(n).astype(np.float32)
    )
    mostly_zero = np.zeros(n)
    mostly_zero[: n // 3] = g.random(n // 3)
    with_inf = g.random(n)
    with_inf[::7] = np.inf
    return {
        "one": np.array([3.0]),
        "two": np.array([1.0, 2.0]),
        "small": g.random(1001),
        "uniform": g.random(n),
        "uniform-even": g.random(n + 1),
        "float32-errors": rounded * 1e-6,
        "mostly-zero": mostly_zero,
        "three-values": g.integers(0, 3, n).astype(np.float64),
        "with-inf": with_inf,
        "sorted": np.sort(g.random(n)),
        "descending": np.sort(g.random(n))[::-1].copy(),
    }


@pytest.mark.parametrize("name", sorted(arrays()))
@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0])
def test_equals_numpy(name: str, q: float) -> None:
    x = arrays()[name]
    with np.errstate(invalid="ignore"):  # numpy's own interpolation next to an infinity
        want = (float(np.median(x)), float(np.quantile(x, q)))
    got = median_and_quantile(x.copy(), q)
    assert all(g == w or (np.isnan(g) and np.isnan(w)) for g, w in zip(got, want)), (got, want)


def test_a_sample_that_misleads_falls_back_to_the_whole_array() -> None:
    """The sample sees only zeros; the values between its points decide the median."""
    n = 64 * SAMPLE
    x = np.zeros(n)
    mask = np.ones(n, dtype=bool)
    mask[_sample_indices(n)] = False
    x[mask] = np.linspace(1.0, 2.0, int(mask.sum()))
    assert median_and_quantile(x.copy(), 0.9) == (float(np.median(x)), float(np.quantile(x, 0.9)))


@pytest.mark.parametrize("row", [512, 1024, 4096])
def test_the_sample_sees_every_column_of_a_matrix(row: int) -> None:
    """Errors of a (rows, row) output vary by column: a sample drawn at a stride that divides the row
    length saw 1 or 2 columns, missed its window and partitioned everything (3x slower validate)."""
    n = 2048 * row
    columns = np.unique(_sample_indices(n) % row)
    assert columns.size > min(row, SAMPLE) // 2
