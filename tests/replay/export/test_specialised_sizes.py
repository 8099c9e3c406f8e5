"""A dynamic dimension the model's code turns into a Python number: traced again with ``sizes_through_int``.

``int()`` of a traced size fixes it in a non-strict trace (torch.export: "your code specialized
it to be a constant"). The export traces again with the patch, which keeps such an ``int()``
symbolic in the model's own modules; the program then serves sizes never recorded.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iobundle import ExportError, InputObserver
from iobundle.replay.export._patches import _SizeInt, patch_sizes_through_int

DYNAMIC = torch.export.Dim.DYNAMIC


class PositionFromCacheLength(torch.nn.Module):
    """ProphetNet-style: a decode step's position is ``int()`` of the cached length plus one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.positions = torch.nn.Embedding(32, 8)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        position = torch.ones((1, 1), dtype=torch.long) * int(past.shape[1] + 1)
        return x + self.positions(position) + past.mean(dim=1, keepdim=True)


class LoopOverLength(torch.nn.Module):
    """A Python loop over a size: a specialisation that no patch removes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[:, i] * i for i in range(int(x.shape[1]))], dim=1)


def _observe(model: torch.nn.Module, calls: list[tuple[torch.Tensor, ...]]) -> InputObserver:
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(calls)):
        for args in calls:
            model(*args)
    return observer


def _growing_cache(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 1, 8, generator=g), torch.randn(2, n, 8, generator=g)) for n in lengths]


def test_int_of_a_cache_length_specialises_a_plain_trace() -> None:
    # What the second trace is for: without the patch, torch.export refuses the dynamic length.
    x, past = _growing_cache([3])[0]
    with pytest.raises(Exception, match="specialized it to be a constant"):
        torch.export.export(PositionFromCacheLength(), (x, past), dynamic_shapes=({}, {1: DYNAMIC}))


def test_int_of_a_cache_length_traced_again_serves_lengths_never_recorded() -> None:
    model = PositionFromCacheLength().eval()
    observer = _observe(model, _growing_cache([2, 3, 4]))
    ep = observer.export(model)
    report = ep.report
    assert "sizes_through_int" in report.patches
    assert any(o.startswith("traced again with sizes_through_int") for o in report.options)
    assert [c.success for c in report.calls] == [True, True, True]
    for length in (1, 9):  # the position follows the length in the program too
        x, past = _growing_cache([length])[0]
        torch.testing.assert_close(ep.program.module()(x, past), model(x, past))


def test_a_specialisation_the_patch_does_not_remove_reports_the_first_failure() -> None:
    model = LoopOverLength()
    g = torch.Generator().manual_seed(2)
    observer = _observe(model, [(torch.randn(2, n, 3, generator=g),) for n in (2, 3)])
    with pytest.raises(ExportError, match="Constraints violated") as info:
        observer.export(model)
    assert any(o.startswith("traced again with sizes_through_int") for o in info.value.report.options)


def test_a_model_that_traces_at_once_is_traced_once_without_the_patch() -> None:
    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.shape[1]

    g = torch.Generator().manual_seed(3)
    model = Plain()
    observer = _observe(model, [(torch.randn(2, n, generator=g),) for n in (2, 5)])
    report = observer.export(model).report
    assert "sizes_through_int" not in report.patches
    assert not any(o.startswith("traced again") for o in report.options)


def test_size_int_is_the_builtin_for_every_value_but_a_traced_size() -> None:
    assert isinstance(3, _SizeInt) and isinstance(True, _SizeInt) and not isinstance(3.0, _SizeInt)
    assert isinstance(4, (float, _SizeInt)) and issubclass(bool, _SizeInt) and not issubclass(float, _SizeInt)
    values = [_SizeInt(3.9), _SizeInt(-3.9), _SizeInt("12"), _SizeInt("ff", 16), _SizeInt(torch.tensor(7)), _SizeInt()]
    assert values == [3, -3, 12, 255, 7, 0]
    assert all(type(v) is int for v in values)
    with pytest.raises(ValueError):
        _SizeInt("seven")


def test_sizes_through_int_is_scoped_to_the_model_modules() -> None:
    model = PositionFromCacheLength()
    here = sys.modules[__name__]
    with patch_sizes_through_int(model):
        assert here.int is _SizeInt  # type: ignore[attr-defined]
        assert "int" not in vars(torch.nn.modules.sparse)  # torch's own modules are left alone
    assert "int" not in vars(here)
