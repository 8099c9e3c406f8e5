"""A recorded call cut to batch 1, for every cache kind the zoo records: the eager model reproduces that row.

The check beyond the recorded calls (``iobundle.replay.export.cut_call``) slices every input
of a recorded call along its batch axis, caches included, and rebuilds the caches from the
cut tensors. For one tiny zoo family per cache kind, captured from a real ``generate()`` of a
batch of 2 (the first row left-padded), every recorded call is cut to batch 1 and the eager
model run on the cut inputs: its outputs must be the recorded outputs' first row, within
float32 noise. The same holds for the whole call (batch 2, what ``iobundle rerun`` feeds):
a rebuilt cache must serve the model as the recorded one did, past a sliding window or
chunk included (where a rebuilt layer's count of tokens seen is restored from the mask).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from families import family, missing_requirement

from iobundle import InputObserver
from iobundle.calls import tensor_keys
from iobundle.replay.check import flatten_outputs
from iobundle.replay.export import cut_call

# Cache kind -> the zoo family that records it, and the class name of a cache or layer it must hold.
KINDS = {
    "dynamic": ("llama", "DynamicLayer"),
    "sliding": ("mistral", "DynamicSlidingWindowLayer"),
    "chunked": ("llama4_text", "DynamicSlidingWindowLayer"),
    "static": ("llama_static_cache", "StaticCache"),
    "state-space": ("mamba", "LinearAttentionLayer"),
    "hybrid": ("lfm2", "LinearAttentionLayer"),
    # A static attention part beside the convolution, and a mask dict whose "conv" entry is None at decode.
    "hybrid-static": ("lfm2_static_cache", "StaticCache"),
    "encoder-decoder": ("pix2struct", "EncoderDecoderCache"),
    "quantized": ("llama_quantized_cache", "QuantizedCache"),
}
BATCH = 2  # every zoo family records a batch of 2


def _cache(kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    from transformers.cache_utils import Cache

    return next((v for v in [*args, *kwargs.values()] if isinstance(v, Cache)), None)


def _class_names(cache: Any) -> set[str]:
    names = {type(cache).__name__}
    for part in (cache, getattr(cache, "self_attention_cache", None)):
        names.update(type(layer).__name__ for layer in getattr(part, "layers", ()))
    return names


@pytest.fixture(scope="module", params=list(KINDS), ids=list(KINDS))
def recorded(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, Any]:
    """A zoo family's model and its recorded calls (in memory), one per cache kind."""
    kind = request.param
    entry = family(KINDS[kind][0])
    if (why := missing_requirement(entry)) is not None:
        pytest.skip(why)
    model, kwargs = entry.build()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=entry.store_n_calls):
        model.generate(**kwargs)
    return kind, model, observer._recorded()


@pytest.mark.parametrize("batch", [1, BATCH], ids=["cut_to_1", "whole_call"])
def test_eager_model_on_cut_call_reproduces_recorded_rows(recorded: tuple[str, Any, Any], batch: int) -> None:
    kind, model, rc = recorded
    family_name, expected_class = KINDS[kind]
    seen_classes: set[str] = set()
    past_window = False
    assert len(rc.ok_calls) >= 4
    for index, call in enumerate(rc.ok_calls):
        args, kwargs = cut_call(rc, index, batch)
        cache = _cache(kwargs, args)
        if cache is not None:
            seen_classes |= _class_names(cache)
            layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", ())
            past_window |= any(
                type(layer).__name__ == "DynamicSlidingWindowLayer" and layer.cumulative_length >= layer.sliding_window
                for layer in layers
            )
        with torch.no_grad():
            obtained = flatten_outputs(model(*args, **kwargs))
        expected = [rc.store.get(k) for k in tensor_keys(call.outputs)]
        expected = [t.narrow(0, 0, batch) if t.dim() and t.shape[0] == BATCH else t for t in expected]
        assert len(obtained) == len(expected), f"{family_name} call {index}"
        for i, (got, want) in enumerate(zip(obtained, expected)):
            where = f"{family_name} call {index}, output {i}"
            torch.testing.assert_close(got, want, msg=lambda m, where=where: f"{where}: {m}")
    assert expected_class in seen_classes, f"{family_name} recorded {sorted(seen_classes)}, not a {expected_class}"
    if kind in ("sliding", "chunked"):
        assert past_window, f"{family_name}'s calls never go past the window: the test would not see its token count"
