"""``compare_outputs``: the fast path (finite floats of one dtype) agrees with the general float64 path."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from iobundle.replay.check._compare import Comparison, Scratch, compare_outputs


def reference(expected: Sequence[Any], obtained: Sequence[Any], *, atol: float, rtol: float) -> Comparison:
    """The comparison as it was written first: everything in float64, about twenty temporaries."""
    hist = (0.1, 0.01)
    result = Comparison(hist=dict.fromkeys(hist, 0))
    for e, o in zip(expected, obtained):
        a = e.float().numpy() if isinstance(e, torch.Tensor) and e.element_size() < 4 else np.asarray(e)
        b = o.float().numpy() if isinstance(o, torch.Tensor) and o.element_size() < 4 else np.asarray(o)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        dnan = int(np.count_nonzero(nan_a != nan_b))
        with np.errstate(invalid="ignore"):
            diff = np.abs(np.where(nan_a | nan_b, 0.0, a64 - b64))
        diff = np.where(np.isinf(a64) & np.isinf(b64) & (a64 == b64), 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)
        scale = np.abs(np.where(np.isfinite(a64), a64, 0.0))
        result.dnan += dnan
        result.abs = max(result.abs, float(diff.max()))
        result.rel = max(result.rel, float((diff / np.maximum(scale, 1e-12)).max()))
        result.sum += float(diff.sum())
        result.n += int(diff.size)
        for h in hist:
            result.hist[h] += int(np.count_nonzero(diff > h))
        if dnan or not bool(((diff <= atol) | (diff <= rtol * scale)).all()):
            result.success = False
    return result


def assert_agree(got: Comparison, want: Comparison) -> None:
    assert got.success == want.success
    assert (got.dnan, got.n, got.hist, got.error) == (want.dnan, want.n, want.hist, want.error)
    for name in ("abs", "rel", "sum"):
        g, w = getattr(got, name), getattr(want, name)
        assert type(g) is float, name
        assert g == pytest.approx(w, rel=1e-6, abs=1e-12) or (np.isinf(g) and np.isinf(w)), (name, g, w)


def rng_pair(
    dtype: torch.dtype, shape: tuple[int, ...], noise: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g) * 3
    b = a + torch.randn(shape, generator=g) * noise
    return a.to(dtype), b.to(dtype)


CASES = {
    "close": (torch.float32, 1e-6),
    "some-over-atol": (torch.float32, 1e-3),
    "many-over-rtol": (torch.float32, 1.0),
    "float64": (torch.float64, 1e-5),
    "float16": (torch.float16, 1e-2),
    "bfloat16": (torch.bfloat16, 1e-2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("atol", "rtol"), [(1e-4, 0.1), (1e-2, 1e-3), (0.0, 0.0)])
def test_fast_path_agrees_with_float64(case: str, atol: float, rtol: float) -> None:
    dtype, noise = CASES[case]
    a, b = rng_pair(dtype, (64, 33), noise)
    c, d = rng_pair(dtype, (7,), noise, seed=1)
    got = compare_outputs([a, c], [b, d], atol=atol, rtol=rtol)
    assert_agree(got, reference([a, c], [b, d], atol=atol, rtol=rtol))


def test_bit_exact_is_a_success_with_float_zero_errors() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool):
        a = (torch.arange(24).reshape(4, 6) % 5).to(dtype)
        got = compare_outputs([a], [a.clone().numpy() if dtype != torch.bfloat16 else a.clone()], atol=0.0, rtol=0.0)
        assert got.success is True, dtype
        assert (got.abs, got.rel, got.sum, got.n, got.dnan) == (0.0, 0.0, 0.0, 24, 0), dtype
        assert type(got.abs) is float and type(got.rel) is float and type(got.sum) is float


@pytest.mark.parametrize(
    ("expected", "obtained", "success", "dnan"),
    [
        ([1.0, np.nan, 3.0], [1.0, np.nan, 3.0], True, 0),  # NaN on both sides agrees
        ([1.0, np.nan, 3.0], [1.0, 2.0, 3.0], False, 1),  # NaN on one side only
        ([1.0, 2.0, 3.0], [1.0, np.nan, 3.0], False, 1),
        ([np.inf, -np.inf, 1.0], [np.inf, -np.inf, 1.0], True, 0),  # same infinities agree
        ([np.inf, 1.0], [-np.inf, 1.0], False, 0),  # opposite infinities do not
        ([np.inf, 1.0], [1e30, 1.0], False, 0),  # inf vs finite
        ([3e38, -3e38], [-3e38, 3e38], False, 0),  # the float32 difference overflows
        ([0.0, 1.0], [1e-30, 1.0], True, 0),  # within atol of zero; the relative error is huge
    ],
)
def test_nan_and_inf_agreement(expected: list[float], obtained: list[float], success: bool, dnan: int) -> None:
    for dtype in (np.float32, np.float64):
        a, b = np.array(expected, dtype=dtype), np.array(obtained, dtype=dtype)
        got = compare_outputs([a], [b], atol=1e-4, rtol=0.1)
        assert got.success is success and got.dnan == dnan, dtype
        assert_agree(got, reference([a], [b], atol=1e-4, rtol=0.1))


def test_tolerance_boundaries_are_decided_as_in_float64() -> None:
    a = np.array([1.0, 1.0, 100.0, 100.0], dtype=np.float32)
    b = a + np.array([1e-4, 2e-4, 10.0, 10.001], dtype=np.float32)  # at atol, over it; at rtol, over it
    for atol, rtol in ((1e-4, 0.0), (0.0, 0.1), (1e-4, 0.1), (2e-4, 0.1)):
        assert_agree(compare_outputs([a], [b], atol=atol, rtol=rtol), reference([a], [b], atol=atol, rtol=rtol))


def test_mixed_float_dtypes_and_integers() -> None:
    a = np.linspace(-2, 2, 50, dtype=np.float32)
    assert_agree(
        compare_outputs([a], [a.astype(np.float64) + 1e-3], atol=1e-4, rtol=0.1),
        reference([a], [a.astype(np.float64) + 1e-3], atol=1e-4, rtol=0.1),
    )
    half = torch.linspace(-2, 2, 50, dtype=torch.float16)
    got = compare_outputs([half], [half.numpy()], atol=0.0, rtol=0.0)  # torch float16 is upcast, numpy's is not
    assert got.success and got.abs == 0.0
    i, j = np.arange(10), np.arange(10)
    j[3] = 7
    assert_agree(compare_outputs([i], [j], atol=0.5, rtol=0.0), reference([i], [j], atol=0.5, rtol=0.0))


def test_structure_errors_and_none() -> None:
    a = np.ones(3, dtype=np.float32)
    assert compare_outputs([a], [a, a], atol=0, rtol=0).error == "2 outputs, expected 1"
    assert "shape" in compare_outputs([a], [np.ones(4, dtype=np.float32)], atol=0, rtol=0).error
    assert "dtype" in compare_outputs([a], [np.ones(3, dtype=np.int64)], atol=0, rtol=0).error
    assert compare_outputs([None, a], [a, a], atol=0, rtol=0).success  # skip_none
    assert not compare_outputs([None, a], [a, a], atol=0, rtol=0, skip_none=False).success
    assert compare_outputs([np.ones((0, 3))], [np.ones((0, 3))], atol=0, rtol=0).n == 0


def test_scratch_is_reused_across_sizes() -> None:
    scratch = Scratch()
    for n in (100, 10, 1000, 10):
        a, b = rng_pair(torch.float32, (n,), 1e-3, seed=n)
        got = compare_outputs([a], [b], atol=1e-4, rtol=0.1, scratch=scratch)
        assert_agree(got, reference([a], [b], atol=1e-4, rtol=0.1))


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_pieces_agree_with_the_whole(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    from iobundle.replay.check import _compare

    monkeypatch.setattr(_compare, "CHUNK_ELEMENTS", chunk)
    for case in sorted(CASES):
        dtype, noise = CASES[case]
        a, b = rng_pair(dtype, (9, 37), noise)
        b[8, 36] = a[8, 36]  # an exact last piece
        for atol, rtol in ((1e-4, 0.1), (0.0, 0.0)):
            assert_agree(compare_outputs([a], [b], atol=atol, rtol=rtol), reference([a], [b], atol=atol, rtol=rtol))
    a = np.arange(200, dtype=np.float32)
    b = a.copy()
    b[150] = np.nan  # found in a late piece: the whole output goes through the general path
    got = compare_outputs([a], [b], atol=1e-4, rtol=0.1)
    assert got.dnan == 1 and not got.success
    assert_agree(got, reference([a], [b], atol=1e-4, rtol=0.1))


# --------------------------------------------------------------------------- statistics, tolerances, names

from iobundle import ToleranceError  # noqa: E402
from iobundle.replay import ErrorStats, Tolerances  # noqa: E402
from iobundle.replay.check._compare import error_stats, histogram_labels, output_paths, stat_passes  # noqa: E402
from iobundle.replay.check._tolerances import check_error_stat_name  # noqa: E402
from iobundle.schema import DictNode, ObjectNode, TensorNode, TupleNode  # noqa: E402


class TestErrorStats:
    def test_statistics_of_a_known_error(self) -> None:
        expected = np.ones(100)
        obtained = expected + np.arange(100) * 1e-3
        stats = error_stats(expected, obtained, atol=1e-2, rtol=0.0, quantile=0.9)
        assert stats.n == 100
        assert stats.max_abs == pytest.approx(0.099)
        assert stats.mean_abs == pytest.approx(0.0495)
        assert stats.median_abs == pytest.approx(0.0495)
        assert stats.quantile_abs == pytest.approx(np.quantile(np.arange(100) * 1e-3, 0.9))
        assert stats.max_rel == pytest.approx(0.099)  # |expected| is 1
        assert stats.within is False  # 0.099 > atol

    def test_one_sided_nan_is_an_infinite_error_both_nan_an_exact_match(self) -> None:
        stats = error_stats(np.array([np.nan, np.nan, 1.0]), np.array([np.nan, 0.0, 1.0]), atol=1.0, rtol=1.0)
        assert stats.dnan == 1 and stats.max_abs == np.inf
        for stat in ("max", "mean", "median", "quantile"):
            assert stat_passes(stats, atol=1e9, rtol=1e9, check_error_stat=stat) is False

    def test_histogram_counts_every_element_in_its_bin(self) -> None:
        errors = np.array([0.0, 5e-9, 1e-8, 5e-5, 0.5, 2.0])
        stats = error_stats(np.zeros(6), errors, atol=1.0, rtol=0.0)
        labels = histogram_labels()
        assert len(stats.hist) == len(labels) and sum(stats.hist) == 6
        counts = dict(zip(labels, stats.hist))
        assert counts["0"] == 1 and counts["<=1e-08"] == 2  # 1e-8 is the bin's (closed) upper edge
        assert counts["(1e-05, 0.0001]"] == 1 and counts["(0.1, 1]"] == 1 and counts[">1"] == 1

    def test_bfloat16_is_compared(self) -> None:
        a = torch.ones(4, dtype=torch.bfloat16)
        stats = error_stats(a, a + 1, atol=0.5, rtol=0.0)
        assert stats.max_abs == 1.0 and not stats.within


def test_statistics_of_a_large_output_are_numpys() -> None:
    """A large output's median and quantile, selected in a window of its errors, are numpy's."""
    a, b = rng_pair(torch.float32, (600, 500), 1e-4, seed=9)
    diff = np.abs(a.numpy().astype(np.float64) - b.numpy().astype(np.float64)).reshape(-1)
    rel = diff / np.maximum(np.abs(a.numpy().astype(np.float64)).reshape(-1), 1e-12)
    stats = error_stats(a, b, atol=1e-4, rtol=0.1, quantile=0.95)
    assert (stats.median_abs, stats.quantile_abs) == (np.median(diff), np.quantile(diff, 0.95))
    assert (stats.median_rel, stats.quantile_rel) == (np.median(rel), np.quantile(rel, 0.95))
    assert stats.max_abs == diff.max() and stats.mean_rel == pytest.approx(rel.mean())


class TestCheckErrorStat:
    """One element off by 1 among 999 exact ones: only ``max`` (and the 1.0 quantile) sees it."""

    stats = error_stats(np.zeros(1000), np.r_[np.zeros(999), 1.0], atol=1e-3, rtol=0.0, quantile=0.99)

    @pytest.mark.parametrize(("stat", "passes"), [("max", False), ("mean", True), ("median", True), ("quantile", True)])
    def test_statistic_decides(self, stat: str, passes: bool) -> None:
        assert stat_passes(self.stats, atol=1e-3, rtol=0.0, check_error_stat=stat) is passes

    def test_quantile_one_is_the_max(self) -> None:
        stats = error_stats(np.zeros(1000), np.r_[np.zeros(999), 1.0], atol=1e-3, rtol=0.0, quantile=1.0)
        assert stats.quantile_abs == 1.0
        assert stat_passes(stats, atol=1e-3, rtol=0.0, check_error_stat="quantile") is False

    def test_relative_statistic_passes_alone(self) -> None:
        stats = error_stats(np.full(10, 100.0), np.full(10, 101.0), atol=0.0, rtol=0.0)
        assert stat_passes(stats, atol=0.1, rtol=0.02, check_error_stat="mean")  # abs 1 > 0.1 but rel 0.01 <= 0.02

    @pytest.mark.parametrize(
        ("stat", "q", "message"), [("p99", 0.5, "use one of max, mean"), ("mean", 1.5, "between 0 and 1")]
    )
    def test_bad_statistic_or_quantile(self, stat: str, q: float, message: str) -> None:
        with pytest.raises(ToleranceError, match=message):
            check_error_stat_name(stat, q)

    def test_stats_class_exposes_each_statistic(self) -> None:
        assert ErrorStats(max_abs=1.0, max_rel=2.0).stat("max") == (1.0, 2.0)


class TestTolerances:
    def test_exact_name_beats_pattern_and_first_pattern_wins(self) -> None:
        tol = Tolerances(atol=1e-4, rtol=0.1, per_output_atol={"past*": 1e-2, "p*": 1.0, "past_key_values[0]": 1e-5})
        assert tol.for_output("past_key_values[0]") == (1e-5, 0.1)
        assert tol.for_output("past_key_values[1]") == (1e-2, 0.1)
        assert tol.for_output("pixels") == (1.0, 0.1)
        assert tol.for_output("logits") == (1e-4, 0.1)

    def test_any_name_of_an_output_matches(self) -> None:
        tol = Tolerances(per_output_rtol={"linear_12": 0.5})
        assert tol.for_output("logits", "linear_12") == (1e-4, 0.5)

    def test_unused_keys_are_listed(self) -> None:
        tol = Tolerances(per_output_atol={"logits": 1.0, "nope*": 1.0}, per_output_rtol={"hidden": 1.0})
        assert tol.unused([("logits", ""), ("hidden", "out_1")]) == ["nope*"]
        assert tol.describe() == "atol=0.0001 rtol=0.1 (logits: atol=1, nope*: atol=1, hidden: rtol=1)"


def test_output_paths_name_each_tensor_of_the_tree() -> None:
    t = TensorNode
    cache = ObjectNode(type="transformers.DynamicCache", version=1, items=[t(key="k0"), t(key="v0")])
    model_output = ObjectNode(
        type="transformers.CausalLMOutputWithPast", version=1, context=["logits", "past_key_values"],
        items=[t(key="l"), cache],
    )  # fmt: skip
    assert output_paths(model_output) == ["logits", "past_key_values[0]", "past_key_values[1]"]
    assert output_paths(t(key="x")) == ["output"]
    assert output_paths(TupleNode(items=[t(key="a"), TupleNode(items=[t(key="b")])])) == ["output[0]", "output[1][0]"]
    assert output_paths(DictNode(keys=["a", 3], items=[t(key="a"), t(key="b")])) == ["a", "output[3]"]
    assert output_paths(None) == []


def test_call_row_errors_are_the_largest_of_its_outputs() -> None:
    """One pass per output: the row's abs/rel are the per-output maxima, its mean/median/quantile over every element."""
    import torch

    from iobundle.replay.check._compare import compare_call

    g = np.random.default_rng(3)
    expected = [g.standard_normal((4, 5)).astype(np.float32), torch.randn(3, 7, dtype=torch.bfloat16), np.arange(6)]
    obtained = [
        expected[0] + g.standard_normal((4, 5)).astype(np.float32) * 1e-3,
        expected[1] + torch.randn(3, 7, dtype=torch.bfloat16) * 0.01,
        np.arange(6) + np.array([0, 0, 1, 0, 0, 0]),
    ]
    scratch = Scratch()  # shared, as validation shares it: each output's errors keep a buffer of their own
    compare_call(expected, obtained, call_index=0, names=["a", "b", "c"], tolerances=Tolerances(), scratch=scratch)
    row, checks = compare_call(
        expected, obtained, call_index=0, names=["a", "b", "c"], tolerances=Tolerances(error_quantile=0.9, quantiles=True),
        scratch=scratch,
    )  # fmt: skip
    assert [c.dtype for c in checks] == ["float32", "bfloat16", "int64"]
    assert row["abs"] == max(c.stats.max_abs for c in checks if c.stats)
    assert row["rel"] == pytest.approx(max(c.stats.max_rel for c in checks if c.stats), rel=1e-6)
    assert row["worst_output"] == "c" and row["n"] == sum(c.stats.n for c in checks if c.stats)
    every = np.concatenate([np.abs(np.asarray(e, np.float64) - np.asarray(o, np.float64)).reshape(-1) for e, o in (
        (expected[0], obtained[0]), (expected[1].float().numpy(), obtained[1].float().numpy()), (expected[2], obtained[2]),
    )])  # fmt: skip
    assert row["median_abs"] == np.median(every) and row["quantile_abs"] == np.quantile(every, 0.9)
    assert row["mean_abs"] == pytest.approx(every.mean())


