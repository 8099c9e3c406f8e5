"""A `with` block that recorded no call says so, and names the module that ran instead."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver
from iobundle.capture import ObservationWarning


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Wrapper(torch.nn.Module):
    """Like a PEFT adapter: its generate() calls the wrapped model's forward, never its own."""

    def __init__(self) -> None:
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model.model(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model.model(x)


def test_a_wrapper_that_calls_the_wrapped_model_names_it() -> None:
    model, observer = Wrapper(), InputObserver()
    expected = r"no call of Wrapper\.forward.*ran Inner\.forward \(model\.base_model\.model\)"
    with pytest.warns(ObservationWarning, match=expected), observer(model):
        model.generate(torch.ones(2, 3))
    assert observer.num_obs() == 0


def test_observing_the_wrapped_model_records_without_a_warning() -> None:
    model, observer = Wrapper(), InputObserver()
    with observer(model.base_model.model):
        model.generate(torch.ones(2, 3))
    assert observer.num_obs() == 1


def test_a_block_that_calls_nothing_says_so() -> None:
    model, observer = Inner(), InputObserver()
    with pytest.warns(ObservationWarning, match=r"no call of Inner\.forward.*nothing called it"), observer(model):
        pass


def test_the_hook_is_gone_once_a_call_is_recorded() -> None:
    model, observer = Inner(), InputObserver()
    with observer(model):
        model(torch.ones(1, 3))
        assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks
