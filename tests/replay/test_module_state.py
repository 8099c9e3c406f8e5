"""State kept on the modules is recorded with each call and replayed from the bundle alone (issue 28, class 1).

The recurrent layer is the case the mechanism was built on; the running mean and the growing
key/value attributes were not used while building it.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy
import pytest
import torch
from cli.tiny_models import tiny_llama  # tests/ is on sys.path (tests/conftest.py)

from iobundle import InputObserver, load_bundle
from iobundle.capture import ObservationWarning
from iobundle.errors import ModelLoadError


class Recurrent(torch.nn.Module):
    """A GRU cell keeping its hidden state as a module attribute, inside a model."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.GRUCell(4, 4)
        self.h = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.cell(x, self.h)
        return self.h * 2


class RunningMean(torch.nn.Module):
    """Normalises by an exponential moving average it updates in place (a buffer), and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.seen += 1
        return self.proj(x - self.mean) * self.seen


class KeyValueState(torch.nn.Module):
    """Attention over every token seen so far, keys and values kept as module attributes that grow each call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12)
        self.keys = torch.zeros(1, 1, 4)
        self.values = torch.zeros(1, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.keys = torch.cat([self.keys, k], dim=1)
        self.values = torch.cat([self.values, v], dim=1)
        weights = torch.softmax(q @ self.keys.transpose(1, 2), dim=-1)
        return weights @ self.values


class Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), inner])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], torch.Tensor]]] = {
    "recurrent": (lambda: Holder(Recurrent()), lambda i: torch.randn(2, 4)),
    "running mean": (lambda: Holder(RunningMean()), lambda i: torch.randn(3, 4)),
    "growing key/value attributes": (KeyValueState, lambda i: torch.randn(1, i + 1, 4)),
}


def record(model: torch.nn.Module, inputs: Callable[[int], torch.Tensor], path: Path, calls: int = 4) -> list[str]:
    torch.manual_seed(0)
    observer = InputObserver()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with observer(model, store_n_calls=calls):
            for i in range(calls):
                model(inputs(i))
    observer.save(path)
    return [str(w.message) for w in caught if issubclass(w.category, ObservationWarning)]


@pytest.mark.parametrize("case", list(CASES))
def test_module_state_is_recorded_and_each_call_replays_from_the_bundle(case: str, tmp_path: Path) -> None:
    make, inputs = CASES[case]
    torch.manual_seed(1)
    model = make()
    replayed = copy.deepcopy(model)  # the model as it was before the calls: its state is not what replay uses
    [warning] = record(model, inputs, tmp_path / "b")
    assert "records them too" in warning
    bundle = load_bundle(tmp_path / "b")
    states = [call.state for call in bundle.calls]
    assert all(state is not None and state.keys == ["in", "out", "training"] for state in states)
    for before, after in zip(bundle.calls, bundle.calls[1:]):  # a call finds the state the previous one left
        for k_out, k_in in zip(before.state.items[1].items, after.state.items[0].items):
            torch.testing.assert_close(bundle.tensor(k_out.key), bundle.tensor(k_in.key))
    replayed.eval()
    assert bundle.rerun(replayed).ok
    result = bundle.export(replayed)  # torch.export: the state is the input module_state, returned after the outputs
    assert result.report.ok, result.report.summary()
    assert "module_state" in str(result.program.graph_signature)
    onnx_path = bundle.to_onnx(replayed, tmp_path / "model.onnx")
    report = bundle.validate(onnx_path)
    assert report.ok and [row["index"] for row in report.rows] == [0, 1, 2, 3]
    assert any(".layers.1." in o.name or "keys" in o.name for o in report.outputs)  # the state out is compared too


def test_a_model_without_module_state_records_no_state(tmp_path: Path) -> None:
    assert record(Holder(torch.nn.Linear(4, 4)), lambda i: torch.randn(2, 4), tmp_path / "b") == []
    assert all(call.state is None for call in load_bundle(tmp_path / "b").calls)
    assert '"state"' not in (tmp_path / "b" / "manifest.json").read_text()


