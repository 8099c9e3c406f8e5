"""Delta storage: a tensor that extends one already stored is stored as its new part only.

A growing KV cache (``DynamicCache`` builds each call's cache with ``torch.cat``), an attention
mask or a ``cache_position`` that grows by one position per call: call k+1's tensor is call k's
plus new positions along one dimension. :class:`DeltaIndex` finds such a base among the tensors
written recently (same dtype, device and shape but for one dimension, where the base is shorter)
and checks **byte for byte** that the leading part is the base (floats compared as integers of
the same width, so -0.0, NaN payloads and every bit count). Nothing is assumed: a cache that
beam search reordered, a sliding window that rolled, a ``StaticCache`` written in place or a
cache shortened by ``crop()`` fails the check and is stored whole. CUDA tensors are compared on
their device, and only the new part is then copied to the host.

:func:`rebuild` reads such a tensor back: the chain of parts, concatenated once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iobundle._lazy import LazyMapping, lazy_module
from iobundle.calls._tensorfile_write import raw_bytes

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

__all__ = ["DeltaIndex", "Match", "extends_bytes", "rebuild"]

RETAIN_BYTES = 256 * 1024
"""While streaming, tensors below this size are kept (referenced) as possible bases for the next
call; larger ones only once their shape was seen to grow (a large tensor that never grows is
never held back from the buffer pool)."""

MAX_CANDIDATES = 64
"""Bases tried per tensor (most recent first); each costs a one-position comparison, the one that
passes a full comparison."""

MAX_DEPTH = 50_000
"""The writer stores a tensor whole rather than make a chain of extensions longer than this
(the reader refuses chains over ``iobundle.schema.MAX_EXTENSION_DEPTH``)."""

SMALL_COMPARE_BYTES = 256 * 1024
"""CPU tensors up to this size are compared as bytes in Python (the calling thread keeps the GIL);
larger ones, and CUDA tensors, with ``torch.equal`` (which releases it while it runs)."""

_MAX_ROWS = 64  # a bytes comparison of more rows than this is left to torch.equal


def _as_bits_table() -> dict[torch.dtype, torch.dtype]:
    """Each dtype compared bit for bit, and the integer dtype of its width."""
    same_width_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    dtypes = (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
        torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)),
    )  # fmt: skip
    return {dtype: same_width_int[dtype.itemsize] for dtype in dtypes}


_AS_BITS: LazyMapping[torch.dtype, torch.dtype] = LazyMapping(_as_bits_table)


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as integers of the same width (bit-exact comparison), or None if impossible."""
    target = _AS_BITS.get(t.dtype)
    if target is None:
        return None  # complex: no integer of the same width
    if t.dtype == target:
        return t
    try:
        return t.view(target)
    except RuntimeError:
        return None


def extends_bytes(tensor: torch.Tensor, base: torch.Tensor, dim: int) -> bool:
    """Whether ``tensor``'s first ``base.shape[dim]`` positions along ``dim`` are ``base``, bit for bit."""
    if (
        tensor.dtype != base.dtype
        or tensor.device != base.device
        or tensor.dim() != base.dim()
        or not 0 <= dim < tensor.dim()
    ):
        return False
    n = base.shape[dim]
    if any((b > s) if d == dim else (b != s) for d, (b, s) in enumerate(zip(base.shape, tensor.shape))):
        return False
    if n == 0:
        return _bits(tensor) is not None and _bits(base) is not None
    same = _extends_cpu(tensor, base, dim)
    if same is not None:
        return same
    a, b = _bits(tensor), _bits(base)
    if a is None or b is None:
        return False
    # one position first: two different tensors almost always differ there, and it is cheap
    if not torch.equal(a.narrow(dim, n - 1, 1), b.narrow(dim, n - 1, 1)):
        return False
    return torch.equal(a.narrow(dim, 0, n), b)


