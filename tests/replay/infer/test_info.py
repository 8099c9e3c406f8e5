"""``info.inputs[i]``: the per-call records, named and shaped like the anchors' ``InputCandidate``.

Compared with ``torch.onnx.InputObserver``'s records on the same calls, in memory and on the
reloaded bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from observing import Calls, observe, source
from torch.onnx import InputObserver as ReferenceObserver

import iobundle
from iobundle.replay import InputCandidate


class Optional(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        return (x if y is None else x - y) * scale


class EitherWay(torch.nn.Module):
    def forward(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        return x if y is None else x + y


def shapes(tensors: list[torch.Tensor | None] | None) -> list[Any] | None:
    return None if tensors is None else [None if t is None else tuple(t.shape) for t in tensors]


OPTIONAL_CALLS: Calls = [
    ((torch.randn(5, 6),), {}),
    ((torch.randn(6, 7), torch.randn(1, 7)), {}),
    ((torch.randn(7, 8), torch.randn(1, 8)), {}),
]


class TestRecordsLikeTheReference:
    def test_aligned_records_match(self, where: str, tmp_path: Path) -> None:
        ref = observe(Optional(), OPTIONAL_CALLS, ReferenceObserver())
        ref.infer_dynamic_shapes()  # the reference aligns its records here
        ours = source(observe(Optional(), OPTIONAL_CALLS), where, tmp_path)
        assert len(ours.info.inputs) == len(ref.info.inputs) == 3
        for mine, theirs in zip(ours.info.inputs, ref.info.inputs):
            assert shapes(mine.aligned_flat_list) == shapes(theirs.aligned_flat_list)
            assert mine.n_aligned_tensors == theirs.n_aligned_tensors
            assert shapes(mine.flat_list) == shapes(theirs.flat_list)
            assert len(mine.args) == len(theirs.args) and list(mine.kwargs) == list(theirs.kwargs)
            assert all(torch.equal(a, b) for a, b in zip(mine.args, theirs.args))
            assert mine.position_to_args_kwargs == theirs.position_to_args_kwargs
            assert mine.n_tensors_for_args_kwargs == theirs.n_tensors_for_args_kwargs
            assert str(mine) == str(theirs)
            assert len(mine) == len(theirs)

    def test_every_present_tensor_is_aligned(self, where: str, tmp_path: Path) -> None:
        """yobx's invariant: the tensors of a call are its aligned slots that are not None."""
        calls: Calls = [
            ((torch.randn(5, 6),), {}),
            ((), {"x": torch.randn(5, 7), "y": torch.randn(5, 7)}),
            ((torch.randn(5, 8),), {}),
        ]
        ours = source(observe(EitherWay(), calls), where, tmp_path)
        for candidate in ours.info.inputs:
            aligned = candidate.aligned_flat_list
            assert aligned is not None
            assert shapes(candidate.flat_list) == shapes([t for t in aligned if t is not None])

    def test_str_obs_describes_inputs_and_constants(self, where: str, tmp_path: Path) -> None:
        calls: Calls = [((torch.randn(2, 3),), {"y": torch.ones(1, 3, dtype=torch.int64), "scale": 2.0})]
        ours = source(observe(Optional(), calls), where, tmp_path)
        text = ours.info.inputs[0].str_obs()
        assert text == "InputCandidate(args=(float32[2,3],), kwargs={y: int64[1,3]}, cst_kwargs={'scale': 2.0})"
        assert ours.info.inputs[0].cst_kwargs == {"scale": 2.0}

    def test_outputs_and_latencies_line_up_with_inputs(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Optional(), OPTIONAL_CALLS), where, tmp_path)
        assert len(ours.info.flat_outputs) == len(ours.info.latencies) == len(ours.info.inputs)
        first = ours.info.inputs[0]
        assert torch.equal(ours.info.flat_outputs[0][0], first.args[0])
        assert first.call is not None and first.call.index == 0


class TestInputCandidate:
    def test_importable_like_the_anchors(self) -> None:
        from iobundle.observer import InputCandidate as FromObserver

        assert iobundle.InputCandidate is FromObserver is InputCandidate

    def test_a_recorded_candidate_selects_its_call(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Optional(), OPTIONAL_CALLS), where, tmp_path)
        for i, candidate in enumerate(ours.info.inputs):
            got = ours.infer_arguments(candidate, flat=True)
            assert shapes(got) == shapes(ours.infer_arguments(i, flat=True))

    def test_a_built_candidate_is_laid_out_like_the_calls(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Optional(), OPTIONAL_CALLS), where, tmp_path)
        x = torch.randn(4, 3)
        candidate = InputCandidate((x,), {}, clone=True)
        x.add_(1.0)  # cloned: the candidate keeps the values it was given
        assert not torch.equal(candidate.args[0], x)
        assert candidate.aligned_flat_list is None
        with pytest.raises(RuntimeError, match="built from values"):
            candidate.n_aligned_tensors  # noqa: B018
        got = ours.infer_arguments(candidate, flat=True)
        assert shapes(got) == shapes(ours.infer_arguments((candidate.args[0],), flat=True)) == [(4, 3), (1, 0)]

    def test_a_candidate_of_other_calls_is_refused(self, tmp_path: Path) -> None:
        ours = observe(Optional(), OPTIONAL_CALLS)
        other = observe(Optional(), OPTIONAL_CALLS)
        for candidate in other.info.inputs:
            with pytest.raises(ValueError, match="not a successful call of these recorded calls"):
                ours.infer_arguments(candidate)