class Drifting(torch.nn.Module):
    """Builds a table on its first call (not state: added), then shifts it on every later one (state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "table"):
            self.table = self.table + x.sum(0)
        else:
            self.table = torch.ones(4)
        return x * self.table


def test_calls_recorded_before_the_state_was_found_are_not_replayed(tmp_path: Path) -> None:
    model = Drifting()
    [warning] = record(model, lambda i: torch.randn(2, 4), tmp_path / "b")
    assert "model.table" in warning and "before this one lack them" in warning
    bundle = load_bundle(tmp_path / "b")
    assert [call.state is not None for call in bundle.calls] == [False, True, True, True]
    table = model.table
    report = bundle.rerun(model)
    assert report.ok and [row["index"] for row in report.rows] == [1, 2, 3]
    assert model.table is table  # the model's own state is put back
    assert "calls [0] were recorded before iobundle found the state" in str(bundle.export(model).report.options)


def test_a_state_path_the_model_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    record(Holder(Recurrent()), lambda i: torch.randn(2, 4), tmp_path / "b")
    bundle = load_bundle(tmp_path / "b")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.h'.*no buffer or tensor attribute"):
        bundle.rerun(Holder(torch.nn.Linear(4, 4)))
    manifest = tmp_path / "b" / "manifest.json"  # a hostile path: looked up among named_modules(), never followed
    manifest.write_text(manifest.read_text().replace('"model.layers.1.h"', '"model.__class__.__init__"'))
    with pytest.raises(ModelLoadError, match=r"'model\.__class__\.__init__'"):
        load_bundle(tmp_path / "b").rerun(Holder(Recurrent()))


def test_a_streamed_bundle_records_the_state_too(tmp_path: Path) -> None:
    make, inputs = CASES["running mean"]
    model, observer = make(), InputObserver()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with observer(model, stream_to=tmp_path / "s"):
            for i in range(3):
                model(inputs(i))
    calls = json.loads((tmp_path / "s" / "manifest.json").read_text())["structures"]
    assert all("state" in structure for structure in calls)
    assert load_bundle(tmp_path / "s").calls[2].state is not None


def key_value_model() -> torch.nn.Module:
    """The factory ``iobundle export --model`` imports (``replay.test_module_state:key_value_model``)."""
    torch.manual_seed(1)
    return KeyValueState()


def test_the_cli_exports_and_validates_a_stateful_model_from_the_bundle(tmp_path: Path) -> None:
    from iobundle.cli import main

    record(key_value_model(), CASES["growing key/value attributes"][1], tmp_path / "b")
    onnx_path = str(tmp_path / "m.onnx")
    assert (
        main(["export", str(tmp_path / "b"), "--model", "replay.test_module_state:key_value_model", "-o", onnx_path])
        == 0
    )
    index = tmp_path / "m.programs.json"  # x of length 1 (call 0) takes a program of its own
    assert main(["validate", str(tmp_path / "b"), str(index if index.exists() else onnx_path)]) == 0


def test_the_state_travels_with_the_bundle_but_not_into_a_redacted_one(tmp_path: Path) -> None:
    from iobundle import redact_bundle, upgrade_bundle
    from iobundle.travel import convert_to_npz

    record(Holder(RunningMean()), CASES["running mean"][1], tmp_path / "b")
    upgrade_bundle(tmp_path / "b", tmp_path / "u")  # rewritten by the writer: the state is kept, readable
    original, upgraded = load_bundle(tmp_path / "b"), load_bundle(tmp_path / "u")
    for a, b in zip(original.calls, upgraded.calls):
        keys = [
            (n.key, m.key)
            for part, other in zip(a.state.items[:2], b.state.items[:2])  # in and out; then the training flags
            for n, m in zip(part.items, other.items)
        ]
        assert (
            a.state.items[2] == b.state.items[2]
            and keys
            and all(torch.equal(original.tensor(k), upgraded.tensor(j)) for k, j in keys)
        )
    arrays = convert_to_npz(original, tmp_path / "npz").paths[1]
    assert {"state.in.model%2Elayers%2E1%2Emean", "state.out.model%2Elayers%2E1%2Eseen"} <= set(numpy.load(arrays))
    redact_bundle(tmp_path / "b", tmp_path / "r")  # the state holds values computed from the real inputs
    assert all(call.state is None for call in load_bundle(tmp_path / "r").calls)


def count_into_outputs(module: torch.nn.Module, args: object, out: torch.Tensor | tuple) -> object:
    """A forward hook that counts the layer's calls in a buffer and shifts its outputs by the count."""
    module.calls.add_(1)
    return out + 0.01 * module.calls if isinstance(out, torch.Tensor) else (out[0] + 0.01 * module.calls, *out[1:])


def stateful_llama() -> torch.nn.Module:
    model = tiny_llama()
    model.model.layers[1].register_buffer("calls", torch.zeros(()))
    model.model.layers[1].register_forward_hook(count_into_outputs)
    return model


