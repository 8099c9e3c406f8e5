"""The known defects of the other InputObserver implementations (DESIGN.md, D2-D8) that ours must not have,
and the basics of observing a method."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from iobundle import AlignmentError, InputObserver, load_bundle
from iobundle.capture import ObservationWarning

DYN = torch.export.Dim.DYNAMIC


def observe(
    model: torch.nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], **kwargs: Any
) -> InputObserver:
    observer = InputObserver(**kwargs)
    with observer(model):
        for args, kw in calls:
            model(*args, **kw)
    return observer


def reloaded(observer: InputObserver, tmp_path) -> Any:
    observer.save(tmp_path / "run.iobundle")
    return load_bundle(tmp_path / "run.iobundle")


class Optional3(torch.nn.Module):
    def forward(self, x, mask=None, n: int = 1):
        return x * n if mask is None else x * mask * n


# --------------------------------------------------------------------------- D2


class TestD2PositionalNoneOrInt:
    """D2: a positional None or int passed in every call crashed shape inference."""

    def test_positional_none_is_absent(self, tmp_path) -> None:
        x1, x2 = torch.rand(2, 3), torch.rand(3, 3)
        observer = observe(Optional3(), [((x1, None), {}), ((x2, None), {})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == ({0: DYN}, None)
            args = source.infer_arguments()
            assert isinstance(args, tuple) and len(args) == 2
            assert torch.equal(args[0], x1) and args[1] is None
            assert [tuple(a.shape) for a in source.infer_arguments(flat=True)] == [(2, 3)]

    def test_positional_int_is_a_constant(self, tmp_path) -> None:
        x1, m1, x2, m2 = torch.rand(2, 3), torch.rand(2, 3), torch.rand(3, 3), torch.rand(3, 3)
        observer = observe(Optional3(), [((x1, m1, 2), {}), ((x2, m2, 2), {})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == ({0: DYN}, {0: DYN}, None)
            args = source.infer_arguments(1)
            assert torch.equal(args[0], x2) and torch.equal(args[1], m2) and args[2] == 2
            assert len(source.infer_arguments(flat=True)) == 2

    def test_positional_none_and_int_together(self, tmp_path) -> None:
        observer = observe(Optional3(), [((torch.rand(2, 3), None, 3), {}), ((torch.rand(4, 3), None, 3), {})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == ({0: DYN}, None, None)
            args, kwargs = source.infer_arguments(as_args_kwargs=True)
            assert args[1:] == (None, 3) and kwargs == {}


# --------------------------------------------------------------------------- D3


class Fragile(torch.nn.Module):
    def forward(self, x, fail: bool = False):
        if fail:
            raise ValueError("boom inside forward")
        return x * 2


class TestD3FailedCall:
    """D3: an exception inside forward left an input without output, and the pairs shifted."""

    @pytest.fixture
    def observer(self) -> InputObserver:
        model, observer = Fragile(), InputObserver()
        with observer(model, store_n_calls=5):
            model(torch.full((2, 3), 1.0))
            with pytest.raises(ValueError, match="boom inside forward"):
                model(torch.full((5, 3), 9.0), fail=True)
            model(torch.full((3, 3), 2.0))
            model(torch.full((4, 3), 3.0))
        return observer

    def test_failed_call_is_recorded_as_failed(self, observer: InputObserver) -> None:
        calls = observer.info.calls
        assert [c.status for c in calls] == ["ok", "failed", "ok", "ok"]
        assert calls[1].outputs is None
        assert "boom inside forward" in (calls[1].error or "")

    def test_num_obs_counts_ok_calls_only(self, observer: InputObserver, tmp_path) -> None:
        assert observer.num_obs() == 3
        assert len(observer.info) == 3
        bundle = reloaded(observer, tmp_path)
        assert bundle.num_obs() == 3
        assert [c.status for c in bundle.calls] == ["ok", "failed", "ok", "ok"]

    def test_inputs_stay_paired_with_their_outputs(self, observer: InputObserver) -> None:
        info = observer.info
        assert len(info.inputs) == len(info.flat_outputs) == len(info.latencies) == 3
        for inputs, outputs in zip(info.inputs, info.flat_outputs):
            (x,) = inputs.flat_list
            assert torch.equal(outputs[0], x * 2)
        assert [inputs.flat_list[0][0, 0].item() for inputs in info.inputs] == [1.0, 2.0, 3.0]

    def test_inference_ignores_the_failed_call(self, observer: InputObserver, tmp_path) -> None:
        for source in (observer, reloaded(observer, tmp_path)):
            # the failed call passed fail=True: a constant the ok calls do not share, ignored
            assert source.infer_dynamic_shapes() == ({0: DYN},)
            assert [tuple(a.shape) for a in source.infer_arguments(flat=True)] == [(2, 3)]
            assert torch.equal(source.infer_arguments(2)[0], torch.full((4, 3), 3.0))

    def test_only_failed_calls_gives_a_clear_error(self) -> None:
        model, observer = Fragile(), InputObserver()
        with observer(model), pytest.raises(ValueError):
            model(torch.ones(2, 3), fail=True)
        assert observer.num_obs() == 0
        with pytest.raises(AlignmentError, match="No successful call"):
            observer.infer_dynamic_shapes()


# --------------------------------------------------------------------------- D4


class Unregistered:
    """A class nobody registered as a pytree node."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class ReturnsUnknown(torch.nn.Module):
    def forward(self, x):
        return x + 1, Unregistered(x)


