"""Converters: ONNX test data read back by onnx's own loader and run by onnxruntime; npz files for numpy users."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from iobundle import BundleExistsError, InputObserver, ModelLoadError, load_bundle, redact_bundle
from iobundle.replay import convert_to_npz, convert_to_onnx_testdata, validate_onnx
from iobundle.replay._convert import tensor_proto

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
    result = convert_to_onnx_testdata(bundle._recorded(), onnx_path, tmp_path / "testdata")
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
    convert_to_onnx_testdata(load_bundle(tmp_path / "redacted")._recorded(), onnx_path, tmp_path / "td")
    directory = tmp_path / "td" / "test_data_set_0"
    assert read_data_set(directory, "input") and not read_data_set(directory, "output")


def test_onnx_testdata_refuses_a_missing_model_and_a_non_empty_target(exported, tmp_path):
    bundle_path, onnx_path = exported
    rc = load_bundle(bundle_path)._recorded()
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
    result = convert_to_npz(bundle._recorded(), tmp_path / "arrays")
    assert [p.name for p in result.paths] == ["call_000000.npz", "call_000001.npz", "call_000002.npz"]
    with np.load(result.paths[1]) as data:
        assert sorted(data) == ["args.0", "kwargs.cache.0", "kwargs.cache.1", "kwargs.mask", "outputs.y", "outputs.z"]
        np.testing.assert_array_equal(data["outputs.y"], bundle.outputs(1)["y"].numpy())


def test_npz_single_file_prefixes_each_call(exported, tmp_path):
    bundle_path, _ = exported
    result = convert_to_npz(load_bundle(bundle_path)._recorded(), tmp_path / "all.npz")
    with np.load(result.paths[0]) as data:
        assert "call_000002/kwargs.mask" in data and "call_000000/args.0" in data
        assert len(data) == 3 * 6


def test_onnx_testdata_reports_each_call(exported, tmp_path):
    bundle_path, onnx_path = exported
    events = []
    convert_to_onnx_testdata(load_bundle(bundle_path)._recorded(), onnx_path, tmp_path / "t", on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("convert", i, 3) for i in range(4)]
    assert [e.detail for e in events[1:]] == ["call 0", "call 1", "call 2"]


@pytest.mark.parametrize("target", ["arrays", "all.npz"])
def test_npz_reports_each_call(exported, tmp_path, target):
    bundle_path, _ = exported
    events = []
    result = convert_to_npz(load_bundle(bundle_path)._recorded(), tmp_path / target, on_progress=events.append)
    assert [(e.task, e.done, e.total) for e in events] == [("convert", i, 3) for i in range(4)]
    assert result.calls == 3


def test_npz_single_file_holds_the_same_arrays_as_the_per_call_files(exported, tmp_path):
    bundle_path, _ = exported
    rc = load_bundle(bundle_path)._recorded()
    one = convert_to_npz(rc, tmp_path / "all.npz").paths[0]
    per_call = convert_to_npz(rc, tmp_path / "arrays").paths
    with np.load(one) as whole:
        for path in per_call:
            with np.load(path) as part:
                for key in part:
                    np.testing.assert_array_equal(whole[f"{path.stem}/{key}"], part[key])
                    assert whole[f"{path.stem}/{key}"].dtype == part[key].dtype
