"""One wording of a call's status and one formatter of sizes and latencies, shared by every renderer."""

from __future__ import annotations

import math

import pytest

from iobundle._status import call_status, row_status, status_class
from iobundle._units import format_calls, format_latency, format_size


@pytest.mark.parametrize(
    ("success", "error", "absent", "text", "kind"),
    [
        (True, None, None, "ok", "ok"),
        (False, None, None, "FAIL: mismatch", "FAIL"),
        (False, "onnxruntime: bad input", None, "FAIL: onnxruntime: bad input", "FAIL"),
        (None, None, "mask", "not checked (absent at capture: mask)", "not checked"),
        (None, "ran; no recorded outputs to compare with", None, "not checked (ran; no recorded outputs to compare with)", "not checked"),
    ],
)  # fmt: skip
def test_call_status_has_one_wording(success, error, absent, text, kind):
    assert call_status(success, error, absent) == text
    assert row_status({"SUCCESS": success, "error": error or "", "absent_inputs": absent or ""}) == text
    assert status_class(text) == kind


def test_sizes_and_latencies_have_one_formatter():
    assert [format_size(n) for n in (512, 1536, 12 * 2**20, 3 * 2**30)] == ["512 B", "1.5 KiB", "12.0 MiB", "3.0 GiB"]
    assert [format_latency(s) for s in (0.000179, 0.0123, 0.237)] == ["0.179 ms", "12.3 ms", "237 ms"]
    assert format_latency(None) == "-" and format_latency(math.nan, missing="") == ""


@pytest.mark.parametrize(
    ("indices", "text"),
    [([0], "call 0"), ([2, 1, 3], "calls 1-3"), ([0, 2, 4, 5, 6], "calls 0, 2, 4-6"), ([3, 7], "calls 3, 7")],
)
def test_call_lists_have_one_formatter(indices, text):
    assert format_calls(indices) == text
