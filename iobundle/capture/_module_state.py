"""``StateWatch``: the tensors of an observed module tree that a recorded call changes (state the calls do not carry)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StateWatch", "state_message"]

_Tensors = dict[str, tuple[torch.Tensor, int | None]]


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter: only its identity is compared
        return None


def _tensors(model: torch.nn.Module) -> _Tensors:
    """Every tensor the tree holds (parameters, buffers, tensor attributes), by path: the tensor and its version."""
    found: _Tensors = {}
    for prefix, module in model.named_modules(prefix="model"):
        for table in (module.__dict__, module._parameters, module._buffers):
            for name, value in table.items():
                if isinstance(value, torch.Tensor):
                    found[f"{prefix}.{name}"] = (value, _version(value))
    return found


class StateWatch:
    """Compares the tensors a module tree holds before and after its first ``calls`` recorded calls.

    A tensor rebound to another value (``self.h = new_h``) or changed in place (``self.h.copy_(...)``,
    ``self.count += 1`` on a buffer) is state kept between calls. A tensor rebound to an equal value
    (a cache recomputed the same way each call) is not; nor is one the call adds (a cache built
    lazily): a later watched call that changes it is. Changes made without the version counter
    (through ``.data``, or to an inference tensor in place) are not seen.
    """

    def __init__(self, model: Any, calls: int = 3) -> None:
        self._model, self._left = model, calls if isinstance(model, torch.nn.Module) else 0

    def before(self) -> _Tensors | None:
        """The tensors before a call, for ``changed``; None once the watched calls are spent."""
        if self._left <= 0:
            return None
        self._left -= 1
        try:
            return _tensors(self._model)
        except Exception:  # observation never breaks the observed program
            return None

    def changed(self, before: _Tensors) -> list[str]:
        """The paths of the tensors held ``before`` that the call rebound to another value or changed in place."""
        paths = []
        try:
            after = _tensors(self._model)
        except Exception:
            return []
        for path, (tensor, version) in after.items():
            old = before.get(path)
            if old is None:
                continue
            if tensor is old[0]:
                if version != old[1]:
                    paths.append(path)
            elif not _equal(tensor, old[0]):
                paths.append(path)
        return paths


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    except Exception:  # a tensor that cannot be compared (a subclass, a meta tensor) counts as changed
        return False


def state_message(paths: list[str], what: Any) -> str:
    """The warning for the state ``paths`` that calls of ``what`` change."""
    names = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    return (
        f"iobundle: a call of {what} changed tensors its module tree keeps between calls ({names}). The recorded "
        "calls do not carry this state: replayed from the bundle, each call starts from the state left after the "
        "last one, so the export check fails on every call whose outputs depend on it. Pass the state in and out "
        "of the method (as a cache argument and output), or reset it at the start of each call."
    )
