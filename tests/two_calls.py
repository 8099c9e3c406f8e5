"""The model and the two calls that the tests of bundles at URLs record (a plain module: ``conftest.py`` puts this folder on ``sys.path``).

``test_remote.py`` (fsspec's in-memory filesystem) and ``test_remote_s3.py`` (a real S3 API) make the same
public calls on the same recording.
"""

from __future__ import annotations

from typing import Any

import torch

from iobundle import InputObserver


class Model(torch.nn.Module):
    def forward(self, x, mask=None):
        return x * 2 if mask is None else x * mask


def record(observer: InputObserver, **kwargs: Any) -> InputObserver:
    """``observer`` after two calls of :class:`Model`: a ``(2, 3)`` input, then ``(5, 3)`` with a mask."""
    model = Model()
    with observer(model, **kwargs):
        model(torch.randn(2, 3))
        model(torch.randn(5, 3), mask=torch.ones(5, 3))
    return observer
