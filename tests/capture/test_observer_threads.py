"""The observed method called from several threads at once: each call is recorded whole."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, load_bundle


class Tagged(torch.nn.Module):
    """Returns its input doubled and the tag it carries, after a random pause (so calls overlap)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"running": 0, "overlap": 0}  # not numbers on the module: those would be state, and warn
        self._lock = threading.Lock()

    def forward(self, x, shared, scale=None):
        with self._lock:
            self.calls["running"] += 1
            self.calls["overlap"] = max(self.calls["overlap"], self.calls["running"])
        time.sleep(random.random() / 200)
        with self._lock:
            self.calls["running"] -= 1
        if int(x[0, 0]) % 13 == 12:
            raise ValueError(f"tag {int(x[0, 0])} fails")
        return {"double": x * 2, "tag": x[:, :1].clone(), "scaled": shared * (1 if scale is None else scale)}


def call(model: Tagged, i: int, shared: torch.Tensor) -> int:
    x = torch.full((1 + i % 5, 3), float(i))
    try:
        kwargs = {"scale": torch.full((1,), float(i))} if i % 2 else {}
        out = model(x, shared, **kwargs)
    except ValueError:
        return -1
    assert torch.equal(out["double"], x * 2)
    return i


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_calls_are_recorded_whole(tmp_path: Path, stream: bool) -> None:
    model, observer = Tagged(), InputObserver()
    shared = torch.arange(3.0)
    options = {"stream_to": tmp_path / "run"} if stream else {}
    with observer(model, store_n_calls=64, **options), ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: call(model, i, shared), range(64)))
    assert model.calls["overlap"] > 1  # the calls did run at the same time
    assert sorted(r for r in results if r >= 0) == [i for i in range(64) if i % 13 != 12]
    if not stream:
        observer.save(tmp_path / "run")
    bundle = load_bundle(tmp_path / "run")
    assert bundle.verify() == []
    for source, calls in ((observer, observer.info.calls), (bundle, bundle.calls)):
        assert len(calls) == 64 and [c.index for c in calls] == list(range(64))
        tags = []
        for c in calls:
            x = source._recorded().store.get(c.args[0].key)
            tag = int(x[0, 0])
            tags.append(tag)
            assert torch.equal(x, torch.full((1 + tag % 5, 3), float(tag)))
            assert ("scale" in c.kwargs) == bool(tag % 2)
            if "scale" in c.kwargs:
                assert torch.equal(source._recorded().store.get(c.kwargs["scale"].key), torch.full((1,), float(tag)))
            if tag % 13 == 12:
                assert c.status == "failed" and f"tag {tag} fails" in c.error and c.outputs is None
                continue
            assert c.status == "ok"
            out = {k: source._recorded().store.get(n.key) for k, n in zip(c.outputs.keys, c.outputs.items)}
            assert torch.equal(out["double"], x * 2)
            assert torch.equal(out["tag"], x[:, :1])
            assert torch.equal(out["scaled"], shared * (tag if tag % 2 else 1))
        assert sorted(tags) == list(range(64))
        assert len({c.args[1].key for c in calls}) == 1  # the shared tensor: one snapshot, one key
    assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes())
