"""Progress bars for the command line, drawn by rich on stderr from the library's ``on_progress`` events.

Bars show only when stderr is a terminal and ``-q`` was not given; otherwise each finished task is
a debug log line. rich is imported when the first bar is drawn; a spinner and the elapsed time
keep moving during a step that reports no progress of its own (``torch.onnx.export``). A task
counted in bytes (``unit="bytes"``: pack, unpack, verify) shows sizes and speed instead of
``done/total``. With ``stages=True`` (export) each task's line is printed on stdout, flushed, when
it ends, on a terminal or a pipe alike: an interrupted command keeps the steps it finished.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from iobundle.cli._logs import silence_libraries
from iobundle.cli._render import _isatty, color_enabled, out

if TYPE_CHECKING:
    from iobundle.replay import ProgressEvent

__all__ = ["ProgressBars"]

logger = logging.getLogger(__name__)


class ProgressBars:
    """A context manager whose instance is an ``on_progress`` callback: one bar per task.

    Example:
        >>> with ProgressBars(enabled=True) as bars:
        ...     bundle.check_discrepancies("model.onnx", on_progress=bars)
    """

    def __init__(self, *, enabled: bool = True, stages: bool = False) -> None:
        self._enabled = enabled and _isatty(sys.stderr)
        self._stages = stages
        self._started: dict[str, float] = {}
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> ProgressBars:
        silence_libraries()  # the long steps load torch and onnx, which reset their loggers
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _start(self) -> Any:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        class CountColumn(ProgressColumn):
            """``done/total`` for steps; sizes and speed for bytes."""

            def __init__(self) -> None:
                super().__init__()
                self._steps = MofNCompleteColumn()
                self._bytes = DownloadColumn()
                self._speed = TransferSpeedColumn()

            def render(self, task: Any) -> Any:
                if task.fields.get("unit") == "bytes":
                    return self._bytes.render(task) + " " + self._speed.render(task)
                return self._steps.render(task)

        color = color_enabled(sys.stderr)
        console = Console(file=sys.stderr, no_color=not color, highlight=False)
        progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), CountColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"), console=console, transient=True,
        )  # fmt: skip
        progress.start()
        return progress

    def __call__(self, event: ProgressEvent) -> None:
        now = time.perf_counter()
        started = self._started.setdefault(event.task, now)
        finished = event.total is not None and event.done >= event.total
        if finished:
            logger.debug("%s: %d/%d done", event.task, event.done, event.total)
            if self._stages:
                self._started.pop(event.task, None)
                count = "" if event.total == 1 else f" {event.done}/{event.total}"
                out(f"{event.task}:{count} done in {now - started:.2f}s")
        if not self._enabled:
            return
        if self._progress is None:
            self._progress = self._start()
        task = self._tasks.get(event.task)
        if task is None:
            task = self._tasks[event.task] = self._progress.add_task(
                event.task, total=event.total, detail="", unit=event.unit
            )
        self._progress.update(task, completed=event.done, total=event.total, detail=event.detail)