def _extends_cpu(tensor: torch.Tensor, base: torch.Tensor, dim: int) -> bool | None:
    """:func:`extends_bytes` for small contiguous CPU tensors, on their bytes; None when it does not apply.

    Both tensors have the same dtype and agree on every dimension but ``dim``, where ``base`` is
    not longer: along ``dim`` each of the ``prod(shape[:dim])`` rows of ``tensor`` must start with the
    matching row of ``base``.
    """
    if base.dtype not in _AS_BITS or base.numel() * base.element_size() > SMALL_COMPARE_BYTES:
        return None
    a, b = raw_bytes(tensor), raw_bytes(base)
    if a is None or b is None:
        return None
    rows = math.prod(tensor.shape[:dim])
    if rows > _MAX_ROWS:
        return None
    if rows == 0:
        return True
    new_row = len(a) // rows
    old_row = len(b) // rows
    if rows == 1:
        return a[:old_row].tobytes() == b.tobytes()  # bytes compare with memcmp; memoryviews item by item
    old = b.tobytes()
    for r in range(rows):
        if a[r * new_row : r * new_row + old_row].tobytes() != old[r * old_row : (r + 1) * old_row]:
            return False
    return True


@dataclass(frozen=True)
class Match:
    """``key`` is the tensor extended along ``dim``; ``new`` is the part to store."""

    key: str
    dim: int
    new: torch.Tensor


@dataclass
class _Head:
    key: str
    tensor: torch.Tensor
    version: int
    depth: int
    generation: int
    signatures: list[tuple[object, ...]]


def _signatures(t: torch.Tensor) -> list[tuple[object, ...]]:
    """Per dimension d: what another tensor must share with ``t`` to extend it (or be extended) along d."""
    shape = tuple(t.shape)
    head = (t.dtype, t.device, len(shape))
    return [(*head, d, shape[:d] + shape[d + 1 :]) for d in range(len(shape))]


