"""How every renderer writes a size in bytes, a latency and a list of call indices: one formatter each."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["format_calls", "format_latency", "format_size"]


def format_size(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``3.2 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_latency(seconds: float | None, missing: str = "-") -> str:
    """Milliseconds with three significant digits or so: ``0.179 ms``, ``12.3 ms``; ``missing`` for None or NaN."""
    if seconds is None or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return missing
    ms = seconds * 1000.0
    digits = 3 if ms < 1 else 2 if ms < 10 else 1 if ms < 100 else 0
    return f"{ms:.{digits}f} ms"


def format_calls(indices: Iterable[int]) -> str:
    """``call 0``, ``calls 1-3``, ``calls 0, 2, 4-6``: call indices, runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"call{'s' if sum(map(len, runs)) > 1 else ''} {text}"