class TestD4UnknownOutputClass:
    """D4: an output of an unregistered class crashed the user's own program."""

    def test_program_goes_on_with_a_warning(self, tmp_path) -> None:
        model, observer = ReturnsUnknown(), InputObserver()
        with pytest.warns(ObservationWarning, match="Unregistered"), observer(model):
            first = model(torch.ones(2, 3))
            model(torch.ones(3, 3))
        assert isinstance(first[1], Unregistered)  # the caller got its real output
        assert torch.equal(first[0], torch.full((2, 3), 2.0))
        call = observer.info.calls[0]
        assert call.status == "ok"
        assert call.outputs is not None and call.outputs.items[1].kind == "opaque"
        assert "Unregistered" in call.outputs.items[1].type
        assert [len(o) for o in observer.info.flat_outputs] == [1, 1]
        assert observer.infer_dynamic_shapes() == ({0: DYN},)
        bundle = reloaded(observer, tmp_path)
        assert bundle.calls[0].outputs == call.outputs
        assert bundle.infer_dynamic_shapes() == ({0: DYN},)

    def test_unknown_input_class_does_not_break_the_call(self) -> None:
        class TakesAnything(torch.nn.Module):
            def forward(self, x, thing=None):
                return x

        model, observer = TakesAnything(), InputObserver()
        with pytest.warns(ObservationWarning, match="opaque"), observer(model):
            out = model(torch.ones(2, 3), thing=Unregistered(torch.ones(1)))
        assert torch.equal(out, torch.ones(2, 3))
        assert observer.info.calls[0].kwargs["thing"].kind == "opaque"


# --------------------------------------------------------------------------- D5


class VarPositional(torch.nn.Module):
    def forward(self, a, *args, b=None, **kwargs):
        return a + sum(args) + (0 if b is None else b) + sum(kwargs.values())


