"""The model zoo: every family captured from a real generate(), exported and validated from its bundle alone.

One test per entry of ``behaviours.ZOO``: the families of ``families.py``, then the cases of issue 28's
classes of model behaviour (``behaviours.py``: plain calls, and plain torch models exported with
``--model zoo_models:FACTORY``). The entries selected for a run are captured
in this process (tiny models, nothing downloaded), then each bundle is replayed through the
CLI in a fresh process per bundle (``iobundle export BUNDLE --from-bundle --batch-all`` checks
``ep.module()`` on every recorded call; ``iobundle validate`` runs onnxruntime on every
recorded call), two at a time (under pytest-xdist: one family per worker at a time). A family passes when both commands succeed and every
recorded call is within the family's tolerance in both runtimes. ``make zoo`` runs the same
harness and writes the support matrix into docs/llm.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from behaviours import ZOO
from families import Family, family, missing_requirement
from harness import FamilyResult, run_families

pytestmark = pytest.mark.slow

JOBS = int(os.environ.get("IOBUNDLE_ZOO_JOBS", "2"))
RESULTS = os.environ.get("IOBUNDLE_ZOO_RESULTS")  # a folder: each family's result is written there as JSON


@pytest.fixture(scope="session")
def zoo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Family], FamilyResult]:
    """A family's result, each family captured and replayed once per test process.

    In one process, the first test runs every family selected in this session (``-k``
    respected) at once, replays side by side. Under pytest-xdist a worker does not know which
    tests it will get: each test runs its own family, the workers side by side.
    """
    root = tmp_path_factory.mktemp("zoo")
    results: dict[str, FamilyResult] = {}
    selected = {
        item.callspec.params["entry"].name
        for item in request.session.items
        if hasattr(item, "callspec")
        and isinstance(item.callspec.params.get("entry"), Family)
        and not missing_requirement(item.callspec.params["entry"])
    }

    def result(entry: Family) -> FamilyResult:
        if entry.name not in results:
            if os.environ.get("PYTEST_XDIST_WORKER"):
                batch = [entry]
            else:
                batch = [f for f in ZOO if f.name in selected and f.name not in results]
            results.update(run_families(batch, root, jobs=JOBS))
            if RESULTS:  # for `matrix.py --from-results`: the support matrix of this test run
                for name in [f.name for f in batch]:
                    out = Path(RESULTS) / f"{name}.json"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(results[name].to_json()), "utf-8")
        return results[entry.name]

    return result


@pytest.mark.parametrize("entry", ZOO, ids=[f.name for f in ZOO])
def test_family_exports_and_validates_from_bundle(entry: Family, zoo: Callable[[Family], FamilyResult]) -> None:
    if missing_requirement(entry):
        pytest.skip(missing_requirement(entry))
    result = zoo(entry)
    failures = result.failures(entry.atol)
    if entry.known_failure:
        # Documented in the matrix and reported as an expected failure, never as a pass; when it
        # starts passing the entry must be updated.
        if not failures:
            pytest.fail(f"{entry.name} passes now: remove its known_failure ({entry.known_failure!r})")
        pytest.xfail(f"known failure: {entry.known_failure}")
    assert result.bundles, result.error
    assert not failures, "\n".join(failures)
    for bundle in result.bundles:
        assert bundle.calls >= 2, f"{bundle.name}: a generate() records a prefill and decode calls"
        assert bundle.programs >= 1
        # The batch a program refused on a guard is served (program and eager model agree there) by these.
        assert bundle.remedies == list(entry.remedies), bundle.export_output


@pytest.mark.parametrize("name", ["mllama", "idefics"])
def test_cross_attention_families_read_the_image(name: str) -> None:
    # Their gated cross-attention starts closed in a model built from a config: the zoo opens it,
    # so that the image reaches the logits and a wrong cross-attention would not validate.
    model, kwargs = family(name).build()
    inputs = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        logits = model(**inputs).logits
        other = model(**{**inputs, "pixel_values": inputs["pixel_values"] + 1.0}).logits
    assert (logits - other).abs().max() > 1e-3
