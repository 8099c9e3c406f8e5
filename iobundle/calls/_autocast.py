"""``torch.autocast`` at a recorded call: what capture reads, and the context replay runs the model under.

A model observed under ``torch.autocast("cuda", dtype=torch.bfloat16)`` keeps float32 weights,
but its matmuls ran in bfloat16: the recorded outputs (and a cache built from them) carry that
precision, some of them in a float32 tensor. Replaying the model without autocast computes
something else. Capture therefore records, per call, the autocast state of every device type
where it is enabled, plus ``"cpu"`` (:func:`autocast_state`); replay runs the eager model and
traces the program under the same autocast (:class:`ReplayAutocast`). A bundle recorded on a GPU
box is replayed where the model is: autocast of ``"cuda"`` becomes autocast of ``"cpu"`` with the
same dtype on a CPU machine, and :meth:`ReplayAutocast.describe` says so.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iobundle.calls._dtypes import DTYPE_TO_NAME, NAME_TO_DTYPE
from iobundle.schema import AutocastEntry

if TYPE_CHECKING:
    import torch

__all__ = ["AUTOCAST_DEVICE_TYPES", "ReplayAutocast", "autocast_state", "module_device_type", "replay_autocast"]

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""The device types whose autocast state capture reads at each recorded call."""


def autocast_state() -> list[AutocastEntry] | None:
    """The ``torch.autocast`` state now: one entry per enabled device type, plus ``"cpu"``; None if none is enabled.

    Called at each recorded call, on the caller's thread (autocast is thread-local), before the
    observed method runs. A few microseconds.
    """
    import torch

    enabled = [d for d in AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(d)]
    if not enabled:
        return None
    entries = []
    for device_type in AUTOCAST_DEVICE_TYPES:
        if device_type in enabled or device_type == "cpu":
            name = DTYPE_TO_NAME.get(torch.get_autocast_dtype(device_type), "BF16")
            entries.append(AutocastEntry(device_type=device_type, dtype=name, enabled=device_type in enabled))
    return entries


@dataclass(frozen=True)
class ReplayAutocast:
    """The autocast replay runs a recorded call under: ``recorded`` as captured, on ``device_type``."""

    recorded: AutocastEntry
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return NAME_TO_DTYPE[self.recorded.dtype]

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"``, ``"float16"``: the dtype as torch spells it."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def mapped(self) -> bool:
        """Whether the recorded device type differs from the one replay runs on (``"cuda"`` run as ``"cpu"``)."""
        return self.recorded.device_type != self.device_type

    def describe(self) -> str:
        """One line for reports: ``torch.autocast('cpu', bfloat16) (recorded under 'cuda', mapped to 'cpu')``."""
        text = f"torch.autocast({self.device_type!r}, {self.dtype_name})"
        if self.mapped:
            text += f" (recorded under {self.recorded.device_type!r}, mapped to {self.device_type!r})"
        return text

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Enter ``torch.autocast(device_type, dtype)``."""
        import torch

        with torch.autocast(self.device_type, dtype=self.dtype):
            yield


def replay_autocast(state: Sequence[AutocastEntry] | None, device_type: str = "cpu") -> ReplayAutocast | None:
    """The autocast to replay a call recorded under ``state`` with, on ``device_type``; None without autocast.

    The enabled entry of ``device_type`` itself when there is one; else the first enabled entry of
    another device type, mapped to ``device_type`` with its dtype (a GPU capture replayed on a CPU).
    """
    enabled = [e for e in state or () if e.enabled]
    if not enabled:
        return None
    same = [e for e in enabled if e.device_type == device_type]
    return ReplayAutocast((same or enabled)[0], device_type)


def module_device_type(module: torch.nn.Module) -> str:
    """Where ``module`` runs: the device type of its first parameter or buffer, ``"cpu"`` without any."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device.type
    return "cpu"
