"""Public names imported when first used: the module ``__getattr__`` of a cheap facade."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(facade: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``facade`` that imports ``name`` from the module ``where[name]``.

    The facade's own ``import`` statements stay light; the first use of a name pays for its module.
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {facade!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
