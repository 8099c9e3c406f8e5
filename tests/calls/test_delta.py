"""Delta storage: a tensor that extends a stored one is stored as its new part, checked bit for bit.

Every way a cache changes between two calls of a real decoder must round-trip exactly: growing
(stored as a delta), and reordered (beam search), rolled (sliding window), written in place
(StaticCache), shortened (crop): stored whole, because the leading part is not the same bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.calls import DeltaIndex, rebuild
from iobundle.calls._delta import SMALL_COMPARE_BYTES, extends_bytes


def grow(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    return torch.cat([t, torch.randn(*t.shape[:2], n, t.shape[3]).to(t.dtype)], dim=2)


class Step(torch.nn.Module):
    """Takes a cache (list of per-layer tensors) and a mask; returns them, as a decoder step does."""

    def forward(self, x, past, mask):
        return {"y": x + 1, "past": list(past), "mask": mask}


def record(tmp_path: Path, calls: list[tuple[list[torch.Tensor], torch.Tensor]], *, stream: bool) -> tuple[Any, Path]:
    model, observer = Step(), InputObserver()
    path = tmp_path / ("streamed" if stream else "saved")
    with observer(model, store_n_calls=len(calls), stream_to=path if stream else None):
        for past, mask in calls:
            model(torch.randn(3), [p.clone() for p in past], mask.clone())
    if not stream:
        observer.save(path)
    return observer, path


def check_round_trip(observer: Any, path: Path, calls: list[tuple[list[torch.Tensor], torch.Tensor]]) -> Any:
    """Every recorded input reads back bit for bit (bytes compared), from the bundle and from the observer."""
    bundle = load_bundle(path)
    assert bundle.verify() == []
    assert bundle.num_obs() == len(calls)
    for i, (past, mask) in enumerate(calls):
        for source in (bundle, observer):
            _, got_past, got_mask = source.infer_arguments(i)
            for a, b in zip(got_past, past):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
            assert torch.equal(got_mask, mask)
    return bundle


def extensions(bundle: Any) -> int:
    return sum(e.extends is not None for e in bundle.manifest.tensors.values())


def cache(n: int, layers: int = 2, dtype: torch.dtype = torch.float32, width: int = 4) -> list[torch.Tensor]:
    return [torch.randn(1, 2, n, width).to(dtype) for _ in range(layers)]


@pytest.fixture(params=[False, True], ids=["saved", "streamed"])
def stream(request: pytest.FixtureRequest) -> bool:
    return request.param


class TestRoundTrip:
    def test_a_growing_cache_is_stored_as_its_new_positions(self, tmp_path: Path, stream: bool) -> None:
        past, calls = cache(3, width=64), []
        for n in range(3, 9):
            calls.append((past, torch.ones(1, n, dtype=torch.int64)))
            past = [grow(p) for p in past]
        observer, path = record(tmp_path, calls, stream=stream)
        bundle = check_round_trip(observer, path, calls)
        # from the second call on, both layers and the mask (streaming: from the third, once growth was seen)
        assert extensions(bundle) >= 3 * (len(calls) - 2)
        stored = sum(f.stat().st_size for f in (path / "calls").iterdir())  # safetensors files and segments
        whole = sum(sum(p.numel() * 4 for p in past) + mask.numel() * 8 for past, mask in calls)
        assert stored < whole / 2  # the repeated positions are not stored again

    def test_each_step_extends_the_step_before_it(self, tmp_path: Path, stream: bool) -> None:
        # a decode loop: each call's cache is the previous call's output grown by one position, so
        # every extension must take the previous step as its base (one new position stored), not an
        # older step that it extends too
        class Decoder(torch.nn.Module):
            def forward(self, x, past):
                return [torch.cat([p, p[:, :, -1:] + x], dim=2) for p in past]

        model, observer = Decoder(), InputObserver()
        path = tmp_path / ("streamed" if stream else "saved")
        past = cache(4, layers=3)
        with observer(model, store_n_calls=8, stream_to=path if stream else None):
            for i in range(8):
                past = model(torch.tensor(float(i)), past)
        if not stream:
            observer.save(path)
        tensors = load_bundle(path).manifest.tensors
        grown = [(k, e) for k, e in tensors.items() if e.extends is not None]
        assert len(grown) >= 3 * 6  # every layer from the second step on (streaming: once growth was seen)
        for key, entry in grown:
            base = tensors[entry.extends.key]
            assert entry.shape[2] - base.shape[2] == 1, (
                f"{key} extends {entry.extends.key}: {base.shape} -> {entry.shape}"
            )

    def test_beam_search_reorder_is_stored_whole(self, tmp_path: Path, stream: bool) -> None:
        past = [torch.randn(3, 2, 4, 4) for _ in range(2)]
        reordered = [grow(p.index_select(0, torch.tensor([2, 0, 0]))) for p in past]  # beams reordered, then grown
        calls = [(past, torch.ones(3, 4)), (reordered, torch.ones(3, 5))]
        observer, path = record(tmp_path, calls, stream=stream)
        bundle = check_round_trip(observer, path, calls)
        past_keys = {n.key for c in bundle.calls for n in c.args[1].items}
        assert all(bundle.manifest.tensors[k].extends is None for k in past_keys)

    def test_sliding_window_roll_is_stored_whole(self, tmp_path: Path, stream: bool) -> None:
        past = cache(6)
        rolled = [torch.cat([p[:, :, 1:], torch.randn(1, 2, 1, 4)], dim=2) for p in past]  # same length, shifted
        rolled_more = [torch.cat([p[:, :, 1:], torch.randn(1, 2, 2, 4)], dim=2) for p in rolled]  # longer, shifted
        calls = [(past, torch.ones(1, 6)), (rolled, torch.ones(1, 6)), (rolled_more, torch.ones(1, 7))]
        observer, path = record(tmp_path, calls, stream=stream)
        check_round_trip(observer, path, calls)

    def test_static_cache_written_in_place_round_trips(self, tmp_path: Path, stream: bool) -> None:
        static = [torch.zeros(1, 2, 8, 4) for _ in range(2)]
        model, observer = Step(), InputObserver()
        path, expected = tmp_path / "static", []
        with observer(model, store_n_calls=4, stream_to=path if stream else None):
            for i in range(4):
                for s in static:
                    s[:, :, i] = torch.randn(2, 4)  # one position written in place per call
                expected.append(([s.clone() for s in static], torch.ones(1, 8)))
                model(torch.randn(3), static, torch.ones(1, 8))
        if not stream:
            observer.save(path)
        check_round_trip(observer, path, expected)

    def test_crop_shortens_and_round_trips(self, tmp_path: Path, stream: bool) -> None:
        past = cache(6)
        cropped = [p[:, :, :4].clone() for p in past]  # DynamicCache.crop(4)
        regrown = [grow(p, 3) for p in cropped]  # then generation goes on
        calls = [(past, torch.ones(1, 6)), (cropped, torch.ones(1, 4)), (regrown, torch.ones(1, 7))]
        observer, path = record(tmp_path, calls, stream=stream)
        check_round_trip(observer, path, calls)

    def test_large_growing_tensors_stream_through_the_buffer_pool(self, tmp_path: Path) -> None:
        """Tensors above the pool's threshold: a base kept for the next call is never recycled under it."""
        past, calls = cache(4, width=16384), []  # 512 KiB per layer, growing
        for n in range(4, 9):
            calls.append((past, torch.ones(1, n)))
            past = [grow(p) for p in past]
        observer, path = record(tmp_path, calls, stream=True)
        bundle = check_round_trip(observer, path, calls)
        assert extensions(bundle) >= 2 * (len(calls) - 2)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool])
    def test_dtypes_round_trip(self, tmp_path: Path, stream: bool, dtype: torch.dtype) -> None:
        past, calls = [(torch.randn(1, 2, 3, 4) * 3).to(dtype) for _ in range(2)], []
        for n in range(3, 7):
            calls.append((past, torch.ones(1, n)))
            past = [grow(p) for p in past]
        observer, path = record(tmp_path, calls, stream=stream)
        bundle = check_round_trip(observer, path, calls)
        assert extensions(bundle) > 0


