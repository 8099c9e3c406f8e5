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


def to_torch_dims(dynamic_shapes: Any, named: Callable[[str], Any] | None = None) -> Any:
    """``dynamic_shapes`` with every :data:`DYNAMIC` replaced by ``torch.export.Dim.DYNAMIC``.

    A name (a string among a tensor's dimensions) is kept, or replaced by ``named(name)`` when given.
    """
    if isinstance(dynamic_shapes, DynamicDim):
        return torch.export.Dim.DYNAMIC
    if isinstance(dynamic_shapes, dict):
        if named is not None and dynamic_shapes and all(isinstance(k, int) for k in dynamic_shapes):
            return {k: named(v) if isinstance(v, str) else to_torch_dims(v) for k, v in dynamic_shapes.items()}
        return {k: to_torch_dims(v, named) for k, v in dynamic_shapes.items()}
    if isinstance(dynamic_shapes, tuple):
        return tuple(to_torch_dims(v, named) for v in dynamic_shapes)
    if isinstance(dynamic_shapes, list):
        return [to_torch_dims(v, named) for v in dynamic_shapes]
    return dynamic_shapes
