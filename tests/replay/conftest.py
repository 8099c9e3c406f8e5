from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for the plain helper module observing.py beside the tests

pytest.importorskip("onnxruntime")


@pytest.fixture(params=["memory", "reloaded"])
def where(request: pytest.FixtureRequest) -> str:
    """Run a test on the observer in memory and on its bundle reloaded (see ``observing.source``)."""
    return str(request.param)
