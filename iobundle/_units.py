"""How every renderer writes a size in bytes and a latency: one formatter each."""

from __future__ import annotations

import math

__all__ = ["format_latency", "format_size"]


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
