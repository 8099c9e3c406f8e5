"""Errors that fit both worlds: every condition the anchors signal with a builtin is caught by that builtin.

Code written for ``torch.onnx.InputObserver`` (or yobx's, onnx-diagnostic's) catches
``RuntimeError``, ``ValueError``, ``TypeError``; the same ``except`` clauses must catch what
iobundle raises for the same condition, which is also an :class:`iobundle.IobundleError`.
Replay-side conditions are checked in memory and on a reloaded bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import iobundle
from iobundle import InputObserver, load_bundle
from iobundle.errors import (
    AlignmentError,
    CaptureError,
    DynamicShapeError,
    InputSelectionError,
    IobundleError,
    ObserverArgumentError,
    ObserverArgumentTypeError,
    ObserverStateError,
    ReplayError,
    UnsupportedInputError,
)


@pytest.mark.parametrize(
    ("cls", "parents"),
    [
        (AlignmentError, (ReplayError, RuntimeError)),
        (DynamicShapeError, (ReplayError, RuntimeError)),
        (InputSelectionError, (AlignmentError, ValueError, RuntimeError)),
        (ObserverArgumentError, (CaptureError, ValueError)),
        (ObserverArgumentTypeError, (CaptureError, TypeError)),
        (ObserverStateError, (CaptureError, RuntimeError)),
        (UnsupportedInputError, (CaptureError, TypeError)),
    ],
)
def test_error_classes_derive_from_the_anchors_builtins(cls: type, parents: tuple[type, ...]) -> None:
    assert issubclass(cls, IobundleError)
    for parent in parents:
        assert issubclass(cls, parent)


def test_the_mapping_is_documented_in_the_error_module() -> None:
    doc = iobundle.errors.__doc__ or ""
    for name in ("AlignmentError", "ObserverArgumentError", "ObserverArgumentTypeError", "ObserverStateError"):
        assert name in doc
    for builtin in ("RuntimeError", "ValueError", "TypeError", "NotImplementedError"):
        assert builtin in doc


class Add(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        return x * scale if y is None else (x + y[0] if isinstance(y, list) else x + y) * scale


class Variadic(torch.nn.Module):
    def forward(self, a: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return a + sum(args)


def observed(model: torch.nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> InputObserver:
    observer = InputObserver()
    with observer(model, store_n_calls=len(calls)):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return observer


def sources(observer: InputObserver, tmp_path: Path) -> list[Any]:
    """The observer, and the bundle it saves, reloaded."""
    observer.save(tmp_path / "run.iobundle")
    return [observer, load_bundle(tmp_path / "run.iobundle")]


class TestCaptureSide:
    def test_a_method_the_model_lacks_is_a_value_error(self) -> None:
        with (
            pytest.raises(ValueError, match="does not have a method 'nonexistent'"),
            InputObserver()(Add(), method_name="nonexistent"),
        ):
            pass

    def test_an_unknown_value_if_missing_name_is_a_value_error(self) -> None:
        model = Add()
        with pytest.raises(ValueError, match="Unexpected keyword argument 'nonexistent'"):  # noqa: SIM117
            with InputObserver(value_if_missing={"nonexistent": torch.empty(0)})(model):
                model(torch.ones(2, 3))

    def test_a_value_if_missing_position_outside_the_signature_is_a_value_error(self) -> None:
        model = Add()
        with (
            pytest.raises(ValueError, match="position 10"),
            InputObserver(value_if_missing={10: torch.empty(0)})(model),
        ):
            model(torch.ones(2, 3))

    def test_a_value_if_missing_key_of_the_wrong_type_is_a_type_error(self) -> None:
        model = Add()
        with (
            pytest.raises(TypeError, match="Unexpected type float"),
            InputObserver(value_if_missing={1.5: torch.empty(0)})(model),
        ):
            model(torch.ones(2, 3))

    def test_a_value_if_missing_position_beyond_the_arguments_given_is_handled(self) -> None:
        """The anchors raise NotImplementedError; iobundle fills the position."""
        model = Add()
        observer = InputObserver(value_if_missing={1: torch.zeros(2, 0)})
        with observer(model):
            model(torch.ones(2, 3))
            model(torch.ones(4, 3), torch.ones(4, 3))
        assert [tuple(t.shape) for t in observer.infer_arguments(0, flat=True)] == [(2, 3), (2, 0)]

    @pytest.mark.parametrize(
        "action",
        [
            lambda o: o.infer_dynamic_shapes(),
            lambda o: o.infer_arguments(),
            lambda o: o.remove_inputs(["x"]),
            lambda o: o.save("never-written"),
        ],
        ids=["infer_dynamic_shapes", "infer_arguments", "remove_inputs", "save"],
    )
    def test_nothing_captured_yet_is_a_runtime_error(self, action: Any) -> None:
        with pytest.raises(RuntimeError, match="No inputs were captured"):
            action(InputObserver())


class TestReplaySide:
    def test_different_constants_are_a_runtime_error(self, tmp_path: Path) -> None:
        observer = observed(Add(), [((torch.ones(2, 3),), {"scale": 2.0}), ((torch.ones(3, 3),), {"scale": 3.0})])
        for source in sources(observer, tmp_path):
            with pytest.raises(RuntimeError, match="different constants"):
                source.infer_dynamic_shapes()

    def test_an_argument_flattening_to_another_number_of_tensors_is_a_runtime_error(self, tmp_path: Path) -> None:
        calls = [((torch.ones(2, 3), [torch.ones(2, 3)]), {}), ((torch.ones(2, 3), [torch.ones(2, 3)] * 2), {})]
        for source in sources(observed(Add(), calls), tmp_path):
            with pytest.raises(RuntimeError, match="flatten to the same number of tensors"):
                source.infer_dynamic_shapes()

    def test_no_call_holding_every_keyword_is_a_runtime_error(self, tmp_path: Path) -> None:
        class Either(torch.nn.Module):
            def forward(self, x: Any = None, y: Any = None) -> torch.Tensor:
                return x if y is None else y

        calls = [((), {"x": torch.ones(2, 3)}), ((), {"y": torch.ones(1, 7)}), ((), {"y": torch.ones(1, 7)})]
        for source in sources(observed(Either(), calls), tmp_path):
            with pytest.raises(RuntimeError, match="every keyword argument"):
                source.infer_dynamic_shapes()

    def test_a_change_of_rank_is_a_runtime_error(self, tmp_path: Path) -> None:
        for source in sources(observed(Add(), [((torch.ones(2, 3),), {}), ((torch.ones(2, 3, 4),), {})]), tmp_path):
            with pytest.raises(RuntimeError, match="different ranks"):
                source.infer_dynamic_shapes()

    def test_a_call_index_out_of_range_is_a_runtime_error(self, tmp_path: Path) -> None:
        for source in sources(observed(Add(), [((torch.ones(2, 3),), {})]), tmp_path):
            with pytest.raises(RuntimeError, match="No recorded call 5"):
                source.infer_arguments(5)

    def test_infer_arguments_of_an_unexpected_type_is_a_value_error(self, tmp_path: Path) -> None:
        for source in sources(observed(Add(), [((torch.ones(2, 3),), {})]), tmp_path):
            with pytest.raises(ValueError, match="Unexpected type str"):
                source.infer_arguments("invalid_string")

    def test_remove_inputs_of_an_unknown_name_removes_nothing_and_warns(self, tmp_path: Path) -> None:
        for source in sources(observed(Add(), [((torch.ones(2, 3),), {})]), tmp_path):
            before = source.infer_dynamic_shapes()
            with pytest.warns(UserWarning, match="'nope'.*neither parameters") as record:
                assert source.remove_inputs(["nope"]) == 0
            assert record[0].filename == __file__  # points at the caller's line
            assert source.infer_dynamic_shapes() == before

    def test_remove_inputs_blocked_by_a_variadic_is_a_value_error(self, tmp_path: Path) -> None:
        calls = [((torch.ones(2, 3), torch.ones(2, 3)), {}), ((torch.ones(4, 3), torch.ones(4, 3)), {})]
        for source in sources(observed(Variadic(), calls), tmp_path):
            with pytest.raises(ValueError, match=r"\*args"):
                source.remove_inputs(["a"])

    def test_a_candidate_not_aligned_is_a_runtime_error(self, tmp_path: Path) -> None:
        observer = observed(Add(), [((torch.ones(2, 3),), {"scale": 2.0}), ((torch.ones(3, 3),), {"scale": 3.0})])
        for source in sources(observer, tmp_path):
            candidate = source.info.inputs[0]
            assert candidate.aligned_flat_list is None
            with pytest.raises(RuntimeError, match=r"not aligned with the others: .*different constants"):
                candidate.n_aligned_tensors  # noqa: B018


class TestMessagesKeepTheAnchorsPhrases:
    """Code that matches the anchors' messages (``assertRaisesRegex``) keeps matching."""

    def test_flattening_to_another_number_of_tensors(self) -> None:
        class Pair(torch.nn.Module):
            def forward(self, x: Any = None, y: Any = None) -> torch.Tensor:
                return x

        positional = [((torch.ones(5, 7), [torch.ones(1, 7)]), {}), ((torch.ones(5, 7), [torch.ones(1, 7)] * 2), {})]
        with pytest.raises(RuntimeError, match="Positional argument 1 has"):
            observed(Pair(), positional).infer_dynamic_shapes()
        named = [((), {"x": torch.ones(5, 7), "y": [torch.ones(1, 7)]})]
        named += [((), {"x": torch.ones(5, 7), "y": [torch.ones(1, 7)] * 2})]
        with pytest.raises(RuntimeError, match="Named argument 'y' has"):
            observed(Pair(), named).infer_dynamic_shapes()

    def test_no_call_holding_every_keyword(self) -> None:
        class Either(torch.nn.Module):
            def forward(self, x: Any = None, y: Any = None) -> torch.Tensor:
                return x if y is None else y

        calls = [((), {"x": torch.ones(2, 3)}), ((), {"y": torch.ones(1, 7)}), ((), {"y": torch.ones(1, 7)})]
        with pytest.raises(RuntimeError, match="At least one call to the observed model"):
            observed(Either(), calls).infer_dynamic_shapes()

    def test_bad_arguments(self) -> None:
        model = Add()
        with pytest.raises(ValueError, match="Unexpected keyword argument"):  # noqa: SIM117
            with InputObserver(value_if_missing={"nonexistent": torch.empty(0)})(model):
                model(torch.ones(2, 3))
        with pytest.raises(TypeError, match="Unexpected type"):  # noqa: SIM117
            with InputObserver(value_if_missing={1.5: torch.empty(0)})(model):
                model(torch.ones(2, 3))
        with pytest.raises(ValueError, match="Unexpected type"):
            observed(model, [((torch.ones(2, 3),), {})]).infer_arguments("invalid_string")
