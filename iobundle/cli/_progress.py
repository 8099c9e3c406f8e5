"""Progress bars for the command line, drawn by rich on stderr from the library's ``on_progress`` events.

Bars show only when stderr is a terminal and ``-q`` was not given; otherwise each finished task is
a debug log line. rich is imported when the first bar is drawn. A task counted in bytes
(``unit="bytes"``: pack, unpack, verify) shows sizes and speed instead of ``done/total``.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

from iobundle.cli._render import _isatty, color_enabled

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

    def __init__(self, *, enabled: bool = True) -> None:
        self._enabled = enabled and _isatty(sys.stderr)
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> ProgressBars:
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
            TextColumn("{task.description}"), BarColumn(), CountColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"), console=console, transient=True,
        )  # fmt: skip
        progress.start()
        return progress

    def __call__(self, event: ProgressEvent) -> None:
        if event.total is not None and event.done >= event.total:
            logger.debug("%s: %d/%d done", event.task, event.done, event.total)
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
