"""The status of one checked call, in one wording for every renderer (terminal, md, html, json, csv).

``ok``; ``FAIL: <error>`` or ``FAIL: mismatch`` (a value out of tolerance); ``not checked
(absent at capture: <inputs>)`` when the call was fed a stand-in for an input it never received,
``not checked (<reason>)`` when it ran with nothing to compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["call_status", "row_status", "status_class"]


def call_status(success: bool | None, error: str | None, absent: str | None) -> str:
    """The status text of a call from its verdict (True, False, None: not checked), error and absent inputs."""
    if success is True:
        return "ok"
    if success is None:
        if not absent and error:  # e.g. a redacted bundle: the call ran, no recorded outputs to compare with
            return f"not checked ({error})"
        return f"not checked (absent at capture: {absent})" if absent else "not checked"
    return f"FAIL: {error}" if error else "FAIL: mismatch"


def row_status(row: Mapping[str, Any]) -> str:
    """:func:`call_status` of a row of ``check_discrepancies``, ``rerun_model`` or ``diff_bundles``."""
    return call_status(row.get("SUCCESS"), row.get("error") or None, row.get("absent_inputs") or None)


def status_class(status: str) -> str:
    """``ok``, ``FAIL`` or ``not checked``: what a status is, for colours and styles."""
    return "FAIL" if status.startswith("FAIL") else "not checked" if status.startswith("not checked") else "ok"
