"""What opening a format-version-3 manifest builds: compact tables, and the full models only when asked for.

Reading ``manifest.json`` (or a journal) of format version 3 checks every field at open (see
:mod:`iobundle.schema._compact`), then keeps:

- per distinct structure, one :class:`CompactStructure`: its number of tensor slots, a builder of
  its trees, and (on first use) the structure of its inputs as :func:`~iobundle.schema.call_key` gives it;
- per call, a :class:`DeferredCall`: a :class:`~iobundle.schema.CallEntry` holding only ``index``,
  ``status``, ``error``, ``latency`` and ``autocast``, plus its structure and tensor keys; its trees (``args``,
  ``kwargs``, ``cst_kwargs``, ``filled``, ``outputs``) are built on first access;
- per tensor, one :class:`TensorInfo` row (a named tuple) in :attr:`CompactTables.tensors`.

The :class:`DeferredManifest` builds its ``calls`` list and its ``tensors`` entries on first access
too. Anything that compares, copies, dumps or pickles a deferred model builds it in full first, so
it behaves as the plain model would. Reading an instance's ``__dict__`` builds it: that is how
pydantic's serializer reads a model, so every dump (``model_dump``, ``model_dump_json``, a
``TypeAdapter``, or a plain :class:`~iobundle.schema.Manifest` holding unbuilt calls) is whole; :func:`compact_tables`, :func:`tensor_rows` and
:func:`deferred_shape` are how readers that need only the compact form (shapes, keys, inference)
get at it without building anything.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel

from iobundle.schema._manifest import CallEntry, Extension, Manifest, TensorEntry, TensorNode
from iobundle.schema._structure import call_key

__all__ = [
    "CompactStructure",
    "CompactTables",
    "DeferredCall",
    "DeferredManifest",
    "TensorInfo",
    "compact_tables",
    "deferred_call",
    "deferred_calls",
    "deferred_keys",
    "deferred_manifest",
    "deferred_shape",
    "tensor_rows",
    "with_fields",
]

_new = object.__new__
_setattr = object.__setattr__
_stored = BaseModel.__dict__["__dict__"].__get__
"""An instance's field values as they are held, built or not (its ``__dict__`` attribute builds a deferred one first)."""
_store = BaseModel.__dict__["__dict__"].__set__


