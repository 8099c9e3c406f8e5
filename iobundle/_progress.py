"""Progress of long operations, reported through callbacks: the library never draws, the CLI does.

Every long operation (export of several programs, validation of many calls, diff, re-run, pack,
unpack, convert, redact) takes ``on_progress: Callable[[ProgressEvent], None] | None``. It is
called once with ``done=0`` when a task starts (``total`` known, or None), then after each step.
Steps are counted in calls or programs, or in bytes (``unit="bytes"``) where the work is copying
files: then ``done`` is the bytes copied so far and ``total`` the bytes in all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BYTES", "ProgressCallback", "ProgressEvent", "notify"]

BYTES = "bytes"
"""The ``unit`` of a task counted in bytes."""


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a long operation.

    Attributes:
        task: What runs, in a few words (``"validate"``, ``"check exported program"``, ``"torch.export"``).
        done: Steps finished so far (0 when the task starts).
        total: Steps in all, or None when unknown.
        detail: The step just finished, e.g. ``"call 3"``.
        unit: What ``done`` and ``total`` count: ``""`` for steps (calls, programs), ``"bytes"``.

    Example:
        A simple progress line::

            def show(event: ProgressEvent) -> None:
                print(f"\\r{event.task}: {event.done}/{event.total}", end="", flush=True)

            load_bundle("run.iobundle").check_discrepancies("model.onnx", on_progress=show)
    """

    task: str
    done: int
    total: int | None = None
    detail: str = ""
    unit: str = ""


ProgressCallback = Callable[[ProgressEvent], None]


def notify(
    callback: ProgressCallback | None, task: str, done: int, total: int | None, detail: str = "", *, unit: str = ""
) -> None:
    """Call ``callback`` with a :class:`ProgressEvent` when there is one."""
    if callback is not None:
        callback(ProgressEvent(task=task, done=done, total=total, detail=detail, unit=unit))
