"""The command's logging: iobundle's loggers on stderr at the level -v/-q ask for, third-party noise kept off.

Without ``-v``, the warnings and log lines of the libraries iobundle drives (torch's logging
lines, its error lines with a traceback of a failed trace, deprecation notices, onnxscript's
chatter) do not reach stderr: iobundle says what failed in its own error line, and its own
warnings always show. torch resets its loggers when it is imported, which the
commands do late (``iobundle --help`` never loads it): :func:`silence_libraries` is called again
once it is loaded (when a bundle is opened, when a progress bar starts).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from iobundle.cli._render import PlainLogFormatter

__all__ = ["THIRD_PARTY_LOGGERS", "configure_logging", "silence_libraries"]

THIRD_PARTY_LOGGERS = ("torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime", "transformers", "fsspec")
"""Loggers of the libraries iobundle drives: their lines (but CRITICAL ones) reach stderr with -v only."""

_silenced: list[tuple[logging.Logger, int]] | None = None
"""While a command runs without -v: the loggers set to CRITICAL and their previous levels; None otherwise."""


class _CLILogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current ``sys.stderr`` (which tests replace) in ``LEVEL name: message`` form."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(PlainLogFormatter("%(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def silence_libraries() -> None:
    """Set the third-party loggers to CRITICAL again (a no-op with -v, or outside a command)."""
    if _silenced is None:
        return
    for name in THIRD_PARTY_LOGGERS:
        lg = logging.getLogger(name)
        if lg.level != logging.CRITICAL:
            _silenced.append((lg, lg.level))
            lg.setLevel(logging.CRITICAL)


@contextlib.contextmanager
def configure_logging(verbose: int, quiet: int) -> Iterator[int]:
    """Send the ``iobundle`` loggers to stderr at the level -v/-q ask for; undo it all on exit (main() may run again)."""
    global _silenced
    level = min(max(logging.WARNING - 10 * verbose + 10 * quiet, logging.DEBUG), logging.CRITICAL)
    package_logger = logging.getLogger("iobundle")
    handler, previous = _CLILogHandler(), package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    _silenced = [] if verbose <= 0 else None
    silence_libraries()
    try:
        with warnings.catch_warnings():
            if verbose <= 0:
                warnings.filterwarnings("ignore")
                warnings.filterwarnings("default", module=r"iobundle(\.|$)")
            yield level
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous)
        for lg, lvl in reversed(_silenced or []):
            lg.setLevel(lvl)
        _silenced = None
