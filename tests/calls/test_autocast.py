"""The torch.autocast state of a call: what capture reads (per call, per thread) and what replay re-enters."""

from __future__ import annotations

import threading

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.calls import autocast_state, module_device_type, replay_autocast
from iobundle.schema import AutocastEntry

CPU_BF16 = AutocastEntry(device_type="cpu", dtype="BF16", enabled=True)


def test_no_state_outside_autocast():
    assert autocast_state() is None


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_the_state_under_cpu_autocast(dtype, name):
    with torch.autocast("cpu", dtype=dtype):
        assert autocast_state() == [AutocastEntry(device_type="cpu", dtype=name, enabled=True)]
        with torch.autocast("cpu", enabled=False):  # a region that turns it off again records nothing
            assert autocast_state() is None


def test_each_call_records_the_state_of_its_own_thread(tmp_path):
    model, observer = torch.nn.Linear(4, 4), InputObserver()
    with torch.no_grad(), observer(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))
            other = threading.Thread(target=model, args=(torch.randn(3, 4),))  # autocast is thread-local
            other.start()
            other.join()
        model(torch.randn(5, 4))
    observer.save(tmp_path / "b.iobundle")
    assert [c.autocast for c in load_bundle(tmp_path / "b.iobundle").manifest.calls] == [[CPU_BF16], None, None]


def test_replay_runs_where_the_model_is_and_maps_another_device_type():
    cuda = AutocastEntry(device_type="cuda", dtype="F16", enabled=True)
    cpu_off = AutocastEntry(device_type="cpu", dtype="BF16", enabled=False)
    mapped = replay_autocast([cuda, cpu_off], "cpu")
    assert mapped is not None and mapped.device_type == "cpu" and mapped.dtype == torch.float16
    assert mapped.describe() == "torch.autocast('cpu', float16) (recorded under 'cuda', mapped to 'cpu')"
    same = replay_autocast([CPU_BF16], "cpu")
    assert same is not None and not same.mapped and same.describe() == "torch.autocast('cpu', bfloat16)"
    assert replay_autocast([cpu_off], "cpu") is None and replay_autocast(None) is None
    with mapped.context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")


def test_module_device_type():
    assert module_device_type(torch.nn.Linear(2, 2)) == "cpu"
    assert module_device_type(torch.nn.ReLU()) == "cpu"


def test_a_streamed_capture_records_the_state_too(tmp_path):
    model, observer = torch.nn.Linear(4, 4), InputObserver()
    with torch.no_grad(), observer(model, stream_to=tmp_path / "s.iobundle"):
        model(torch.randn(2, 4))
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(3, 4))
    calls = load_bundle(tmp_path / "s.iobundle").manifest.calls
    assert [c.autocast for c in calls] == [None, [AutocastEntry(device_type="cpu", dtype="F16", enabled=True)]]
