"""The bundle writer names each call's tensor file after its index: two calls with one index are refused."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver
from iobundle.errors import BundleWriteError


def test_saving_two_calls_with_one_index_is_refused(tmp_path):
    model, observer = torch.nn.Linear(4, 2), InputObserver()
    with observer(model):
        model(torch.randn(1, 4))
        model(torch.randn(2, 4))
    rc = observer._recorded()
    rc.calls[1] = rc.calls[1].model_copy(update={"index": 0})
    with pytest.raises(BundleWriteError, match=r"Call 0 is written twice .* calls/000000\.safetensors"):
        observer.save(tmp_path / "b")
    assert not (tmp_path / "b" / "manifest.json").exists()