# Small contiguous CPU tensors are compared as bytes in Python, others with torch.equal: both
# paths must give the same verdicts. Shapes are (rows, positions, width), growing along the positions.
COMPARISON_PATHS = {
    "bytes, one row": (1, 3, 4),
    "bytes, several rows": (6, 3, 4),
    "torch, many rows": (200, 3, 4),
    "torch, large": (2, 3, SMALL_COMPARE_BYTES // 4),
}


class TestBitExactCheck:
    def test_negative_zero_is_not_zero(self) -> None:
        base = torch.zeros(1, 2, 3, 4)
        grown = torch.cat([base, torch.ones(1, 2, 1, 4)], dim=2)
        assert extends_bytes(grown, base, 2)
        grown[0, 0, 1, 1] = -0.0  # equal as a float, different bits
        assert torch.equal(grown[:, :, :3], base)
        assert not extends_bytes(grown, base, 2)

    def test_nan_payloads_count(self) -> None:
        base = torch.full((2, 3), math.nan)
        assert extends_bytes(torch.cat([base, torch.zeros(2, 1)], dim=1), base, 1)  # NaN != NaN, but same bits
        other = base.clone()
        other.view(torch.int32)[0, 0] ^= 1  # another NaN payload
        assert not extends_bytes(torch.cat([other, torch.zeros(2, 1)], dim=1), base, 1)

    def test_only_one_dimension_may_grow(self) -> None:
        base = torch.randn(2, 3)
        assert not extends_bytes(torch.randn(3, 4), base, 0)
        assert not extends_bytes(base.double(), base, 0)
        assert extends_bytes(torch.cat([base, torch.randn(1, 3)]), base, 0)

    def test_index_picks_the_tensor_whose_bytes_match(self) -> None:
        index = DeltaIndex(retain_all=True)
        a, b = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)  # same shape: both are candidates
        index.add("a", a, base=None, retain=True)
        index.add("b", b, base=None, retain=True)
        match = index.find(grow(a))
        assert match is not None and match.key == "a" and match.dim == 2 and match.new.shape == (1, 2, 1, 4)
        assert index.find(torch.randn(1, 2, 4, 4)) is None

    @pytest.mark.parametrize("retain_all", [False, True], ids=["streamed", "saved"])
    def test_a_deep_cache_finds_each_layers_base_at_the_first_try(
        self, retain_all: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from iobundle.calls import _delta

        compared = []
        monkeypatch.setattr(_delta, "extends_bytes", lambda *a: compared.append(a[1]) or extends_bytes(*a))
        index, layers, step = DeltaIndex(retain_all=retain_all), [torch.randn(1, 2, 4, 8) for _ in range(64)], 0
        for step in range(4):  # a decode loop: every layer grows by one position per call, in the same order
            for i, layer in enumerate(layers):
                key = f"s{step}l{i}"
                match = index.find(layer)
                index.add(key, layer, base=match.key if match else None, retain=True)
                assert step == 0 or (match is not None and match.key == f"s{step - 1}l{i}")
            index.end_call()
            layers = [grow(layer) for layer in layers]
        assert len(compared) == 3 * 64  # one comparison per layer and decode call: no search through the others

    def test_a_base_changed_in_place_is_not_used(self) -> None:
        index = DeltaIndex(retain_all=True)
        a = torch.randn(1, 2, 3, 4)
        index.add("a", a, base=None, retain=True)
        grown = grow(a)
        a.mul_(2)  # after it was written: the file holds the old values
        assert index.find(grown) is None

    @pytest.mark.parametrize("shape", COMPARISON_PATHS.values(), ids=COMPARISON_PATHS.keys())
    def test_both_comparison_paths_are_bit_exact(self, shape: tuple[int, int, int]) -> None:
        rows, n, width = shape
        base = torch.randn(rows, n, width)
        grown = torch.cat([base, torch.randn(rows, 2, width)], dim=1)
        assert extends_bytes(grown, base, 1)
        assert not extends_bytes(grown, base.neg(), 1)
        flipped = grown.clone()
        flipped[rows - 1, n - 1, width - 1] = 0.0
        base[rows - 1, n - 1, width - 1] = -0.0  # equal as floats, not as bits
        assert not extends_bytes(flipped, base, 1)
        base[rows - 1, n - 1, width - 1] = 0.0
        assert extends_bytes(flipped, base, 1)
        nan = base.clone()
        nan[0, 0, 0] = math.nan
        nan_grown = torch.cat([nan, torch.zeros(rows, 1, width)], dim=1)
        assert extends_bytes(nan_grown, nan, 1)
        other = nan.clone()
        other.view(torch.int32)[0, 0, 0] ^= 1  # another NaN payload
        assert not extends_bytes(nan_grown, other, 1)

    def test_a_non_contiguous_base_is_compared_by_value(self) -> None:
        full = torch.randn(4, 6)
        base = full[:, ::2]  # not contiguous: no raw bytes, compared with torch
        assert extends_bytes(torch.cat([base, torch.randn(4, 1)], dim=1), base, 1)
        assert not extends_bytes(torch.cat([base + 1, torch.randn(4, 1)], dim=1), base, 1)

    def test_each_layer_extends_its_own_layer(self) -> None:
        """Four tensors of one shape (a cache's layers): each new one is matched to its own predecessor."""
        index = DeltaIndex()
        layers = [torch.randn(2, 2, 5, 4) for _ in range(4)]
        for i, t in enumerate(layers):
            index.add(f"old{i}", t, base=None, retain=True)
        index.end_call()
        for i, t in reversed(list(enumerate(layers))):  # in any order
            match = index.find(grow(t))
            assert match is not None and match.key == f"old{i}" and match.new.shape == (2, 2, 1, 4)

    def test_rebuild_concatenates_runs_of_parts(self) -> None:
        root = torch.arange(6).reshape(2, 3)
        parts = [
            (torch.arange(2).reshape(2, 1), 1),
            (torch.arange(2).reshape(2, 1), 1),
            (torch.zeros(1, 5, dtype=torch.int64), 0),
        ]
        out = rebuild(root, parts)
        assert out.shape == (3, 5) and out[:2, :3].equal(root) and out[2].eq(0).all()


def test_inspect_never_reads_the_bytes(tmp_path: Path) -> None:
    """Shapes come from the manifest: an extension's parts can be gone and shapes still answer."""
    past, calls = cache(3), []
    for n in range(3, 6):
        calls.append((past, torch.ones(1, n)))
        past = [grow(p) for p in past]
    _, path = record(tmp_path, calls, stream=False)
    for f in (path / "calls").iterdir():  # safetensors files and segments
        f.unlink()
    bundle = load_bundle(path)
    assert bundle.infer_dynamic_shapes()[1] == [{2: torch.export.Dim.DYNAMIC}] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_compared_on_device_and_round_trips(tmp_path: Path) -> None:
    past, calls = [p.cuda() for p in cache(3)], []
    for n in range(3, 7):
        calls.append((past, torch.ones(1, n, device="cuda")))
        past = [torch.cat([p, torch.randn(1, 2, 1, 4, device="cuda")], dim=2) for p in past]
    for stream in (False, True):
        _, path = record(tmp_path / str(stream), calls, stream=stream)
        bundle = load_bundle(path)
        assert extensions(bundle) > 0 and bundle.verify() == []
        for i, (p, _) in enumerate(calls):
            _, got, _ = bundle.infer_arguments(i)
            assert all(torch.equal(a, b.cpu()) for a, b in zip(got, p))
