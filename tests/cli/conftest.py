"""Shared by the CLI tests: running ``iobundle`` on a pseudo-terminal, as a user's shell does."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RunInTerminal = Callable[[list[str], Path, dict[str, str]], str]


def run_in_terminal(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run ``iobundle ARGV`` with stdout and stderr on a pseudo-terminal; return what it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iobundle", *argv], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
        cwd=cwd, env=env,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture
def terminal() -> RunInTerminal:
    """:func:`run_in_terminal`, for tests that check what a terminal shows (colour, progress bars)."""
    return run_in_terminal
