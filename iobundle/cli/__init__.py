"""The ``iobundle`` command line: ``iobundle inspect | shapes | verify ...``. Imports no torch until a command runs."""

from __future__ import annotations

__all__ = ["main"]

from iobundle.cli._main import main
