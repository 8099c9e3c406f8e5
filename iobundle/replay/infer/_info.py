"""Per-call views over recorded calls (``observer.info``, ``bundle.info``): inputs, outputs, latencies.

``info.inputs[i]`` is an :class:`InputCandidate`, named and shaped like the per-call record of
the observers iobundle replaces (``args``, ``kwargs``, ``cst_kwargs``, ``flat_list``,
``aligned_flat_list``, ``n_aligned_tensors``, ``str_obs()``), for an observer in memory and a
bundle loaded from disk alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls import RecordedCalls, build_value, tensor_keys
from iobundle.errors import AlignmentError
from iobundle.replay.infer import _align
from iobundle.schema import CallEntry

if TYPE_CHECKING:
    import torch
    import torch.utils._pytree as torch_pytree
else:
    torch = lazy_module("torch", globals())
    torch_pytree = lazy_module("torch.utils._pytree", globals(), "torch_pytree")

__all__ = ["InputCandidate", "ObservationInfo"]


class _AlignmentCache:
    """The alignment of ``rc``'s calls, computed once per version of the calls (or the reason it fails)."""

    def __init__(self, rc: RecordedCalls) -> None:
        self.rc = rc
        self._version = -1
        self._result: _align.Alignment | AlignmentError | None = None

    def get(self) -> _align.Alignment | AlignmentError:
        if self._result is None or self._version != self.rc.version:
            try:
                self._result = _align.align_calls(self.rc)
            except AlignmentError as exc:
                self._result = exc
            self._version = self.rc.version
        return self._result


