"""State a model keeps on its modules between calls is one warning at capture, naming it (issue 28, class 1)."""

from __future__ import annotations

import warnings

import pytest
import torch
from cli.tiny_models import tiny_llama  # tests/ is on sys.path (tests/conftest.py)

from iobundle import InputObserver
from iobundle.capture import ObservationWarning


class Recurrent(torch.nn.Module):
    """Like a GRU cell that keeps its hidden state as an attribute, not in a cache passed in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.GRUCell(3, 3)
        self.h = torch.zeros(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.cell(x, self.h)
        return self.h


class Counting(torch.nn.Module):
    """Updates buffers in place: a running sum and a call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        self.register_buffer("total", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        self.count += 1
        return self.proj(x) + self.total / self.count


class Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([inner])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class Recomputing(torch.nn.Module):
    """Recomputes tensors each call the same way (rebound, and in place like longrope's ``inv_freq``), adds one lazily."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(3)
        self.register_buffer("freq", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = torch.ones(3)
        self.freq.copy_(torch.where(x.sum() > 1e9, 2.0, torch.ones(3)))
        if not hasattr(self, "table"):
            self.table = torch.arange(3.0)
        return x * self.scale + self.table


def count(buffer: torch.Tensor) -> None:
    """What a forward hook does to keep a count: a buffer updated in place (the hook returns None)."""
    buffer.add_(1)


def run(model: torch.nn.Module, calls: int = 3) -> list[warnings.WarningMessage]:
    observer = InputObserver()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with observer(model):
            for _ in range(calls):
                model(torch.ones(1, 3))
    assert observer.num_obs() == calls
    return [w for w in caught if issubclass(w.category, ObservationWarning)]


def test_a_recurrent_layer_keeping_its_hidden_state_warns_naming_it() -> None:
    [warning] = run(Holder(Recurrent()))
    message = str(warning.message)
    assert "model.layers.0.h" in message
    assert "cell" not in message  # parameters only read are not state
    assert "records them too" in message and "module_state" in message


def test_buffers_updated_in_place_warn_naming_them() -> None:
    [warning] = run(Counting())
    assert "model.total, model.count" in str(warning.message)


def test_the_warning_comes_once_per_observer() -> None:
    model, observer = Recurrent(), InputObserver()
    with pytest.warns(ObservationWarning, match=r"model\.h") as caught:
        for _ in range(2):
            with observer(model):
                model(torch.ones(1, 3))
                model(torch.ones(1, 3))
    assert len([w for w in caught if issubclass(w.category, ObservationWarning)]) == 1


def test_many_changed_tensors_are_named_a_few_then_counted() -> None:
    class Many(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(6):
                self.register_buffer(f"s{i}", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for buffer in self.buffers():
                buffer.add_(1)
            return x

    [warning] = run(Many(), calls=1)
    assert "model.s0, model.s1, model.s2, model.s3 and 2 more" in str(warning.message)


def test_a_plain_linear_does_not_warn_where_a_buffer_it_updates_would() -> None:
    assert run(Holder(torch.nn.Linear(3, 3))) == []
    linear = torch.nn.Linear(3, 3)
    linear.register_buffer("seen", torch.zeros(()))
    linear.register_forward_hook(lambda module, args, out: count(module.seen))
    [warning] = run(Holder(linear))
    assert "model.layers.0.seen" in str(warning.message)


def test_a_tensor_recomputed_to_the_same_values_or_built_lazily_does_not_warn() -> None:
    assert run(Holder(Recomputing())) == []
    drifting = Recomputing()
    drifting.register_forward_pre_hook(
        lambda module, args: setattr(module, "table", module.table + 1) if hasattr(module, "table") else None
    )
    [warning] = run(Holder(drifting))  # the lazily built tensor, changed by the next call, is state
    message = str(warning.message)
    assert "model.layers.0.table" in message and "scale" not in message and "freq" not in message


class Rebinding(torch.nn.Module):
    """Holds None until its first call binds a tensor there, which the next calls change: state."""

    def __init__(self) -> None:
        super().__init__()
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.sum(0) if self.last is None else self.last + x.sum(0)
        return x * self.last


def test_a_tensor_bound_where_none_was_is_state_once_a_call_changes_it() -> None:
    [warning] = run(Holder(Rebinding()))  # no attribute added: the place was there, holding None
    assert "model.layers.0.last" in str(warning.message)


def generate(model: torch.nn.Module) -> list[warnings.WarningMessage]:
    observer = InputObserver()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with observer(model):
            model.generate(torch.ones(1, 5, dtype=torch.int64), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert observer.num_obs() == 3
    return [w for w in caught if issubclass(w.category, ObservationWarning)]


def test_a_tiny_llama_generate_does_not_warn_until_a_layer_keeps_state() -> None:
    model = tiny_llama()
    assert generate(model) == []
    layer = model.model.layers[1]
    layer.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    layer.register_forward_hook(lambda module, args, out: count(module.calls))
    [warning] = generate(model)
    assert "model.model.layers.1.calls" in str(warning.message)


class StaticCache(torch.nn.Module):
    """Holds a cache it writes in place: state unless the caller passes it in (then the recorded calls carry it)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = torch.zeros(4, 3)

    def forward(self, x: torch.Tensor, position: int, cache: torch.Tensor | None = None) -> torch.Tensor:
        cache = self.cache if cache is None else cache
        cache[position].copy_(x[0])
        return cache.sum(0)


def test_a_cache_the_model_holds_warns_unless_it_is_passed_to_each_call() -> None:
    for passed in (True, False):
        model, observer = StaticCache(), InputObserver()
        with warnings.catch_warnings(record=True) as caught, observer(model):
            warnings.simplefilter("always")
            for i in range(3):
                model(torch.ones(1, 3), i, model.cache) if passed else model(torch.ones(1, 3), i)
        messages = [str(w.message) for w in caught if issubclass(w.category, ObservationWarning)]
        if passed:
            assert messages == []
        else:
            [message] = messages
            assert "model.cache" in message


class Stepping(torch.nn.Module):
    """Keeps a Python int step counter (state iobundle cannot record), and optionally a buffer too."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        self.step = 0
        self.layer_idx = 3  # a number the calls do not change: not state
        if buffer:
            self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if hasattr(self, "total"):
            self.total.add_(x[0])
        return x * self.step


def test_a_number_the_model_keeps_is_one_warning_saying_it_cannot_be_recorded() -> None:
    [warning] = run(Holder(Stepping(buffer=False)))
    message = str(warning.message)
    assert "numbers its module tree keeps between calls (model.layers.0.step)" in message
    assert "cannot record" in message and "layer_idx" not in message and "records them too" not in message
    [warning] = run(Holder(Stepping(buffer=True)))
    message = str(warning.message)
    assert "(model.layers.0.total)" in message and "records them too" in message
    assert "It also changed numbers its module tree keeps between calls (model.layers.0.step)" in message


class CountingLinear(torch.nn.Linear):
    """A subclass of a torch layer whose own numbers are not watched: its forward keeps a counter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


def test_a_counter_in_a_subclass_of_a_torch_layer_is_still_one_warning() -> None:
    layer = CountingLinear(3, 3)
    layer.calls = 0
    [warning] = run(Holder(layer))
    message = str(warning.message)
    assert "numbers its module tree keeps between calls (model.layers.0.calls)" in message
    assert "in_features" not in message


def test_the_numbers_of_plain_torch_layers_are_not_walked() -> None:
    from iobundle.capture._module_state import _places  # the walk itself: what a watched call reads

    assert _places(Holder(torch.nn.Linear(3, 3))).numbers == []
    assert {"in_features", "out_features"} <= {name for _, _, name in _places(Holder(CountingLinear(3, 3))).numbers}
    assert run(Holder(torch.nn.Linear(3, 3))) == []
