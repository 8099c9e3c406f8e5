"""Per-call views over recorded calls (``observer.info``, ``bundle.info``): inputs, outputs, latencies."""

from __future__ import annotations

from typing import Any

import torch

from iobundle.calls import RecordedCalls, build_value, tensor_keys
from iobundle.schema import CallEntry

__all__ = ["ObservationInfo", "RecordedInputs"]


class RecordedInputs:
    """The inputs of one recorded call, as the model received them (absent ones filled by ``value_if_missing``)."""

    def __init__(self, rc: RecordedCalls, call: CallEntry) -> None:
        self._rc = rc
        self.call = call

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(build_value(a, self._rc.store.get, path=f"args[{i}]") for i, a in enumerate(self.call.args))

    @property
    def kwargs(self) -> dict[str, Any]:
        return {k: build_value(v, self._rc.store.get, path=k) for k, v in self.call.kwargs.items()}

    @property
    def cst_kwargs(self) -> dict[str, Any]:
        return dict(self.call.cst_kwargs)

    @property
    def flat_list(self) -> list[torch.Tensor]:
        keys = [k for a in self.call.args for k in tensor_keys(a)]
        keys += [k for v in self.call.kwargs.values() for k in tensor_keys(v)]
        return [self._rc.store.get(k) for k in keys]


class ObservationInfo:
    """Per-call records of the successful calls: ``inputs``, ``flat_outputs``, ``latencies``.

    ``calls`` lists every recorded call, failed ones included.
    """

    def __init__(self, rc: RecordedCalls) -> None:
        self._rc = rc

    def __len__(self) -> int:
        return len(self._rc.ok_calls)

    @property
    def calls(self) -> list[CallEntry]:
        return list(self._rc.calls)

    @property
    def inputs(self) -> list[RecordedInputs]:
        return [RecordedInputs(self._rc, c) for c in self._rc.ok_calls]

    @property
    def flat_outputs(self) -> list[list[torch.Tensor]]:
        return [[self._rc.store.get(k) for k in tensor_keys(c.outputs)] if c.outputs else [] for c in self._rc.ok_calls]

    @property
    def outputs(self) -> list[Any]:
        return [build_value(c.outputs, self._rc.store.get) if c.outputs else None for c in self._rc.ok_calls]

    @property
    def latencies(self) -> list[float]:
        return [c.latency or 0.0 for c in self._rc.ok_calls]