class DeltaIndex:
    """Recently written tensors that a new tensor may extend, with their chain depth.

    Args:
        retain_all: Keep every written tensor as a possible base (the tensors are held in memory
            anyway, as when saving an in-memory recording). Otherwise (streaming) only small
            tensors and those whose shape was seen growing are referenced.
    """

    def __init__(self, *, retain_all: bool = False) -> None:
        self.retain_all = retain_all
        self.generation = 0
        self.depth: dict[str, int] = {}
        self.retained: set[str] = set()
        """Keys whose tensors this index references: their memory must not be recycled."""
        self._heads: dict[str, _Head] = {}
        self._by_signature: dict[tuple[object, ...], list[str]] = {}
        self._shortest: dict[tuple[object, ...], int] = {}  # signature -> no key of it is shorter along its dim
        self._lengths: dict[tuple[object, ...], tuple[int, int]] = {}  # signature -> (longest, generation)
        self._growing: set[tuple[object, ...]] = set()
        self._last: tuple[torch.Tensor, list[tuple[object, ...]]] | None = None  # find's signatures, for add
        self._cursor: dict[tuple[object, ...], int] = {}  # signature -> where its next match is likely, this call
        self._added: dict[tuple[object, ...], int] = {}  # signature -> keys of it this call added
        self._longest: dict[tuple[object, ...], tuple[int, str]] = {}  # signature -> its longest key this call added

    def find(self, tensor: torch.Tensor) -> Match | None:
        """A recent tensor that ``tensor`` extends (checked byte for byte), or None."""
        if tensor.dim() == 0 or tensor.dtype not in _AS_BITS or not self._by_signature:
            return None
        tried = 0
        signatures = _signatures(tensor)
        self._last = (tensor, signatures)
        for dim, sig in enumerate(signatures):
            keys = self._by_signature.get(sig)
            if not keys or self._shortest[sig] >= tensor.shape[dim]:
                continue  # none is shorter along dim (a cache's other dimensions: every layer alike)
            # The most recent first: the longest base (the last call's layer, not an older one it extends
            # too). Once a tensor of this signature matched in this call, the next one most often extends
            # the key after that match (the next layer of a cache): that one first; before any matched, the
            # first of the longest keys the last call added (its first layer).
            hint = self._cursor.get(sig)
            first = [hint] if hint is not None and hint < len(keys) else []
            for i in itertools.chain(first, (i for i in range(len(keys) - 1, -1, -1) if i != hint)):
                key = keys[i]
                head = self._heads.get(key)
                if head is None or head.tensor.shape[dim] >= tensor.shape[dim] or head.depth >= MAX_DEPTH:
                    continue
                if head.tensor._version != head.version:
                    continue  # changed in place since it was written: it no longer is what the file holds
                tried += 1
                if extends_bytes(tensor, head.tensor, dim):
                    self._cursor[sig] = i + 1
                    n = head.tensor.shape[dim]
                    return Match(key=key, dim=dim, new=tensor.narrow(dim, n, tensor.shape[dim] - n))
                if tried >= MAX_CANDIDATES:
                    return None
        return None

    def should_retain(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor about to be written is kept as a possible base (see ``retain_all``)."""
        if self.retain_all or tensor.numel() * tensor.element_size() < RETAIN_BYTES:
            return True
        return any(sig in self._growing for sig in _signatures(tensor))

    def add(self, key: str, tensor: torch.Tensor, *, base: str | None, retain: bool) -> None:
        """Record that ``key`` was written (extending ``base``, or whole); keep it as a base if ``retain``."""
        self.depth[key] = 0 if base is None else self.depth.get(base, 0) + 1
        last, self._last = self._last, None
        signatures = last[1] if last is not None and last[0] is tensor else _signatures(tensor)
        if not self.retain_all:  # which shapes grow: only large tensors of those are kept while streaming
            for d, sig in enumerate(signatures):
                longest = self._lengths.get(sig)
                if longest is not None and tensor.shape[d] > longest[0]:
                    self._growing.add(sig)
                self._lengths[sig] = (max(tensor.shape[d], longest[0] if longest else 0), self.generation)
        if not retain or tensor.dim() == 0 or tensor.dtype not in _AS_BITS:
            return
        self._heads[key] = _Head(key, tensor, tensor._version, self.depth[key], self.generation, signatures)
        self.retained.add(key)
        added, first_longest = self._added, self._longest
        for d, sig in enumerate(signatures):
            n = tensor.shape[d]
            self._by_signature.setdefault(sig, []).append(key)
            self._shortest[sig] = min(self._shortest.get(sig, n), n)
            added[sig] = added.get(sig, 0) + 1
            if n > first_longest.get(sig, (-1, ""))[0]:
                first_longest[sig] = (n, key)

    def touch(self, keys: Sequence[str]) -> None:
        """``keys`` were used by the call being written: their heads stay candidates for the next call."""
        for key in keys:
            head = self._heads.get(key)
            if head is not None:
                head.generation = self.generation

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` could not be written after all: they are no base for anything."""
        for key in keys:
            self.depth.pop(key, None)
            self._drop(key)

    def _drop(self, key: str) -> None:
        head = self._heads.pop(key, None)
        self.retained.discard(key)
        if head is None:
            return
        for sig in head.signatures:
            keys = self._by_signature.get(sig)
            if keys is not None and key in keys:
                keys.remove(key)
                if not keys:
                    del self._by_signature[sig]
                    del self._shortest[sig]

    def end_call(self) -> None:
        """A call is written: drop the bases the next call cannot use (older than this call)."""
        if not self.retain_all:
            for key in [k for k, h in self._heads.items() if h.generation < self.generation]:
                self._drop(key)
            stale = [s for s, (_, g) in self._lengths.items() if g < self.generation - 1]
            for sig in stale:
                del self._lengths[sig]
        # The next call most often writes its tensors in this call's order (a cache's layers): its first tensor
        # of a signature most likely extends the first of the longest this call added (its first layer).
        self._cursor = {}
        for sig, (_, key) in self._longest.items():
            keys = self._by_signature.get(sig)
            if keys:
                with contextlib.suppress(ValueError):  # dropped since (a key that could not be written)
                    self._cursor[sig] = keys.index(key, max(0, len(keys) - self._added[sig]))
        self._added, self._longest = {}, {}
        self.generation += 1


def rebuild(root: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """``root`` extended by each ``(part, dim)`` in order: one concatenation per run of the same dim."""
    out = root
    i = 0
    while i < len(parts):
        dim = parts[i][1]
        j = i
        while j < len(parts) and parts[j][1] == dim:
            j += 1
        out = torch.cat([out, *(p for p, _ in parts[i:j])], dim=dim)
        i = j
    return out if parts else root
