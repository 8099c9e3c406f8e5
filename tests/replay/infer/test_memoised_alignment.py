"""Alignment done once per call structure gives what aligning every call on its own gives.

``align_calls`` aligns the first call of each structure (the trees with their tensor keys
erased) and lays the others out by the same template; ``align_calls(rc, memo=False)`` aligns
every call one by one and is the reference. Mixed recordings (a prefill then decode steps, failed
calls, absent and None arguments, a tensor passed twice) are compared in memory and reloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from observing import Calls, observe, source

from iobundle import AlignmentError, InputObserver
from iobundle.replay import infer


class Decoder(torch.nn.Module):
    def forward(self, input_ids, past=None, attention_mask=None, cache_position=None, use_cache=True):
        if input_ids.shape[1] == 7:
            raise ValueError("no prompt of 7")
        return input_ids.float().sum() + sum(p.sum() for p in past or [])


def _decode_calls() -> Calls:
    """A prefill (no cache), a failed call, decode steps growing by one, one passing no mask."""
    calls: Calls = [((torch.ones(2, 4, dtype=torch.int64),), {"attention_mask": torch.ones(2, 4)})]
    calls.append(((torch.ones(2, 7, dtype=torch.int64),), {}))  # fails: recorded, never aligned
    for step in range(6):
        past = [torch.randn(2, 3, 4 + step, 8) for _ in range(4)]
        kwargs = {"past": past, "cache_position": torch.tensor([4 + step])}
        if step != 3:
            kwargs["attention_mask"] = torch.ones(2, 5 + step)
        calls.append(((torch.ones(2, 1, dtype=torch.int64),), kwargs))
    shared = torch.randn(2, 3, 10, 8)
    calls.append(((torch.ones(2, 1, dtype=torch.int64), [shared, shared, shared, shared]), {}))  # one tensor 4 times
    calls.append(((torch.ones(2, 1, dtype=torch.int64), None, torch.ones(2, 11)), {}))  # None, then by position
    return calls


def _record(calls: Calls) -> InputObserver:
    observer = InputObserver()
    model = Decoder()
    with observer(model, store_n_calls=len(calls)):
        for args, kwargs in calls:
            try:
                model(*args, **kwargs)
            except ValueError:
                pass
    return observer


def _same(memoised: infer.Alignment, reference: infer.Alignment) -> None:
    assert memoised.slots == reference.slots
    assert memoised.owners == reference.owners
    assert memoised.best == reference.best
    assert memoised.layout == reference.layout
    assert [c.index for c in memoised.calls] == [c.index for c in reference.calls]


@pytest.mark.parametrize("where", ["memory", "bundle"])
def test_memoised_alignment_is_the_reference_on_a_mixed_recording(where: str, tmp_path: Path) -> None:
    recorded = source(_record(_decode_calls()), where, tmp_path)
    rc = recorded._recorded()
    assert [c.status for c in rc.calls].count("failed") == 1
    memoised = infer.align_calls(rc)
    reference = infer.align_calls(rc, memo=False)
    _same(memoised, reference)
    structures = {infer.call_shape(c).key for c in rc.ok_calls}
    assert 1 < len(structures) < len(rc.ok_calls)  # decode steps share one; the memo had work to share
    for call, slots in zip(memoised.calls, memoised.slots):
        assert infer.align_call(rc, reference, call) == slots  # each call aligned on its own
    shared = memoised.slots[-2]  # the call passing one tensor four times keeps the key in every slot
    assert len({shared[i] for i, owner in enumerate(memoised.owners) if owner == "past"}) == 1


@pytest.mark.parametrize("where", ["memory", "bundle"])
def test_inference_from_the_memo_matches_the_reference(where: str, tmp_path: Path) -> None:
    recorded = source(_record(_decode_calls()), where, tmp_path)
    rc = recorded._recorded()
    reference = infer.align_calls(rc, memo=False)
    expected = {
        "dims": infer.flat_dynamic_dims(rc, reference),
        "batch": infer.flat_dynamic_dims(rc, reference, True),
        "fed": infer.fed_shapes(rc, reference),
        "args": [t.shape for t in infer.infer_arguments(rc, flat=True, alignment=reference)],
    }
    assert recorded.infer_dynamic_shapes(dim_names=True)  # through the memo
    memoised = infer.align_calls(rc)
    assert infer.flat_dynamic_dims(rc, memoised) == expected["dims"]
    assert infer.flat_dynamic_dims(rc, memoised, True) == expected["batch"]
    assert infer.fed_shapes(rc, memoised) == expected["fed"]
    assert [t.shape for t in recorded.infer_arguments(flat=True)] == expected["args"]


def test_alignment_errors_are_the_reference_ones(tmp_path: Path) -> None:
    """Calls of two structures that cannot be aligned: the same error, naming the same calls."""
    calls: Calls = [
        ((torch.ones(2, 1, dtype=torch.int64), [torch.randn(1, 2)]), {}),
        ((torch.ones(2, 1, dtype=torch.int64), [torch.randn(1, 2)]), {}),
        ((torch.ones(2, 1, dtype=torch.int64), [torch.randn(1, 2), torch.randn(1, 2)]), {}),
        ((torch.ones(2, 1, dtype=torch.int64), [torch.randn(1, 2)]), {}),
    ]
    rc = source(observe(Decoder(), calls), "bundle", tmp_path)._recorded()
    with pytest.raises(AlignmentError) as reference:
        infer.align_calls(rc, memo=False)
    with pytest.raises(AlignmentError) as memoised:
        infer.align_calls(rc)
    assert str(memoised.value) == str(reference.value)
    assert "call 0" in str(memoised.value) and "call 2" in str(memoised.value)


def test_the_cached_alignment_follows_the_calls() -> None:
    """Recording more calls, or removing an input, gives a fresh alignment, never the stale one."""
    model, observer = Decoder(), InputObserver()
    with observer(model, store_n_calls=10):
        model(torch.ones(1, 2, dtype=torch.int64), attention_mask=torch.ones(1, 2))
    rc = observer._recorded()
    first = infer.align_calls(rc)
    assert infer.align_calls(rc) is first  # cached while the calls stay the same
    with observer(model, store_n_calls=10):
        model(torch.ones(1, 3, dtype=torch.int64), attention_mask=torch.ones(1, 3))
    second = infer.align_calls(rc)
    assert len(second.calls) == 2 and second.slots == infer.align_calls(rc, memo=False).slots
    assert observer.infer_dynamic_shapes() == {
        "input_ids": {1: torch.export.Dim.DYNAMIC},
        "attention_mask": {1: torch.export.Dim.DYNAMIC},
    }
    observer.remove_inputs(["attention_mask"])
    assert infer.align_calls(rc).owners == [0]
    assert observer.infer_dynamic_shapes() == ({1: torch.export.Dim.DYNAMIC},)
