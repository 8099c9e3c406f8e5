"""The exit codes of the ``iobundle`` command (:func:`iobundle.cli.main` returns one)."""

from __future__ import annotations

__all__ = ["EXIT_CHECK_FAILED", "EXIT_FAILED", "EXIT_NOTHING_TO_COMPARE", "EXIT_OK", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
"""A check the user asked for failed: a corrupt file (verify), outputs that differ (validate)."""
EXIT_USAGE = 2
"""Bad command line, or a path that is not a readable bundle (argparse also exits with 2)."""
EXIT_FAILED = 3
"""The bundle was read but the operation failed: calls that cannot be aligned, an export error, ..."""
EXIT_NOTHING_TO_COMPARE = 4
"""validate, run: the bundle holds no recorded outputs (redacted without them); diff: a bundle holds no calls."""
