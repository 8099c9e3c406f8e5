"""``InputObserver`` as a drop-in: the names and habits of the three observers it replaces.

Each test is a piece of code written for one of them (torch.onnx's, yobx's, onnx-diagnostic's)
that must run unchanged, or the documented difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, ObserverArgumentError, load_bundle
from iobundle.capture import ObservationWarning


class Add(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, z: torch.Tensor | None = None) -> torch.Tensor:
        out = x if y is None else x + y
        return out if z is None else out + z


def test_info_is_none_before_any_observation() -> None:
    observer = InputObserver()
    assert observer.info is None
    assert observer.num_obs() == 0 and observer.is_empty()
    with pytest.warns(ObservationWarning, match="no call of Add.forward"), observer(Add()):
        pass
    assert observer.info is not None and len(observer.info) == 0


def test_missing_is_onnx_diagnostic_name_for_value_if_missing() -> None:
    model = Add()
    observer = InputObserver(missing={"z": torch.zeros(1, 0)})
    with observer(model):
        model(torch.ones(2, 3), z=torch.ones(2, 3))
        model(torch.ones(4, 3))
    assert [tuple(t.shape) for t in observer.infer_arguments(1, flat=True)] == [(4, 3), (1, 0)]
    with pytest.raises(ObserverArgumentError, match="not both"):
        InputObserver(value_if_missing={"z": torch.zeros(1, 0)}, missing={"z": torch.zeros(1, 0)})


def test_remove_inputs_takes_names_or_positions_and_counts_removals(tmp_path: Path) -> None:
    model = Add()
    observer = InputObserver()
    with observer(model):
        model(torch.ones(2, 3), torch.ones(2, 3), z=torch.ones(2, 3))
        model(torch.ones(4, 3), torch.ones(4, 3))
    observer.save(tmp_path / "run.iobundle")
    bundle = load_bundle(tmp_path / "run.iobundle")
    for source in (observer, bundle):
        assert source.remove_inputs([2]) == 1  # z, passed in one call
        assert source.remove_inputs("y") == 2
        assert source.remove_inputs(["z"]) == 0  # a parameter no call passes any more
        assert source.infer_dynamic_shapes() == ({0: torch.export.Dim.DYNAMIC},)
    with pytest.raises(ValueError, match="position 9"):
        observer.remove_inputs([9])


def test_check_discrepancies_takes_torch_onnx_programs() -> None:
    """torch.onnx.InputObserver.check_discrepancies is given the ONNXProgram torch.onnx.export returns."""
    pytest.importorskip("onnxruntime")
    model = Add().eval()
    observer = InputObserver()
    with observer(model):
        model(torch.randn(2, 3), torch.randn(2, 3))
        model(torch.randn(4, 3), torch.randn(4, 3))
    program = torch.onnx.export(
        model,
        observer.infer_arguments(),
        dynamic_shapes=observer.infer_dynamic_shapes(),
        dynamo=True,
        verbose=False,
    )
    rows = observer.check_discrepancies(program)
    assert [row["SUCCESS"] for row in rows] == [True, True]


PARITY = Path(__file__).parents[2] / "docs" / "PARITY.md"


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_every_public_name_of_torchs_observer_is_here_and_in_the_parity_table() -> None:
    import inspect

    from torch.onnx import InputObserver as Reference
    from torch.onnx._internal.exporter._input_observer import InputCandidate as ReferenceCandidate

    from iobundle import InputCandidate

    table = PARITY.read_text(encoding="utf-8")
    x = torch.ones(2, 3)
    pairs = [
        (InputObserver(value_if_missing={}), Reference(value_if_missing={})),
        (InputCandidate((x,), {}, False, {}), ReferenceCandidate((x,), {}, False, {})),
    ]
    # their pytree specs and alignment machinery: listed in the table as not provided
    not_provided = {"align_with", "build_mappings", "spec", "aligned_spec"}
    for ours, theirs in pairs:
        name = type(theirs).__name__
        missing = sorted(_public(theirs) - _public(ours) - not_provided)
        assert missing == [], f"{name} names missing from iobundle's: {missing}"
        for attr in _public(theirs):
            assert f"`{attr}" in table, f"docs/PARITY.md does not mention {name}.{attr}"
    for method in ("infer_dynamic_shapes", "infer_arguments"):
        theirs_params = set(inspect.signature(getattr(Reference, method)).parameters)
        assert theirs_params <= set(inspect.signature(getattr(InputObserver, method)).parameters)
    reference_info = Reference()
    assert reference_info.info is None and InputObserver().info is None


def test_a_save_that_cannot_store_the_model_writes_nothing(tmp_path: Path) -> None:
    model = Add()
    observer = InputObserver()
    with observer(model):
        model(torch.ones(2, 3))
    path = tmp_path / "run.iobundle"
    with pytest.raises(ObserverArgumentError, match="transformers and diffusers models only"):
        observer.save(path, include_model=True)  # a plain torch module: no config rebuilds it
    assert not path.exists()
    observer.save(path)  # the failed save left nothing that refuses the next one
    assert load_bundle(path).manifest.model is None
    (tmp_path / "kept.iobundle").mkdir()
    (tmp_path / "kept.iobundle" / "notes.txt").write_text("mine")
    with pytest.raises(ObserverArgumentError):
        observer.save(tmp_path / "kept.iobundle", include_model=True, overwrite=True)
    assert [p.name for p in (tmp_path / "kept.iobundle").iterdir()] == ["notes.txt"]
