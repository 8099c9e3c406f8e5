"""Tensor files written by iobundle: standard safetensors, bit-exact for every dtype, tensors stored once."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from iobundle import InputObserver, load_bundle
from iobundle.calls import _tensorfile_write as _tensorfile
from iobundle.calls._tensorfile_write import raw_bytes, write_tensor_file
from iobundle.errors import BundleWriteError, UnsupportedInputError

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
EXTRA_DTYPES = [
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


pytestmark = pytest.mark.usefixtures("own_files")  # these tests read the calls' files with safetensors


class Identity(torch.nn.Module):
    def forward(self, *args):
        return None


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (NaN payloads and subnormals included), valid booleans for bool."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def record(path: Path, *calls: tuple[torch.Tensor, ...]) -> Path:
    model, observer = Identity(), InputObserver()
    with observer(model, store_n_calls=len(calls)):
        for args in calls:
            model(*args)
    observer.save(path)
    return path


def file_header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


class TestStandardSafetensors:
    def test_readable_by_safetensors(self, tmp_path):
        tensors = [random_tensor(dt, (3, 2), seed=i) for i, dt in enumerate(DTYPES)]
        bundle = record(tmp_path / "b", tuple(tensors))
        manifest = load_bundle(bundle).manifest
        keys = [a.key for a in manifest.calls[0].args]
        (file,) = {manifest.tensors[k].file for k in keys}
        with safetensors.safe_open(bundle / file, "pt") as f:
            assert set(f.keys()) == set(keys)
            assert f.metadata() == {"format": "pt"}
            for key, t in zip(keys, tensors):
                assert torch.equal(bits(f.get_tensor(key)), bits(t))
        loaded = safetensors.torch.load_file(bundle / file)
        for key, t in zip(keys, tensors):
            assert loaded[key].dtype == t.dtype and loaded[key].shape == t.shape
            assert torch.equal(bits(loaded[key]), bits(t))

    @pytest.mark.parametrize("dtype", [dt for dt in EXTRA_DTYPES if dt != torch.complex128], ids=str)
    def test_extra_dtypes_readable_by_safetensors(self, tmp_path, dtype):
        t = random_tensor(dtype, (2, 3))
        write_tensor_file(tmp_path / "f.safetensors", {"x": t})
        assert torch.equal(bits(safetensors.torch.load_file(tmp_path / "f.safetensors")["x"]), bits(t))

    @pytest.mark.xfail(
        strict=True,
        reason="safetensors has no complex128 dtype (C128): such files round-trip through iobundle only",
    )
    def test_complex128_readable_by_safetensors(self, tmp_path):
        write_tensor_file(tmp_path / "f.safetensors", {"x": torch.zeros(2, dtype=torch.complex128)})
        safetensors.torch.load_file(tmp_path / "f.safetensors")

    def test_write_tensor_file_direct(self, tmp_path):
        tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(7, dtype=torch.int16), "c": torch.ones(0, 4)}
        entry = write_tensor_file(tmp_path / "f.safetensors", tensors)
        assert entry.size == (tmp_path / "f.safetensors").stat().st_size
        loaded = safetensors.torch.load_file(tmp_path / "f.safetensors")
        assert set(loaded) == set(tensors)
        for k, t in tensors.items():
            assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t)

    def test_data_is_aligned(self, tmp_path):
        tensors = {f"t{i}": random_tensor(dt, (3,), seed=i) for i, dt in enumerate(DTYPES + EXTRA_DTYPES)}
        write_tensor_file(tmp_path / "f.safetensors", tensors)
        (n,) = struct.unpack("<Q", (tmp_path / "f.safetensors").read_bytes()[:8])
        assert n % 8 == 0
        header = file_header(tmp_path / "f.safetensors")
        for name, t in tensors.items():
            begin, end = header[name]["data_offsets"]
            assert (8 + n + begin) % min(t.dtype.itemsize, 8) == 0
            assert end - begin == t.numel() * t.dtype.itemsize


class TestRoundTrip:
    @pytest.mark.parametrize("dtype", DTYPES + EXTRA_DTYPES, ids=str)
    def test_dtype_round_trips_bit_exactly(self, tmp_path, dtype):
        first, second = random_tensor(dtype, (3, 5), seed=1), random_tensor(dtype, (4, 5), seed=2)
        bundle = record(tmp_path / "b", (first,), (second,))
        b = load_bundle(bundle)
        for call, expected in zip(b.manifest.calls, (first, second)):
            got = b.tensor(call.args[0].key)
            assert got.dtype == dtype and got.shape == expected.shape
            assert torch.equal(bits(got), bits(expected))
        (args,) = b.infer_arguments(1, as_args_kwargs=True)[:1]
        assert torch.equal(bits(args[0]), bits(second))

    @pytest.mark.parametrize("shape", [(), (0,), (0, 3), (2, 0), (2, 0, 5), (1,)], ids=str)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.float8_e5m2, torch.complex64], ids=str)
    def test_zero_dim_and_empty(self, tmp_path, shape, dtype):
        t = random_tensor(dtype, shape)
        bundle = record(tmp_path / "b", (t,))
        b = load_bundle(bundle)
        got = b.tensor(b.manifest.calls[0].args[0].key)
        assert got.shape == t.shape and got.dtype == dtype
        assert torch.equal(bits(got), bits(t))
        safetensors.torch.load_file(bundle / b.manifest.tensors[b.manifest.calls[0].args[0].key].file)

    @pytest.mark.parametrize(
        "make",
        [
            lambda: torch.arange(24.0).reshape(4, 6).t(),
            lambda: torch.arange(24.0).reshape(4, 6)[:, ::2],
            lambda: torch.arange(24, dtype=torch.int64).reshape(2, 3, 4).permute(2, 0, 1),
            lambda: torch.arange(4.0).expand(3, 4),
            lambda: torch.arange(8.0).reshape(2, 4)[1],
            lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        ],
        ids=["transposed", "strided", "permuted", "expanded", "offset", "channels_last"],
    )
    def test_non_contiguous_is_stored_contiguous(self, tmp_path, make):
        t = make()
        bundle = record(tmp_path / "b", (t,))
        b = load_bundle(bundle)
        key = b.manifest.calls[0].args[0].key
        header = file_header(bundle / b.manifest.tensors[key].file)
        begin, end = header[key]["data_offsets"]
        assert end - begin == t.numel() * t.element_size()  # no storage beyond the view, no expanded stride
        got = b.tensor(key)
        assert got.is_contiguous() and torch.equal(got, t)

    def test_lazy_conj_and_neg_views_store_their_values(self, tmp_path):
        z = torch.randn(3, dtype=torch.complex64)
        tensors = {"conj": z.conj(), "neg": z.conj().imag}
        assert tensors["conj"].is_conj() and tensors["neg"].is_neg()
        write_tensor_file(tmp_path / "f.safetensors", tensors)
        loaded = safetensors.torch.load_file(tmp_path / "f.safetensors")
        assert torch.equal(loaded["conj"], z.conj().resolve_conj())
        assert torch.equal(loaded["neg"], -z.imag)


class TestStoredOnce:
    def test_same_tensor_twice_in_a_call(self, tmp_path):
        x = torch.randn(2, 3)
        b = load_bundle(record(tmp_path / "b", (x, x, torch.ones(1))))
        assert len(b.manifest.tensors) == 2
        a0, a1, _ = b.manifest.calls[0].args
        assert a0.key == a1.key
        args = b.infer_arguments(0)
        assert torch.equal(args[0], x) and torch.equal(args[1], x)

    def test_same_tensor_across_calls(self, tmp_path):
        x = torch.randn(2, 3)
        bundle = record(tmp_path / "b", (x, torch.ones(2)), (x, torch.zeros(3)), (x, torch.ones(4)))
        b = load_bundle(bundle)
        assert len(b.manifest.tensors) == 4  # x once, plus one tensor per call
        assert len({c.args[0].key for c in b.manifest.calls}) == 1
        assert sum(1 for e in b.manifest.tensors.values() if e.name == b.manifest.calls[0].args[0].key) == 1
        for i in range(3):
            assert torch.equal(b.infer_arguments(i)[0], x)

    def test_modified_in_place_is_stored_again(self, tmp_path):
        x = torch.zeros(3)
        model, observer = Identity(), InputObserver()
        with observer(model):
            model(x)
            x.add_(1)
            model(x)
        observer.save(tmp_path / "b")
        b = load_bundle(tmp_path / "b")
        first, second = (b.tensor(c.args[0].key) for c in b.manifest.calls)
        assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(3))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning", "ignore:ComplexHalf support:UserWarning")
class TestUnsupported:
    @pytest.mark.parametrize(
        ("make", "kind"),
        [
            (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
            (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
            (lambda: torch.empty(2, device="meta"), "meta"),
        ],
        ids=["sparse_coo", "sparse_csr", "meta"],
    )
    def test_tensor_without_dense_data(self, tmp_path, make, kind):
        with pytest.raises(UnsupportedInputError, match=f"Tensor 'x' is a {kind} tensor"):
            write_tensor_file(tmp_path / "f.safetensors", {"x": make()})
        assert not (tmp_path / "f.safetensors").exists()

    def test_unsupported_dtype(self, tmp_path):
        with pytest.raises(UnsupportedInputError, match=r"dtype torch\.complex32"):
            write_tensor_file(tmp_path / "f.safetensors", {"x": torch.zeros(2, dtype=torch.complex32)})


class TestRawBytes:
    """The writer's fast path: the bytes of a plain contiguous CPU tensor, with no torch call."""

    @pytest.mark.parametrize("dtype", DTYPES + EXTRA_DTYPES, ids=str)
    def test_raw_bytes_are_the_tensor_bytes(self, dtype):
        t = random_tensor(dtype, (3, 5), seed=3)
        raw = raw_bytes(t)
        assert raw is not None and raw.tobytes() == bits(t).numpy().tobytes()

    @pytest.mark.parametrize(
        "make",
        [
            lambda: torch.arange(12.0).reshape(3, 4).t(),
            lambda: torch.arange(12.0)[::2],
            lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
            lambda: torch.tensor([1 + 2j, 3 - 1j]).conj().imag,
            lambda: torch.nn.Parameter(torch.ones(3)),
        ],
        ids=["transposed", "strided", "lazy-conj", "lazy-neg", "subclass"],
    )
    def test_other_tensors_take_the_general_path(self, tmp_path, make):
        t = make()
        assert raw_bytes(t) is None
        write_tensor_file(tmp_path / "f.safetensors", {"t": t})
        loaded = safetensors.torch.load_file(tmp_path / "f.safetensors")["t"]
        assert torch.equal(loaded, t.detach().resolve_conj().resolve_neg().contiguous())

    def test_the_view_keeps_the_tensor_alive(self):
        raw = raw_bytes(torch.arange(1000, dtype=torch.int32))
        gc.collect()
        torch.zeros(1000, dtype=torch.int32)  # would reuse freed memory
        assert raw is not None and raw.tobytes() == torch.arange(1000, dtype=torch.int32).numpy().tobytes()

    def test_empty_and_zero_dim(self):
        assert raw_bytes(torch.ones(0, 3)) == b""
        raw = raw_bytes(torch.tensor(7, dtype=torch.int16))
        assert raw is not None and raw.tobytes() == b"\x07\x00"

    def test_small_and_large_files_are_the_same_bytes(self, tmp_path, monkeypatch):
        """A small file (one writev) and a large one (pieces, hashing in a helper thread) agree byte for byte."""
        tensors = {f"t{i}": random_tensor(dt, (4, 3), seed=i) for i, dt in enumerate(DTYPES)}
        small = write_tensor_file(tmp_path / "small.safetensors", tensors)
        monkeypatch.setattr(_tensorfile, "ONE_WRITE_BYTES", 0)
        large = write_tensor_file(tmp_path / "large.safetensors", tensors)
        assert (tmp_path / "small.safetensors").read_bytes() == (tmp_path / "large.safetensors").read_bytes()
        assert small == large
        assert not list(tmp_path.glob(".*.tmp"))

    def test_a_failed_small_write_leaves_nothing(self, tmp_path):
        target = tmp_path / "missing-dir" / "f.safetensors"
        with pytest.raises(BundleWriteError, match="missing-dir"):
            write_tensor_file(target, {"x": torch.ones(3)})
        assert not (tmp_path / "missing-dir").exists()