def test_output_statistics_reuse_the_float64_buffers_of_their_scratch() -> None:
    """Fresh memory costs a page fault per page: the float64 copies of each output and its errors go to the
    scratch's buffers."""
    from iobundle.replay.check._compare import compare_call

    g = np.random.default_rng(4)
    scratch, seen = Scratch(), []
    for shape in [(64, 32), (16, 8), (64, 32)]:
        expected = g.standard_normal(shape).astype(np.float32)
        obtained = expected + np.float32(1e-3)
        _, (check,) = compare_call(
            [expected], [obtained], call_index=0, names=["y"], tolerances=Tolerances(error_quantile=0.9, quantiles=True),
            scratch=scratch,
        )  # fmt: skip
        diff = np.abs(expected.astype(np.float64) - obtained.astype(np.float64)).reshape(-1)
        assert (check.stats.max_abs, check.stats.median_abs) == (diff.max(), np.median(diff))
        seen.append({k: v for k, v in scratch._buffers.items() if k[0] == np.float64})
    # a piece of the expected, the obtained and the errors; every error and relative error, for the median
    assert len(seen[0]) == 5 and all(s.keys() == seen[0].keys() for s in seen)
    assert all(seen[0][k] is s[k] for s in seen for k in s)  # grown once, then reused


ROW_CASES = {
    "close floats": ([np.linspace(-3, 3, 200, dtype=np.float32)], [np.linspace(-3, 3, 200, dtype=np.float32) + 1e-5]),
    "nan on one side": ([np.array([1.0, np.nan, np.nan, 2.0])], [np.array([1.5, np.nan, 0.0, 2.0])]),
    "same infinities": ([np.array([np.inf, -np.inf, 1.0])], [np.array([np.inf, -np.inf, 1.25])]),
    "integers": ([np.arange(6), np.arange(4)], [np.arange(6) + np.array([0, 0, 3, 0, 0, 0]), np.arange(4)]),
    "shape mismatch stops the row": (
        [np.ones(3), np.ones((2, 2)), np.zeros(4)],
        [np.ones(3) + 0.5, np.ones(4), np.zeros(4) + 2.0],
    ),
    "missing and empty": ([np.ones(3), None, np.zeros(0)], [np.ones(3) + 1e-3, np.ones(2), np.zeros(0)]),
    "large, nan and inf in later pieces": (  # the statistics go through an output piece by piece
        [np.linspace(-3, 3, 200_000)],
        [
            np.linspace(-3, 3, 200_000)
            + np.r_[np.full(70_000, 1e-5), np.inf, 0.5, np.full(79_998, 1e-3), np.nan, 0.0, np.zeros(49_998)]
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_per_output_row_counts_as_compare_outputs_does(case: str) -> None:
    """The row built from the per-output pass has compare_outputs' abs, rel, sum, n, dnan, >h counts and error."""
    from iobundle.replay.check._compare import compare_call

    expected, obtained = ROW_CASES[case]
    names = [f"o{i}" for i in range(len(expected))]
    for skip_none in (True, False):
        row, checks = compare_call(
            expected, obtained, call_index=0, names=names, tolerances=Tolerances(), hist=(0.1, 0.01, 0.3),
            skip_none=skip_none,
        )  # fmt: skip
        want = compare_outputs(expected, obtained, atol=1e-4, rtol=0.1, hist=(0.1, 0.01, 0.3), skip_none=skip_none)
        got = Comparison(
            success=want.success, abs=row["abs"], rel=row["rel"], sum=row["sum"], n=row["n"], dnan=row["dnan"],
            hist={h: row[f">{h}"] for h in (0.1, 0.01, 0.3)}, error=row.get("error"),
        )  # fmt: skip
        assert_agree(got, want)
        assert len(checks) == len(expected)
        if want.error or want.dnan:
            assert row["SUCCESS"] is False


def test_median_and_quantile_are_selected_on_request() -> None:
    """They need every error at once: None unless Tolerances.quantiles or the deciding statistic asks for them."""
    from iobundle.replay.check._compare import compare_call

    expected = [np.linspace(0, 1, 300, dtype=np.float32), np.ones(4, np.float32)]
    obtained = [e + np.float32(1e-5) for e in expected]
    for tolerances, selected in [
        (Tolerances(), False), (Tolerances(quantiles=True), True), (Tolerances(check_error_stat="median"), True)
    ]:  # fmt: skip
        row, checks = compare_call(expected, obtained, call_index=0, names=["a", "b"], tolerances=tolerances)
        fields = ("median_abs", "quantile_abs", "median_rel", "quantile_rel")
        values = [row["median_abs"], row["quantile_abs"], *(getattr(c.stats, f) for c in checks for f in fields)]
        assert all((v is not None) == selected for v in values), tolerances
        assert row["mean_abs"] == pytest.approx(1e-5, rel=1e-2) and row["SUCCESS"] is True


def test_default_tolerances_depend_on_the_recorded_dtype():
    from iobundle.replay.check import DTYPE_TOLERANCES

    tol = Tolerances()
    assert tol.for_output("logits", dtype="float32") == (1e-4, 0.1)  # today's defaults: old verdicts stand
    assert tol.for_output("logits", dtype="torch.bfloat16") == DTYPE_TOLERANCES["bfloat16"] == (2e-2, 0.1)
    assert tol.for_output("logits", dtype="float16") == DTYPE_TOLERANCES["float16"] == (5e-3, 0.1)
    assert tol.for_output("logits", dtype="int64") == (1e-4, 0.1)
    overridden = Tolerances(per_output_atol={"logits": 1e-3})
    assert overridden.for_output("logits", dtype="bfloat16") == (1e-3, 0.1)  # a per-output override beats the table
    assert tol.describe(["bfloat16", "float32"]) == "atol=0.0001 rtol=0.1 (bfloat16: atol=0.02 rtol=0.1)"


def test_a_bfloat16_output_is_decided_with_its_dtype_tolerances():
    from iobundle.replay.check._compare import compare_call

    expected = [torch.full((3,), 1e-2, dtype=torch.bfloat16)]
    row, checks = compare_call(
        expected, [np.full(3, 2e-2, np.float32)], call_index=0, names=["y"], tolerances=Tolerances(), per_output=False
    )
    assert row["SUCCESS"] is True and checks[0].atol == 2e-2  # 1e-2 off: within bfloat16's atol, not float32's
    row, _ = compare_call(
        expected, [np.full(3, 5e-2, np.float32)], call_index=0, names=["y"], tolerances=Tolerances(), per_output=False
    )
    assert row["SUCCESS"] is False


def test_tolerance_keywords_are_real_parameters_with_the_defaults_of_build():
    """What a type checker and ``inspect`` read is what runs: no decorator rewrites the signatures."""
    from iobundle.replay import (
        Bundle,
        check_discrepancies,
        diff_bundles,
        export_onnx,
        export_program,
        export_programs,
        rerun_model,
        validate_onnx,
    )

    build = inspect.signature(Tolerances.build).parameters
    takers = {
        "all": (check_discrepancies, validate_onnx, rerun_model, diff_bundles, Bundle.check_discrepancies,
                Bundle.validate, Bundle.rerun),
        "export": (export_program, export_programs, export_onnx, Bundle.export, Bundle.export_programs, Bundle.to_onnx),
    }  # fmt: skip
    for kind, funcs in takers.items():
        for func in funcs:
            assert not hasattr(func, "__wrapped__"), func.__qualname__
            params = inspect.signature(func).parameters
            names = list(build) if kind == "all" else ["atol", "rtol", "output_atol", "output_rtol"]
            assert {n: params[n].default for n in names} == {n: build[n].default for n in names}, func.__qualname__
            assert params["tolerances"].default is None and list(params)[-1] == "tolerances"
    assert list(inspect.signature(Bundle.check_discrepancies).parameters)[:4] == ["self", "onnx_model", "atol", "rtol"]
    assert Tolerances.build(1e-3, 0.2, {"logits": 1e-2}, None, "mean") == Tolerances(
        atol=1e-3, rtol=0.2, per_output_atol={"logits": 1e-2}, check_error_stat="mean"
    )
    with pytest.raises(ToleranceError):
        Tolerances.build(check_error_stat="mode")


def test_public_functions_document_every_tolerance_keyword_they_take():
    from iobundle.replay import check_discrepancies, export_program

    for func in (check_discrepancies, export_program):
        params = inspect.signature(func).parameters
        options = [n for n in inspect.signature(Tolerances.build).parameters if n in params]
        assert {"atol", "rtol", "output_atol", "output_rtol"} <= set(options), func.__qualname__
        for name in options:
            assert re.search(rf"^\s+{name}: ", func.__doc__, re.M), (func.__qualname__, name)
