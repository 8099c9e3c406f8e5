"""Converters: ONNX test data read back by onnx's own loader and run by onnxruntime; npz files for numpy users."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from iobundle import BundleExistsError, InputObserver, ModelLoadError, ReplayError, load_bundle, redact_bundle
from iobundle.replay import validate_onnx
from iobundle.travel import convert_to_npz, convert_to_onnx_testdata
from iobundle.travel._convert import tensor_proto

pytestmark = pytest.mark.slow


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, cache=None, mask=None, scale=1.0):
        y = self.lin(x) * scale
        if cache is not None:
            y = y + cache[0].sum() + cache[1].mean()
        if mask is not None:
            y = y * mask
        return {"y": y, "z": y.sum(dim=-1)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A bundle of nested inputs (a list, a dict output) and its exported ONNX model."""
    tmp = tmp_path_factory.mktemp("convert")
    model, observer = Model(), InputObserver()
    with observer(model, store_n_calls=3):
        model(torch.randn(2, 8), cache=[torch.randn(2, 3), torch.randn(3)], mask=torch.ones(2, 4), scale=2.0)
        model(torch.randn(3, 8), cache=[torch.randn(2, 5), torch.randn(3)], mask=torch.ones(3, 4), scale=2.0)
        model(torch.randn(5, 8), cache=[torch.randn(2, 6), torch.randn(3)], mask=torch.zeros(5, 4), scale=2.0)
    observer.save(tmp / "run.iobundle")
    bundle = load_bundle(tmp / "run.iobundle")
    onnx_path = tmp / "model.onnx"
    bundle.to_onnx(Model(), onnx_path)
    return tmp / "run.iobundle", onnx_path