class TestD5RemoveInputsWithVarPositional:
    """D5: remove_inputs was unusable when the signature has *args."""

    @pytest.fixture
    def observer(self) -> InputObserver:
        calls = [
            ((torch.rand(n, 3), torch.rand(n, 3), torch.rand(n, 3)), {"b": torch.rand(n, 3), "c": torch.rand(n, 3)})
            for n in (2, 3)
        ]
        return observe(VarPositional(), calls)

    def test_inference_with_var_positional(self, observer: InputObserver) -> None:
        assert observer.infer_dynamic_shapes() == {
            "a": {0: DYN},
            "args": ({0: DYN}, {0: DYN}),
            "b": {0: DYN},
            "kwargs": {"c": {0: DYN}},
        }

    @pytest.mark.parametrize(
        ("names", "expected"),
        [
            ("b", {"a": {0: DYN}, "args": ({0: DYN}, {0: DYN}), "kwargs": {"c": {0: DYN}}}),
            ("c", {"a": {0: DYN}, "args": ({0: DYN}, {0: DYN}), "b": {0: DYN}}),
            (["b", "c"], {"a": {0: DYN}, "args": ({0: DYN}, {0: DYN})}),
            ("args", {"a": {0: DYN}, "args": (), "b": {0: DYN}, "kwargs": {"c": {0: DYN}}}),
        ],
    )
    def test_remove_inputs_works(self, observer: InputObserver, names: Any, expected: Any, tmp_path) -> None:
        bundle = reloaded(observer, tmp_path)
        for source in (observer, bundle):
            source.remove_inputs(names)
            assert source.infer_dynamic_shapes() == expected
            args, kwargs = source.infer_arguments(as_args_kwargs=True)
            assert len(args) == 1 + len(expected["args"])
            assert list(kwargs) == [k for k in ("b", "c") if k in expected or k in expected.get("kwargs", {})]

    def test_remove_a_positional_before_the_variadic_names_it(self, observer: InputObserver) -> None:
        with pytest.raises(AlignmentError, match=r"\*args"):
            observer.remove_inputs("a")

    def test_unknown_name_removes_nothing_with_a_warning(self, observer: InputObserver) -> None:
        with pytest.warns(UserWarning, match="nope"):
            assert observer.remove_inputs(["nope", "b"]) == 2  # b still goes, from both calls
        assert "b" not in observer.infer_dynamic_shapes()


# --------------------------------------------------------------------------- D6


class UseCache(torch.nn.Module):
    def forward(self, x, use_cache=None, output_attentions: bool = False):
        return x if use_cache else -x