class TensorInfo(NamedTuple):
    """One tensor of the manifest, as opening keeps it: what a :class:`~iobundle.schema.TensorEntry` says."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    extends: tuple[str, int] | None
    offset: int | None = None
    """Where its bytes start in a segment (format version 4); None in a safetensors file."""


@dataclass(eq=False)
class CompactStructure:
    """One distinct call structure: its tensor slots, how many are inputs, and a builder of its trees."""

    n_slots: int
    n_inputs: int
    build: Callable[[list[TensorNode]], tuple[Any, ...]]
    """The trees of a call of this structure from its tensor nodes: ``(args, kwargs, cst_kwargs, filled, outputs)``."""
    input_key: Hashable | None = None
    """:func:`call_key` of the inputs (tensor keys erased), computed on first use."""


@dataclass(eq=False)
class CompactTables:
    """The checked bulk of a format-version-3 manifest: structures, tensor rows, and shared tensor nodes."""

    structures: list[CompactStructure]
    tensors: dict[str, TensorInfo]
    nodes: dict[str, TensorNode] = field(default_factory=dict)

    def node(self, key: str) -> TensorNode:
        """The tensor node of ``key`` (one object per key, shared by every call that holds it)."""
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = _made(TensorNode, {"kind": "tensor", "key": key})
        return node


_FIELDS: dict[type[BaseModel], set[str]] = {}


def _fields_set(cls: type[BaseModel]) -> set[str]:
    """The one ``__pydantic_fields_set__`` (every field) the instances of ``cls`` built here share."""
    return _FIELDS.get(cls) or _FIELDS.setdefault(cls, set(cls.model_fields))


_ORDER = {cls: tuple(cls.model_fields) for cls in (CallEntry, Manifest)}


def _made(
    cls: type[BaseModel],
    values: dict[str, Any],
    fields: type[BaseModel] | None = None,
    *,
    fields_set: set[str] | None = None,
) -> Any:
    """An instance of ``cls`` holding ``values`` (fields of ``fields``, default ``cls``, already checked), unvalidated.

    Instances of a class share one ``__pydantic_fields_set__`` (pydantic copies it before any change), unless
    ``fields_set`` gives its own.
    """
    obj = _new(cls)
    _store(obj, values)
    _setattr(obj, "__pydantic_fields_set__", _fields_set(fields or cls) if fields_set is None else fields_set)
    _setattr(obj, "__pydantic_extra__", None)
    _setattr(obj, "__pydantic_private__", None)
    return obj


class _Deferred:
    """Fields named in ``DEFERRED`` are built on first access; reading ``__dict__`` (comparing, copying, dumping) builds all first."""

    DEFERRED: ClassVar[frozenset[str]] = frozenset()

    def _fill(self) -> None:
        raise NotImplementedError

    def _filled(self) -> Any:
        if not _stored(self).keys() >= self.DEFERRED:
            self._fill()
        return self

    @property
    def __dict__(self) -> dict[str, Any]:
        """The field values, built first: what pydantic's serializer, ``__eq__``, ``__iter__`` and ``repr`` read."""
        self._filled()
        return _stored(self)

    @__dict__.setter
    def __dict__(self, values: dict[str, Any]) -> None:
        _store(self, values)

    def __getattr__(self, name: str) -> Any:
        if name in type(self).DEFERRED:
            self._fill()
            return _stored(self)[name]
        return super().__getattr__(name)  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BaseModel):
            return NotImplemented
        return (
            _plain(type(self)) is _plain(type(other))
            and self.__dict__ == other.__dict__
            and self.__pydantic_extra__ == other.__pydantic_extra__
        )

    def __hash__(self) -> int:
        return super().__hash__()

    def __repr_name__(self) -> str:
        return _plain(type(self)).__name__

    def __copy__(self) -> Any:
        """A copy of the plain class: what a copy changes (``model_copy(update=...)``) is then what it holds."""
        return _made(_plain(type(self)), copy.copy(self.__dict__), fields_set=copy.copy(self.__pydantic_fields_set__))

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        values = copy.deepcopy(self.__dict__, memo)
        return _made(_plain(type(self)), values, fields_set=copy.copy(self.__pydantic_fields_set__))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _same, (self.__copy__(),)  # pickled as the plain class


def _same(value: Any) -> Any:
    """What unpickling a deferred model calls: its plain copy, unpickled, is the value."""
    return value


def _plain(cls: type) -> type[BaseModel]:
    """The model class a deferred class stands for (``CallEntry``, ``Manifest``)."""
    return next(c for c in cls.__mro__ if issubclass(c, BaseModel) and not issubclass(c, _Deferred))


class DeferredCall(_Deferred, CallEntry):
    """A :class:`~iobundle.schema.CallEntry` whose trees are built from its structure and keys on first access."""

    __slots__ = ("_keys", "_structure", "_tables")
    DEFERRED: ClassVar[frozenset[str]] = frozenset({"args", "kwargs", "cst_kwargs", "filled", "outputs", "state"})

    def _fill(self) -> None:
        d = _stored(self)
        node = self._tables.node
        trees = self._structure.build([node(k) for k in self._keys])
        built = dict(zip(("args", "kwargs", "cst_kwargs", "filled", "outputs", "state"), trees))
        _store(self, {name: d[name] if name in d else built[name] for name in _ORDER[CallEntry]})


def deferred_call(
    tables: CompactTables, structure: CompactStructure, keys: list[str], values: dict[str, Any]
) -> DeferredCall:
    """A call of ``structure`` with tensor ``keys``; ``values`` holds index, status, error, latency and autocast."""
    call: DeferredCall = _made(DeferredCall, values, CallEntry)
    _setattr(call, "_structure", structure)
    _setattr(call, "_keys", keys)
    _setattr(call, "_tables", tables)
    return call


def deferred_keys(call: CallEntry) -> list[str] | None:
    """Every tensor key of a :class:`DeferredCall`, inputs then outputs, without building its trees; None otherwise."""
    return call._keys if type(call) is DeferredCall else None