def read_data_set(directory: Path, prefix: str) -> list[onnx.TensorProto]:
    files = sorted(directory.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    return [onnx.load_tensor(str(f)) for f in files]


def test_onnx_testdata_runs_in_onnxruntime_and_matches_the_recorded_outputs(exported, tmp_path):
    bundle_path, onnx_path = exported
    bundle = load_bundle(bundle_path)
    result = convert_to_onnx_testdata(bundle, onnx_path, tmp_path / "testdata")
    assert result.calls == 3
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    graph_inputs = [i.name for i in session.get_inputs()]
    graph_outputs = [o.name for o in session.get_outputs()]
    for i in range(3):
        directory = tmp_path / "testdata" / f"test_data_set_{i}"
        inputs, outputs = read_data_set(directory, "input"), read_data_set(directory, "output")
        assert [t.name for t in inputs] == graph_inputs  # input_K is graph input K, named after it
        assert [t.name for t in outputs] == graph_outputs
        feeds = {t.name: numpy_helper.to_array(t) for t in inputs}
        obtained = session.run(None, feeds)
        expected = [numpy_helper.to_array(t) for t in outputs]
        recorded = bundle.outputs(i)
        np.testing.assert_allclose(expected[0], recorded["y"].numpy())
        np.testing.assert_allclose(expected[1], recorded["z"].numpy())
        for got, want in zip(obtained, expected):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    # The same mapping as validation: validating the model on the bundle passes too.
    assert validate_onnx(bundle._recorded(), onnx_path).ok


def test_onnx_testdata_of_a_redacted_bundle_has_inputs_only(exported, tmp_path):
    bundle_path, onnx_path = exported
    redact_bundle(bundle_path, tmp_path / "redacted")
    convert_to_onnx_testdata(load_bundle(tmp_path / "redacted"), onnx_path, tmp_path / "td")
    directory = tmp_path / "td" / "test_data_set_0"
    assert read_data_set(directory, "input") and not read_data_set(directory, "output")


def test_onnx_testdata_refuses_a_missing_model_and_a_non_empty_target(exported, tmp_path):
    bundle_path, onnx_path = exported
    rc = load_bundle(bundle_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_to_onnx_testdata(rc, tmp_path / "nope.onnx", tmp_path / "td")
    convert_to_onnx_testdata(rc, onnx_path, tmp_path / "td")
    with pytest.raises(BundleExistsError, match="not empty"):
        convert_to_onnx_testdata(rc, onnx_path, tmp_path / "td")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_tensor_proto_round_trips_through_onnx(dtype):
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    proto = onnx.TensorProto.FromString(tensor_proto(t, "t").SerializeToString())
    array = numpy_helper.to_array(proto)
    assert proto.name == "t" and list(proto.dims) == [3, 4]
    assert np.array_equal(array.astype(np.float32), t.float().numpy())


def test_npz_has_one_file_per_call_keyed_by_tensor_paths(exported, tmp_path):
    bundle_path, _ = exported
    bundle = load_bundle(bundle_path)
    result = convert_to_npz(bundle, tmp_path / "arrays")
    assert [p.name for p in result.paths] == ["call_000000.npz", "call_000001.npz", "call_000002.npz"]
    with np.load(result.paths[1]) as data:
        assert sorted(data) == ["args.0", "kwargs.cache.0", "kwargs.cache.1", "kwargs.mask", "outputs.y", "outputs.z"]
        np.testing.assert_array_equal(data["outputs.y"], bundle.outputs(1)["y"].numpy())


def test_npz_single_file_prefixes_each_call(exported, tmp_path):
    bundle_path, _ = exported
    result = convert_to_npz(load_bundle(bundle_path), tmp_path / "all.npz")
    with np.load(result.paths[0]) as data:
        assert "call_000002/kwargs.mask" in data and "call_000000/args.0" in data
        assert len(data) == 3 * 6


def test_onnx_testdata_reports_each_call(exported, tmp_path):
    bundle_path, onnx_path = exported
    events = []
    convert_to_onnx_testdata(load_bundle(bundle_path), onnx_path, tmp_path / "t", on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("convert", i, 3) for i in range(4)]
    assert [e.detail for e in events[1:]] == ["call 0", "call 1", "call 2"]


@pytest.mark.parametrize("target", ["arrays", "all.npz"])
def test_npz_reports_each_call(exported, tmp_path, target):
    bundle_path, _ = exported
    events = []
    result = convert_to_npz(load_bundle(bundle_path), tmp_path / target, on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("convert", i, 3) for i in range(4)]
    assert result.calls == 3


def test_npz_single_file_holds_the_same_arrays_as_the_per_call_files(exported, tmp_path):
    bundle_path, _ = exported
    rc = load_bundle(bundle_path)
    one = convert_to_npz(rc, tmp_path / "all.npz").paths[0]
    per_call = convert_to_npz(rc, tmp_path / "arrays").paths
    with np.load(one) as whole:
        for path in per_call:
            with np.load(path) as part:
                for key in part:
                    np.testing.assert_array_equal(whole[f"{path.stem}/{key}"], part[key])
                    assert whole[f"{path.stem}/{key}"].dtype == part[key].dtype


class DictModel(torch.nn.Module):
    def forward(self, x, extra=None):
        return x * 2


def _dict_bundle(path: Path, extra: dict) -> Path:
    model, observer = DictModel(), InputObserver()
    with observer(model):
        model(torch.ones(2), extra=extra)
    observer.save(path)
    return path


def test_npz_keys_from_dict_keys_are_escaped_and_never_leave_the_file(tmp_path):
    import zipfile

    extra = {"../../evil": torch.ones(1), "a.b": torch.ones(2), "a": {"b": torch.ones(3)}, "/abs\\x": torch.ones(4)}
    bundle = load_bundle(_dict_bundle(tmp_path / "run", extra))
    one = convert_to_npz(bundle, tmp_path / "all.npz").paths[0]
    names = zipfile.ZipFile(one).namelist()
    assert all(".." not in n and "\\" not in n and n.count("/") == 1 for n in names), names
    arrays = convert_to_npz(bundle, tmp_path / "arrays").paths[0]
    with np.load(arrays) as data:
        keys = set(data)
        assert {"kwargs.extra.%2E%2E%2F%2E%2E%2Fevil", "kwargs.extra.a%2Eb", "kwargs.extra.a.b"} <= keys
        assert data["kwargs.extra.a%2Eb"].shape == (2,) and data["kwargs.extra.a.b"].shape == (3,)
    assert not (tmp_path / "evil.npy").exists() and not (tmp_path.parent / "evil.npy").exists()


def test_npz_refuses_two_tensors_with_one_key(tmp_path):
    from iobundle.errors import ReplayError

    bundle = load_bundle(_dict_bundle(tmp_path / "run", {1: torch.ones(1), "1": torch.ones(2)}))
    with pytest.raises(ReplayError, match=r"two tensors have the npz key 'kwargs\.extra\.1'"):
        convert_to_npz(bundle, tmp_path / "arrays")


def test_overwrite_removes_what_an_earlier_larger_conversion_wrote_and_nothing_else(exported, tmp_path):
    bundle_path, onnx_path = exported
    rc = load_bundle(bundle_path)
    testdata, arrays = tmp_path / "testdata", tmp_path / "arrays"
    convert_to_onnx_testdata(rc, onnx_path, testdata)
    (testdata / "test_data_set_7").mkdir()  # from an earlier conversion of a bundle with more calls
    (testdata / "test_data_set_7" / "input_0.pb").write_bytes(b"stale")
    (testdata / "notes.txt").write_text("keep me")
    with pytest.raises(BundleExistsError, match="--overwrite"):
        convert_to_onnx_testdata(rc, onnx_path, testdata)
    convert_to_onnx_testdata(rc, onnx_path, testdata, overwrite=True)
    assert sorted(p.name for p in testdata.iterdir()) == ["notes.txt", *(f"test_data_set_{i}" for i in range(3))]

    convert_to_npz(rc, arrays)
    (arrays / "call_000009.npz").write_bytes(b"stale")
    (arrays / "notes.txt").write_text("keep me")
    convert_to_npz(rc, arrays, overwrite=True)
    assert sorted(p.name for p in arrays.iterdir()) == [*(f"call_{i:06d}.npz" for i in range(3)), "notes.txt"]


def test_convert_takes_a_bundle_or_an_observer(tmp_path):
    model, observer = DictModel(), InputObserver()
    with observer(model):
        model(torch.ones(2))
    from_observer = convert_to_npz(observer, tmp_path / "a.npz").paths[0]
    observer.save(tmp_path / "run")
    from_bundle = convert_to_npz(load_bundle(tmp_path / "run"), tmp_path / "b.npz").paths[0]
    with np.load(from_observer) as a, np.load(from_bundle) as b:
        assert sorted(a) == sorted(b) == ["call_000000/args.0", "call_000000/outputs"]


def _repeat_first_index(observer: InputObserver) -> None:
    rc = observer._recorded()
    rc.calls[1] = rc.calls[1].model_copy(update={"index": rc.calls[0].index})


@pytest.mark.parametrize("target", ["arrays", "all.npz"])
def test_npz_refuses_two_calls_with_one_index(tmp_path, target):
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
        model(torch.randn(2, 4))
    _repeat_first_index(observer)
    with pytest.raises(ReplayError, match="Two recorded calls have the index 0"):
        convert_to_npz(observer, tmp_path / target)
    assert not (tmp_path / target).exists()


def test_onnx_testdata_names_its_folders_by_position_so_calls_never_collide(tmp_path):
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
        model(torch.randn(2, 4))
    observer.to_onnx(model, tmp_path / "m.onnx")
    _repeat_first_index(observer)
    result = convert_to_onnx_testdata(observer, tmp_path / "m.onnx", tmp_path / "td")
    assert result.calls == 2
    shapes = [[tuple(t.dims) for t in read_data_set(tmp_path / "td" / f"test_data_set_{i}", "input")] for i in (0, 1)]
    assert shapes == [[(1, 4)], [(2, 4)]]