class TestD6ScalarWithNoneDefault:
    """D6: scalar kwargs whose default is None (use_cache=True) were silently dropped."""

    def test_kept_as_a_constant(self, tmp_path) -> None:
        x1, x2 = torch.rand(2, 3), torch.rand(3, 3)
        observer = observe(UseCache(), [((x1,), {"use_cache": True}), ((x2,), {"use_cache": True})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == {"x": {0: DYN}, "use_cache": None}
            args = source.infer_arguments()
            assert list(args) == ["x", "use_cache"] and args["use_cache"] is True
            assert torch.equal(args["x"], x1)
            assert source.infer_arguments(as_args_kwargs=True)[1] == {"use_cache": True}

    def test_equal_to_the_default_is_dropped(self) -> None:
        observer = observe(UseCache(), [((torch.rand(2, 3),), {"output_attentions": False})])
        assert observer.infer_arguments() == observer.infer_arguments(as_args_kwargs=True)[0]

    def test_calls_must_agree_on_constants(self) -> None:
        observer = observe(UseCache(), [((torch.rand(2, 3),), {"use_cache": True}), ((torch.rand(3, 3),), {})])
        with pytest.raises(AlignmentError, match="different constants"):
            observer.infer_dynamic_shapes()


# --------------------------------------------------------------------------- D8


class Extra(torch.nn.Module):
    def forward(self, x, extra=None):
        return x


class TestD8AbsentIsNotFalsy:
    """D8: absent was decided by truthiness; absent means not passed or None."""

    @pytest.mark.parametrize(("empty", "expected_ds"), [([], []), ({}, {}), ((), ())])
    def test_empty_container_is_present(self, empty: Any, expected_ds: Any, tmp_path) -> None:
        observer = observe(Extra(), [((torch.rand(2, 3),), {"extra": empty}), ((torch.rand(3, 3),), {"extra": empty})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == {"x": {0: DYN}, "extra": expected_ds}
            args = source.infer_arguments()
            assert list(args) == ["x", "extra"] and args["extra"] == empty and type(args["extra"]) is type(empty)

    def test_empty_positional_list_is_present(self) -> None:
        observer = observe(Extra(), [((torch.rand(2, 3), []), {}), ((torch.rand(3, 3), []), {})])
        assert observer.infer_dynamic_shapes() == ({0: DYN}, [])
        assert observer.infer_arguments(1)[1] == []

    def test_none_is_absent(self) -> None:
        observer = observe(Extra(), [((torch.rand(2, 3),), {"extra": None}), ((torch.rand(3, 3),), {})])
        assert observer.infer_dynamic_shapes() == ({0: DYN},)

    def test_zero_size_tensor_is_present(self, tmp_path) -> None:
        e1, e2 = torch.empty((2, 0)), torch.rand(3, 4)
        observer = observe(Extra(), [((torch.rand(2, 3),), {"extra": e1}), ((torch.rand(3, 3),), {"extra": e2})])
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == {"x": {0: DYN}, "extra": {0: DYN, 1: DYN}}
            assert source.infer_arguments(0)["extra"].shape == (2, 0)
            assert torch.equal(source.infer_arguments(1)["extra"], e2)

    def test_empty_cache_is_a_cache_with_zero_length_tensors(self, tmp_path) -> None:
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=8
        )

        def cache(length: int) -> Any:
            c = transformers.DynamicCache(config=config)
            if length:
                c.update(torch.rand(1, 2, length, 4), torch.rand(1, 2, length, 4), 0)
            return c

        class Decoder(torch.nn.Module):
            def forward(self, input_ids, past_key_values=None):
                return input_ids

        ids = [torch.ones((1, n), dtype=torch.int64) for n in (5, 1, 1)]
        calls = [((ids[0],), {"past_key_values": cache(0)})]
        calls += [((i,), {"past_key_values": cache(n)}) for i, n in zip(ids[1:], (5, 6))]
        observer = observe(Decoder(), calls)
        for source in (observer, reloaded(observer, tmp_path)):
            assert source.infer_dynamic_shapes() == {"input_ids": {1: DYN}, "past_key_values": [{2: DYN}, {2: DYN}]}
            flat = source.infer_arguments(0, flat=True)
            assert [tuple(t.shape) for t in flat] == [(1, 5), (1, 2, 0, 4), (1, 2, 0, 4)]
            prefill = source.infer_arguments(0)
            assert isinstance(prefill["past_key_values"], transformers.DynamicCache)


# --------------------------------------------------------------------------- observer basics


class Plain(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, *, scale: float = 1.0):
        return input_ids * scale


class InPlace(torch.nn.Module):
    def forward(self, x):
        x.add_(100)
        return x


def _is_restored(model: torch.nn.Module) -> bool:
    return "forward" not in model.__dict__ and model.forward.__func__ is type(model).forward


class TestObserverBasics:
    def test_is_empty_until_a_call_succeeds(self) -> None:
        model, observer = Plain(), InputObserver()
        assert observer.is_empty() and observer.num_obs() == 0
        with observer(model):
            assert observer.is_empty()
            model(torch.ones(2))
        assert not observer.is_empty() and observer.num_obs() == 1

    def test_signature_stays_visible(self) -> None:
        model, observer = Plain(), InputObserver()
        expected = inspect.signature(model.forward)
        with pytest.warns(ObservationWarning, match="no call"), observer(model):
            assert inspect.signature(model.forward) == expected
            assert "attention_mask" in inspect.signature(model.forward).parameters
        assert inspect.signature(model.forward) == expected

    def test_method_restored_after_the_block(self) -> None:
        model, observer = Plain(), InputObserver()
        with observer(model):
            assert not _is_restored(model)
            model(torch.ones(2))
        assert _is_restored(model)
        model(torch.ones(2))
        assert observer.num_obs() == 1

    def test_method_restored_on_exception(self) -> None:
        model, observer = Plain(), InputObserver()
        with pytest.raises(RuntimeError, match="user error"), observer(model):
            model(torch.ones(2))
            raise RuntimeError("user error")
        assert _is_restored(model)
        assert observer.num_obs() == 1

    def test_instance_attribute_restored(self) -> None:
        model, observer = Plain(), InputObserver()
        own = model.forward
        model.forward = own  # an instance attribute, as some wrappers leave
        with observer(model):
            model(torch.ones(2))
        assert model.__dict__["forward"] is own

    def test_store_n_calls_limits_recording(self) -> None:
        model, observer = Plain(), InputObserver()
        with observer(model, store_n_calls=2):
            outs = [model(torch.full((n,), float(n))) for n in (1, 2, 3, 4)]
        assert [o.shape[0] for o in outs] == [1, 2, 3, 4]  # every call ran
        assert observer.num_obs() == 2
        assert [i.flat_list[0].shape[0] for i in observer.info.inputs] == [1, 2]

    def test_second_block_records_store_n_calls_more(self) -> None:
        model, observer = Plain(), InputObserver()
        with observer(model, store_n_calls=2):
            for n in (1, 2, 3):
                model(torch.ones(n))
        with observer(model, store_n_calls=2):
            for n in (4, 5, 6):
                model(torch.ones(n))
        assert observer.num_obs() == 4
        assert [i.flat_list[0].shape[0] for i in observer.info.inputs] == [1, 2, 4, 5]

    def test_store_n_calls_zero_records_nothing(self) -> None:
        model, observer = Plain(), InputObserver()
        with observer(model, store_n_calls=0):
            model(torch.ones(2))
        assert observer.num_obs() == 0

    def test_inputs_snapshotted_before_the_call(self, tmp_path) -> None:
        model, observer = InPlace(), InputObserver()
        x = torch.zeros(2, 3)
        with observer(model):
            out = model(x)
        assert torch.equal(x, torch.full((2, 3), 100.0))  # the model did modify it
        assert torch.equal(observer.info.inputs[0].flat_list[0], torch.zeros(2, 3))
        assert torch.equal(observer.info.flat_outputs[0][0], out)
        assert torch.equal(observer.infer_arguments()[0], torch.zeros(2, 3))
        bundle = reloaded(observer, tmp_path)
        assert torch.equal(bundle.infer_arguments()[0], torch.zeros(2, 3))

    def test_same_tensor_modified_between_calls_is_stored_twice(self) -> None:
        model, observer = InPlace(), InputObserver()
        x = torch.zeros(2, 3)
        with observer(model):
            model(x)
            model(x)
        assert [i.flat_list[0][0, 0].item() for i in observer.info.inputs] == [0.0, 100.0]

    def test_info(self) -> None:
        model, observer = Plain(), InputObserver()
        ids = [torch.ones((1, n), dtype=torch.int64) for n in (3, 4)]
        mask = torch.ones(1, 4)
        with observer(model):
            model(ids[0])
            model(ids[1], mask, scale=2.0)
        info = observer.info
        assert len(info) == 2
        assert [len(i.flat_list) for i in info.inputs] == [1, 2]
        assert info.inputs[1].args[0].shape == (1, 4) and torch.equal(info.inputs[1].args[1], mask)
        assert info.inputs[1].cst_kwargs == {"scale": 2.0} and info.inputs[0].cst_kwargs == {}
        assert torch.equal(info.flat_outputs[1][0], ids[1] * 2.0)
        assert len(info.latencies) == 2 and all(isinstance(t, float) and t >= 0 for t in info.latencies)

    def test_no_such_method(self) -> None:
        from iobundle import CaptureError

        with pytest.raises(CaptureError, match="generate"), InputObserver()(Plain(), method_name="generate"):
            pass

    def test_other_method(self) -> None:
        class TwoMethods(torch.nn.Module):
            def forward(self, x):
                return self.step(x)

            def step(self, x, bias=None):
                return x + 1

        model, observer = TwoMethods(), InputObserver()
        with observer(model, method_name="step"):
            model(torch.ones(2, 3))
            model(torch.ones(3, 3))
        assert observer.infer_dynamic_shapes() == ({0: DYN},)
        assert "step" not in model.__dict__
