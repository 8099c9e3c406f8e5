"""The one in-memory model of recorded calls, shared by capture (in memory) and replay (from disk).

:class:`RecordedCalls` holds the observed method's signature, the calls as manifest
entries (trees whose tensors are referenced by key) and a :class:`TensorStore` that
resolves keys to tensors. ``InputObserver`` fills one while recording; ``Bundle`` builds
one from ``manifest.json``. Every inference runs on it, so both give identical results.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from iobundle._lazy import lazy_module
from iobundle.schema import CallEntry, MissingValueEntry, ParameterEntry, SignatureEntry

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["DictTensorStore", "RecordedCalls", "TensorStore", "positional_names", "signature_entry"]


class TensorStore(Protocol):
    """Resolves tensor keys; ``shape``/``dtype`` must not read tensor data."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def dtype(self, key: str) -> torch.dtype: ...

    def get(self, key: str) -> torch.Tensor: ...


class DictTensorStore:
    """Tensors held in memory, by key."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = tensors if tensors is not None else {}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def _json_default(value: Any) -> tuple[bool, Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    try:
        return True, json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False, None


def signature_entry(method: Callable[..., Any], method_name: str) -> SignatureEntry:
    """Describe ``method``'s signature: names, kinds and JSON-able defaults."""
    sig = inspect.signature(method)
    parameters = []
    for p in sig.parameters.values():
        has_default = p.default is not inspect.Parameter.empty
        ok, default = _json_default(p.default) if has_default else (False, None)
        entry = {"name": p.name, "kind": p.kind.name, "has_default": has_default and ok, "default": default}
        parameters.append(ParameterEntry.model_validate(entry))
    owner = getattr(method, "__self__", None)
    qualname = getattr(method, "__qualname__", method_name)
    if owner is not None:
        qualname = f"{type(owner).__module__}.{type(owner).__qualname__}.{method_name}"
    return SignatureEntry(method=method_name, qualname=qualname, parameters=parameters)


@dataclass
class RecordedCalls:
    """Recorded calls plus what inference needs to read them.

    Attributes:
        signature: The observed method's signature.
        calls: Every recorded call, failed ones included (``status != "ok"``).
        store: Resolves tensor keys.
        value_if_missing: Placeholders given by the user, by name or position.
        version: Bumped whenever the calls change (cached inference results are then stale).
    """

    signature: SignatureEntry
    calls: list[CallEntry] = field(default_factory=list)
    store: TensorStore = field(default_factory=DictTensorStore)
    value_if_missing: list[MissingValueEntry] = field(default_factory=list)
    version: int = 0

    @property
    def ok_calls(self) -> list[CallEntry]:
        """The calls that returned normally; only they take part in inference and validation."""
        return [c for c in self.calls if c.status == "ok"]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.signature.parameters]

    @property
    def var_positional(self) -> tuple[str, int] | None:
        for i, p in enumerate(self.signature.parameters):
            if p.kind == "VAR_POSITIONAL":
                return p.name, i
        return None

    @property
    def var_keyword(self) -> str | None:
        for p in self.signature.parameters:
            if p.kind == "VAR_KEYWORD":
                return p.name
        return None

    @property
    def scalar_defaults(self) -> dict[str, Any]:
        return {
            p.name: p.default
            for p in self.signature.parameters
            if p.has_default and isinstance(p.default, (bool, int, float, str))
        }

    def parameter(self, name: str) -> ParameterEntry | None:
        return next((p for p in self.signature.parameters if p.name == name), None)

    def touch(self) -> None:
        """Invalidate cached inference results after the calls changed."""
        self.version += 1


def positional_names(signature: SignatureEntry) -> Sequence[str]:
    """Names that may be passed positionally, in order, stopping at ``*args``."""
    names = []
    for p in signature.parameters:
        if p.kind not in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            break
        names.append(p.name)
    return names
