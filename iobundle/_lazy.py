"""Imports paid for when first used: the module ``__getattr__`` of a cheap facade, a module imported on first use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["LazyMapping", "lazy_module", "lazy_names"]


def lazy_names(facade: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``facade`` that imports each name from where its ``TYPE_CHECKING`` block does.

    The facade lists its names once, as ``from <module> import <name>`` under ``if TYPE_CHECKING:``
    (what a type checker and the docs read); its own ``import`` statements stay light, and the first
    use of a name imports its module, found in that block of the facade's source (parsed once).
    """
    where: dict[str, str] = {}

    def __getattr__(name: str) -> Any:
        if not where:
            import ast

            with open(sys.modules[facade].__file__ or "", encoding="utf-8") as source:
                tree = ast.parse(source.read())
            where.update(  # at once: another thread never sees half the table
                {
                    alias.asname or alias.name: node.module
                    for block in tree.body
                    if isinstance(block, ast.If)
                    and isinstance(block.test, ast.Name)
                    and block.test.id == "TYPE_CHECKING"
                    for node in block.body
                    if isinstance(node, ast.ImportFrom) and node.module
                    for alias in node.names
                }
            )
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {facade!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


class _LazyModule(ModuleType):
    """Stands for a module until one of its attributes is read (see :func:`lazy_module`)."""

    def __init__(self, name: str, namespace: dict[str, Any], alias: str) -> None:
        super().__init__(name)
        self.__dict__.update(_lazy_namespace=namespace, _lazy_alias=alias)

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        namespace = self.__dict__["_lazy_namespace"]
        if namespace.get(self.__dict__["_lazy_alias"]) is self:
            namespace[self.__dict__["_lazy_alias"]] = module  # from now on the importer uses the module itself
        return getattr(module, attr)


def lazy_module(name: str, namespace: dict[str, Any], alias: str | None = None) -> Any:
    """A stand-in for the module ``name`` that imports it when one of its attributes is first read.

    A module imports a heavy dependency this way when only some of its functions use it, so that
    importing the module (to read a manifest, check a file's size or hash) does not load it::

        if TYPE_CHECKING:
            import torch
        else:
            torch = lazy_module("torch", globals())

    On first use the stand-in imports ``name`` and puts the module in its place in ``namespace``
    (under ``alias``, by default the last part of ``name``), so later uses cost nothing. The
    stand-in is never put into ``sys.modules``: ``name`` is there only once it is imported.
    """
    return _LazyModule(name, namespace, alias or name.rpartition(".")[2])


class LazyMapping(Mapping[K, V], Generic[K, V]):
    """A read-only mapping built by ``build`` on its first use (a table keyed by a heavy module's objects)."""

    def __init__(self, build: Callable[[], Mapping[K, V]]) -> None:
        self._build: Callable[[], Mapping[K, V]] | None = build
        self._data: Mapping[K, V] = {}

    def _table(self) -> Mapping[K, V]:
        if self._build is not None:
            self._data, self._build = self._build(), None
        return self._data

    def __getitem__(self, key: K) -> V:
        return self._table()[key]

    def get(self, key: K, default: Any = None) -> Any:  # the table's own: a miss raises nothing
        return self._table().get(key, default)

    def __iter__(self) -> Iterator[K]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())