class InputCandidate:
    """The inputs of one call: as recorded (``observer.info.inputs[i]``), or given to build one.

    A recorded candidate reads its tensors from the observer's memory or the bundle's files;
    absent arguments filled by ``value_if_missing`` appear as the placeholders. Built from
    values (``InputCandidate(args, kwargs)``), it holds them, as the observers iobundle
    replaces do; ``infer_arguments`` accepts either kind.

    Attributes:
        cst_kwargs: Keyword constants of the call (scalars that differ from their default).

    Args:
        args: Positional inputs.
        kwargs: Keyword inputs (tensors or nested structures).
        clone: Copy the tensors (the caller may modify its own in place later).
        cst_kwargs: Keyword constants (int, float, bool, str).
    """

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        clone: bool = False,
        cst_kwargs: dict[str, int | float | bool | str] | None = None,
    ) -> None:
        self._rc: RecordedCalls | None = None
        self._call: CallEntry | None = None
        self._alignment: _AlignmentCache | None = None
        self._position = -1
        if clone:
            args, kwargs = torch_pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (tuple(args), kwargs))
        self._args = tuple(args)
        self._kwargs = dict(kwargs)
        self.cst_kwargs: dict[str, Any] = dict(cst_kwargs or {})

    @classmethod
    def _from_call(
        cls, rc: RecordedCalls, call: CallEntry, position: int, alignment: _AlignmentCache
    ) -> InputCandidate:
        self = cls.__new__(cls)
        self._rc, self._call, self._alignment, self._position = rc, call, alignment, position
        self._args, self._kwargs = (), {}
        self.cst_kwargs = dict(call.cst_kwargs)
        return self

    @property
    def call(self) -> CallEntry | None:
        """The manifest entry of a recorded candidate (index, tree, status, latency); None for a built one."""
        return self._call

    @property
    def args(self) -> tuple[Any, ...]:
        """The positional inputs, rebuilt (caches as transformers objects)."""
        if self._call is None:
            return self._args
        rc = self._rc
        assert rc is not None
        return tuple(build_value(a, rc.store.get, path=f"args[{i}]") for i, a in enumerate(self._call.args))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword inputs that are not constants, rebuilt, in signature order."""
        if self._call is None:
            return dict(self._kwargs)
        rc = self._rc
        assert rc is not None
        return {k: build_value(v, rc.store.get, path=k) for k, v in self._call.kwargs.items()}

    def _owned_keys(self) -> list[tuple[int | str, str]]:
        call = self._call
        assert call is not None
        pairs: list[tuple[int | str, str]] = [(i, k) for i, a in enumerate(call.args) for k in tensor_keys(a)]
        pairs += [(name, k) for name, v in call.kwargs.items() for k in tensor_keys(v)]
        return pairs

    @property
    def flat_list(self) -> list[torch.Tensor]:
        """The tensors of the call, flattened (positional first, then keywords)."""
        if self._call is None:
            return [t for t in torch_pytree.tree_leaves((self._args, self._kwargs)) if isinstance(t, torch.Tensor)]
        rc = self._rc
        assert rc is not None
        return [rc.store.get(k) for _, k in self._owned_keys()]

    @property
    def position_to_args_kwargs(self) -> list[int | str]:
        """For each tensor of :attr:`flat_list`, the position or name of the argument holding it."""
        if self._call is None:
            owners: list[int | str] = []
            for i, a in enumerate(self._args):
                owners += [i] * _n_tensors(a)
            for name, v in self._kwargs.items():
                owners += [name] * _n_tensors(v)
            return owners
        return [owner for owner, _ in self._owned_keys()]

    @property
    def n_tensors_for_args_kwargs(self) -> dict[int | str, int]:
        """The number of tensors of each argument, by position or name."""
        counts: dict[int | str, int] = {}
        if self._call is None:
            counts.update({i: _n_tensors(a) for i, a in enumerate(self._args)})
            counts.update({k: _n_tensors(v) for k, v in self._kwargs.items()})
            return counts
        counts.update({i: len(tensor_keys(a)) for i, a in enumerate(self._call.args)})
        counts.update({k: len(tensor_keys(v)) for k, v in self._call.kwargs.items()})
        return counts

    def _aligned_slots(self) -> list[str | None] | AlignmentError:
        if self._alignment is None:
            return AlignmentError(
                "it was built from values, not recorded. Pass it to infer_arguments() to lay it out like "
                "the recorded calls."
            )
        alignment = self._alignment.get()
        if isinstance(alignment, AlignmentError):
            return alignment
        return alignment.slots[self._position]

    @property
    def aligned_flat_list(self) -> list[torch.Tensor | None] | None:
        """The call laid out like every recorded call: one entry per tensor slot, None where absent.

        None when the calls cannot be aligned (:attr:`n_aligned_tensors` says why), or for a
        candidate built from values.
        """
        slots = self._aligned_slots()
        if isinstance(slots, AlignmentError):
            return None
        rc = self._rc
        assert rc is not None
        return [None if key is None else rc.store.get(key) for key in slots]

    @property
    def n_aligned_tensors(self) -> int:
        """The number of tensor slots once aligned.

        Raises:
            AlignmentError: The input is not aligned with the others (the message says why).
        """
        slots = self._aligned_slots()
        if isinstance(slots, AlignmentError):
            raise AlignmentError(f"This input was not aligned with the others: {slots}") from slots
        return len(slots)

    def __len__(self) -> int:
        """The number of tensors of the call."""
        return len(self.flat_list)

    def __str__(self) -> str:
        aligned = self.aligned_flat_list
        n_args = len(self._call.args) if self._call is not None else len(self._args)
        n_kwargs = len(self._call.kwargs) if self._call is not None else len(self._kwargs)
        return (
            f"InputCandidate({n_args} args, {n_kwargs} kwargs, {len(self)} tensors, "
            f"{len(aligned or [])} aligned tensors)"
        )

    def str_obs(self) -> str:
        """One line describing the call: its inputs with dtypes and shapes, and its constants."""
        return (
            f"InputCandidate(args={_describe(self.args)}, kwargs={_describe(self.kwargs)}, "
            f"cst_kwargs={self.cst_kwargs})"
        )


def _n_tensors(value: Any) -> int:
    return sum(isinstance(t, torch.Tensor) for t in torch_pytree.tree_leaves(value))


def _describe(value: Any) -> str:
    """``float32[2,3]`` for a tensor, containers recursively, other classes by name and children."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(str(s) for s in value.shape)}]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    tensors = [t for t in torch_pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    if tensors:
        return f"{type(value).__name__}(" + ", ".join(_describe(t) for t in tensors) + ")"
    return type(value).__name__


class ObservationInfo:
    """Per-call records of the successful calls: ``inputs``, ``flat_outputs``, ``latencies``.

    ``calls`` lists every recorded call, failed ones included.
    """

    def __init__(self, rc: RecordedCalls) -> None:
        self._rc = rc
        self._alignment = _AlignmentCache(rc)

    def __len__(self) -> int:
        return len(self._rc.ok_calls)

    @property
    def calls(self) -> list[CallEntry]:
        return list(self._rc.calls)

    @property
    def inputs(self) -> list[InputCandidate]:
        """One :class:`InputCandidate` per successful call, in recording order."""
        return [InputCandidate._from_call(self._rc, c, i, self._alignment) for i, c in enumerate(self._rc.ok_calls)]

    @property
    def flat_outputs(self) -> list[list[torch.Tensor]]:
        return [[self._rc.store.get(k) for k in tensor_keys(c.outputs)] if c.outputs else [] for c in self._rc.ok_calls]

    @property
    def outputs(self) -> list[Any]:
        return [build_value(c.outputs, self._rc.store.get) if c.outputs else None for c in self._rc.ok_calls]

    @property
    def latencies(self) -> list[float]:
        return [c.latency or 0.0 for c in self._rc.ok_calls]
