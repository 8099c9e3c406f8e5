"""iobundle's marker of a dynamic dimension, and its conversion to ``torch.export.Dim.DYNAMIC``.

Inference marks a dimension whose size varies with :data:`DYNAMIC` (or with its name, a string,
under ``dim_names``), so that reading a bundle and inferring from it needs no torch (``iobundle
inspect``, ``iobundle shapes``). :func:`to_torch_dims` turns the markers into torch's where a
result is handed to torch or promised as torch objects (``infer_dynamic_shapes``, the exports).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from iobundle._lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["DYNAMIC", "DynamicDim", "to_torch_dims"]


class DynamicDim:
    """The type of :data:`DYNAMIC`: a dimension whose size varies, to be ``torch.export.Dim.DYNAMIC``."""

    __slots__ = ()

    name: Final = "DYNAMIC"

    def __repr__(self) -> str:
        return "DYNAMIC"

    def __reduce__(self) -> str:
        return "DYNAMIC"  # copies and pickles are the one marker


DYNAMIC: Final = DynamicDim()
"""A dimension whose size varies across the recorded calls (``torch.export.Dim.DYNAMIC`` once converted)."""


def to_torch_dims(
    dynamic_shapes: tuple[Any, ...] | dict[str, Any], named: Callable[[str], Any] | None = None
) -> tuple[Any, ...] | dict[str, Any]:
    """``dynamic_shapes`` with every :data:`DYNAMIC` replaced by ``torch.export.Dim.DYNAMIC``.

    A name (a string among a tensor's dimensions) is kept, or replaced by ``named(name)`` when given.
    """
    converted: tuple[Any, ...] | dict[str, Any] = _torch_dims(dynamic_shapes, named)
    return converted


def _torch_dims(value: Any, named: Callable[[str], Any] | None) -> Any:
    if isinstance(value, DynamicDim):
        return torch.export.Dim.DYNAMIC
    if isinstance(value, dict):
        if named is not None and value and all(isinstance(k, int) for k in value):
            return {k: named(v) if isinstance(v, str) else _torch_dims(v, None) for k, v in value.items()}
        return {k: _torch_dims(v, named) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_torch_dims(v, named) for v in value)
    if isinstance(value, list):
        return [_torch_dims(v, named) for v in value]
    return value