@pytest.mark.slow
def test_a_tiny_llama_whose_layer_keeps_state_exports_and_validates_from_the_bundle(tmp_path: Path) -> None:
    model, observer = stateful_llama(), InputObserver()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), observer(model, store_n_calls=8):
        warnings.simplefilter("always")
        model.generate(torch.ones(1, 5, dtype=torch.int64), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert any("model.model.layers.1.calls" in str(w.message) for w in caught)
    observer.save(tmp_path / "b")
    bundle = load_bundle(tmp_path / "b")
    assert [float(bundle.tensor(c.state.items[0].items[0].key)) for c in bundle.calls] == [0.0, 1.0, 2.0, 3.0]
    programs = bundle.export_programs(stateful_llama())  # the prefill and the decode steps, each from its count
    assert programs.report.ok
    report = bundle.validate(programs.to_onnx(tmp_path / "m.onnx"))
    assert report.ok and len(report.rows) == 4


class TrainingHead(torch.nn.Module):
    """A frozen block (BatchNorm with running statistics, Dropout: in eval mode) under a BatchNorm that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
        self.norm = torch.nn.BatchNorm1d(4)
        with torch.no_grad():
            self.frozen[1].running_mean.fill_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.frozen(x))


def test_calls_recorded_in_training_mode_replay_in_it_from_a_model_built_for_inference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TrainingHead().train()
    model.frozen.eval()
    replayed = copy.deepcopy(model).eval()  # as a factory builds it: every module in eval mode
    [warning] = record(model, lambda i: torch.randn(i + 3, 4), tmp_path / "b")
    assert "model.norm.num_batches_tracked" in warning
    bundle = load_bundle(tmp_path / "b")
    assert bundle.rerun(replayed).ok
    result = bundle.export(replayed)
    assert result.report.ok, result.report.summary()
    assert not replayed.training and not replayed.norm.training  # its own flags are put back
    report = bundle.validate(bundle.to_onnx(replayed, tmp_path / "model.onnx"))
    assert report.ok and [row["index"] for row in report.rows] == [0, 1, 2, 3]
    training = bundle.calls[0].state.items[2]  # the root's flag, and the frozen block's where it differs
    assert (training.keys, [flag.value for flag in training.items]) == (["model", "model.frozen"], [True, False])


class LazyCell(torch.nn.Module):
    """An RNN cell whose hidden state is a buffer registered as None, made by the first call from a learned state."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.RNNCell(4, 4)
        self.h0 = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("h", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.cell(x, self.h0.expand(x.shape[0], 4) if self.h is None else self.h)
        return self.h * 2


def test_the_call_that_made_the_state_where_none_was_replays_from_none(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Holder(LazyCell())
    replayed = copy.deepcopy(model)
    [warning] = record(model, lambda i: torch.randn(2, 4), tmp_path / "b")
    assert "model.layers.1.h" in warning
    bundle = load_bundle(tmp_path / "b")
    replayed.layers[1].h = torch.ones(2, 4)  # a model that ran before: replay puts None there for call 0
    report = bundle.rerun(replayed)
    assert report.ok and [row["index"] for row in report.rows] == [0, 1, 2, 3]
    state_in = bundle.calls[0].state.items[0]
    assert state_in.keys == ["model.layers.1.h"] and state_in.items[0].kind == "none"
    programs = bundle.export_programs(replayed)  # None is a constant of a program: call 0 takes its own
    checked = [(c.index, c.success) for p in programs.programs for c in p.report.calls]
    assert sorted(checked) == [(i, True) for i in range(4)], programs.summary()
    assert "calls [0] found None where they made the state" in str(bundle.export_report().options)


class LazyTable(torch.nn.Module):
    """Builds a table on its first call where None was, the same on every later call: a cache, not state."""

    def __init__(self) -> None:
        super().__init__()
        self.table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(4.0)
        return x * self.table


def test_a_cache_built_where_none_was_is_no_state(tmp_path: Path) -> None:
    model = LazyTable()
    assert record(model, lambda i: torch.randn(2, 4), tmp_path / "b") == []  # no warning
    bundle = load_bundle(tmp_path / "b")
    assert [call.state is not None for call in bundle.calls] == [True, False, False, False]  # what it found: None
    result = bundle.export(LazyTable())
    assert result.report.ok and len(result.report.calls) == 4
    assert "module_state" not in str(result.program.graph_signature)


def test_a_bundle_recorded_before_the_training_flags_still_replays(tmp_path: Path) -> None:
    make, inputs = CASES["recurrent"]
    torch.manual_seed(1)
    model = make()
    replayed = copy.deepcopy(model).eval()
    record(model, inputs, tmp_path / "b")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    for structure in manifest["structures"]:  # the state as the bundles of the previous release hold it
        state = structure["state"]
        assert state["keys"].pop() == "training" and state["items"].pop()["kind"] == "dict"
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    bundle = load_bundle(tmp_path / "b")
    assert all(call.state.keys == ["in", "out"] for call in bundle.calls)
    assert bundle.rerun(replayed).ok and bundle.export(replayed).report.ok