def deferred_shape(call: CallEntry) -> tuple[Hashable, list[str]] | None:
    """For a :class:`DeferredCall`: :func:`call_key` of its inputs and their keys, worked out once per structure.

    None for any other call entry (its trees are there to walk).
    """
    if type(call) is not DeferredCall:
        return None
    structure = call._structure
    key = structure.input_key
    if key is None:
        call._filled()
        key = structure.input_key = call_key(call, [])
    return key, call._keys[: structure.n_inputs]


class DeferredManifest(_Deferred, Manifest):
    """A :class:`~iobundle.schema.Manifest` of format version 3 whose ``calls`` and ``tensors`` are built on first access.

    ``calls`` is the list of :class:`DeferredCall` (each still building its trees on demand);
    ``tensors`` is built from the rows of :attr:`tables`.
    """

    __slots__ = ("_calls", "_tables")
    DEFERRED: ClassVar[frozenset[str]] = frozenset({"calls", "tensors"})

    def _fill(self) -> None:
        d = dict(_stored(self))
        if "calls" not in d:
            d["calls"] = list(self._calls)
        if "tensors" not in d:
            d["tensors"] = _tensor_entries(self._tables.tensors)
        _store(self, {name: d[name] for name in _ORDER[Manifest]})  # the fields' order, as pydantic's

    def _filled(self) -> Any:
        super()._filled()
        for call in _stored(self)["calls"]:
            if isinstance(call, _Deferred):
                call._filled()
        return self


def deferred_manifest(values: dict[str, Any], tables: CompactTables, calls: list[DeferredCall]) -> DeferredManifest:
    """A manifest holding ``values`` (every field but calls and tensors), ``calls`` and the rows of ``tables``."""
    manifest: DeferredManifest = _made(DeferredManifest, values, Manifest)
    _setattr(manifest, "_tables", tables)
    _setattr(manifest, "_calls", calls)
    return manifest


def with_fields(manifest: Manifest, **values: Any) -> Manifest:
    """``manifest.model_copy(update=values)`` for fields other than calls and tensors, keeping a deferred one deferred."""
    if type(manifest) is not DeferredManifest:
        return manifest.model_copy(update=values)
    held = _stored(manifest)
    kept = {k: v for k, v in held.items() if k not in DeferredManifest.DEFERRED}
    copied = deferred_manifest({**kept, **values}, manifest._tables, manifest._calls)
    for name in DeferredManifest.DEFERRED & held.keys():  # already built: shared
        _stored(copied)[name] = held[name]
    return copied


def _tensor_entries(rows: dict[str, TensorInfo]) -> dict[str, TensorEntry]:
    entries = {}
    for key, (file, name, dtype, shape, device, ext, offset) in rows.items():
        extends = None if ext is None else _made(Extension, {"key": ext[0], "dim": ext[1]})
        entries[key] = _made(
            TensorEntry,
            {
                "file": file,
                "name": name,
                "dtype": dtype,
                "shape": list(shape),
                "device": device,
                "extends": extends,
                "offset": offset,
            },
        )
    return entries


def compact_tables(manifest: Manifest) -> CompactTables | None:
    """The compact tables a format-version-3 manifest was opened into; None for a manifest built otherwise."""
    return manifest._tables if type(manifest) is DeferredManifest else None


def deferred_calls(manifest: Manifest) -> list[CallEntry]:
    """``manifest.calls`` without building the list a :class:`DeferredManifest` keeps for that field."""
    if type(manifest) is DeferredManifest and "calls" not in _stored(manifest):
        return manifest._calls
    return manifest.calls


def tensor_rows(manifest: Manifest) -> dict[str, TensorInfo]:
    """Every tensor of ``manifest`` as a :class:`TensorInfo` row, by key (the rows kept at open, or made from the entries)."""
    tables = compact_tables(manifest)
    if tables is not None:
        return tables.tensors
    return {
        key: TensorInfo(
            e.file,
            e.name,
            e.dtype,
            tuple(e.shape),
            e.device,
            None if e.extends is None else (e.extends.key, e.extends.dim),
            e.offset,
        )
        for key, e in manifest.tensors.items()
    }
