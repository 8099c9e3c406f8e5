"""A type checker reads the public face as it runs: the tolerance keywords are parameters it knows.

`make test` runs mypy over ``iobundle/`` first (pyproject.toml, ``[tool.mypy]``); this test runs it on
code a user writes, with the cache that run left (``.mypy_cache``), so that it takes seconds there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

USER_CODE = """
import torch

import iobundle
from iobundle.replay import Tolerances, diff_bundles

bundle = iobundle.load_bundle("run.iobundle")
report = bundle.validate("model.onnx", atol=1e-3, output_atol={"logits": 1e-2}, check_error_stat="median")
rows = bundle.check_discrepancies("model.onnx", 1e-3, 0.1, include_io=False)
result = bundle.export(torch.nn.Linear(2, 2), rtol=0.2, tolerances=Tolerances.build(1e-3))
diff = diff_bundles("a.iobundle", bundle, error_quantile=0.9)
ok: bool = report.ok and diff.ok
"""


def _mypy(code: str) -> tuple[str, int]:
    api = pytest.importorskip("mypy.api")
    stdout, stderr, status = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"), "-c", code]
    )
    return stdout + stderr, status


@pytest.mark.slow
def test_a_checker_accepts_the_tolerance_keywords_and_refuses_wrong_ones():
    output, status = _mypy(USER_CODE)
    assert status == 0, output
    output, status = _mypy(USER_CODE.replace("atol=1e-3", 'atol="1e-3"').replace("error_quantile", "error_quantil"))
    assert status == 1, output
    assert 'Argument "atol" to "validate" of "RecordedCallsAPI" has incompatible type "str"' in output, output
    assert 'Unexpected keyword argument "error_quantil" for "diff_bundles"' in output, output
