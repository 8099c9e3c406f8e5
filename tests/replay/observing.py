"""Helpers of the replay tests that run every case in memory and on the reloaded bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from iobundle import InputObserver, load_bundle

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]


def observe(model: torch.nn.Module, calls: Calls, observer: Any = None) -> Any:
    """Run ``calls`` (``(args, kwargs)`` pairs) through ``model`` inside one observed block."""
    observer = observer if observer is not None else InputObserver()
    with observer(model, store_n_calls=len(calls)):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


def source(observer: InputObserver, where: str, tmp_path: Path) -> Any:
    """``observer`` itself (``where == "memory"``), or the bundle it saves, reloaded."""
    if where == "memory":
        return observer
    observer.save(tmp_path / "run.iobundle")
    return load_bundle(tmp_path / "run.iobundle")
