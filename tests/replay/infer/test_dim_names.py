"""``infer_dynamic_shapes(dim_names=...)``: names as strings, shared where sizes agree, conventional for known inputs.

Every case runs in memory and on the bundle the observer saves, reloaded: both must give the
same names. The export tests check that ``torch.onnx.export`` takes the names as they are and
that ``bundle.export`` / ``bundle.to_onnx`` turn them into shared dimensions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from observing import Calls, observe, source
from torch.onnx import InputObserver as ReferenceObserver

from iobundle import ExportError, InputObserver, InputSelectionError, load_bundle

DYN = torch.export.Dim.DYNAMIC


def onnx_input_dims(path: str | Path) -> dict[str, list[Any]]:
    model = onnx.load(str(path))
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


class Add(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class AddOptional(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return x + y if z is None else x + y + z


class Llm(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)


def add_calls() -> Calls:
    """Three calls: x is (5, 6), (7, 7), (7, 8); y is (1, 6), (1, 7), (1, 8)."""
    return [((torch.randn(n, m), torch.randn(1, m)), {}) for n, m in ((5, 6), (7, 7), (7, 8))]


class TestYobxSemantics:
    """The behaviours yobx's observer documents for ``dim_names``."""

    def test_default_is_unchanged(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        ref = observe(Add(), add_calls(), ReferenceObserver())
        assert ours.infer_dynamic_shapes() == ref.infer_dynamic_shapes() == ({0: DYN, 1: DYN}, {1: DYN})
        assert ours.infer_dynamic_shapes(dim_names=False) == ref.infer_dynamic_shapes()

    @pytest.mark.parametrize("key", ["x", 0])
    def test_explicit_names_by_name_or_position(self, key: Any, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={key: {0: "batch", 1: "seq"}})
        assert shapes == ({0: "batch", 1: "seq"}, {1: "y_dim_1"})

    def test_explicit_names_for_keywords(self, where: str, tmp_path: Path) -> None:
        calls = [((), {"x": a, "y": b}) for (a, b), _ in add_calls()]
        ours = source(observe(Add(), calls), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={"x": {0: "batch", 1: "seq"}, "y": {1: "seq"}})
        assert shapes == {"x": {0: "batch", 1: "seq"}, "y": {1: "seq"}}

    def test_partial_names_fall_back_per_input_and_dimension(self, where: str, tmp_path: Path) -> None:
        calls: Calls = [((torch.randn(n, n), torch.randn(n, n)), {}) for n in (5, 7, 8)]
        ours = source(observe(Add(), calls), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={"x": {0: "batch"}})
        assert shapes == ({0: "batch", 1: "x_dim_1"}, {0: "y_dim_0", 1: "y_dim_1"})

    def test_mixed_positional_and_keyword(self, where: str, tmp_path: Path) -> None:
        calls: Calls = [((torch.randn(n, n + 1), torch.randn(1, n + 1)), {"z": torch.randn(n, n + 1)}) for n in (5, 6)]
        ours = source(observe(AddOptional(), calls), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={"x": {0: "batch"}, "z": {0: "batch", 1: "seq"}})
        assert shapes == {"x": {0: "batch", 1: "x_dim_1"}, "y": {1: "y_dim_1"}, "z": {0: "batch", 1: "seq"}}

    def test_derived_names_are_strings_shared_by_equal_sizes(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        x, y = ours.infer_dynamic_shapes(dim_names=True)
        assert all(isinstance(v, str) for v in [*x.values(), *y.values()])
        assert x[1] == y[1]  # 6, 7, 8 in both
        assert x[0] != x[1]

    def test_an_absent_input_counts_with_the_stand_in_it_is_fed(self, where: str, tmp_path: Path) -> None:
        """z is absent from call 0, where infer_arguments feeds (7, 0): its dims do not share x's names."""
        calls: Calls = [((torch.randn(5, 6), torch.randn(1, 6)), {})]
        calls += [((torch.randn(n, n + 1), torch.randn(1, n + 1)), {"z": torch.randn(n, n + 1)}) for n in (6, 7)]
        ours = source(observe(AddOptional(), calls), where, tmp_path)
        assert [tuple(t.shape) for t in ours.infer_arguments(0, flat=True)] == [(5, 6), (1, 6), (7, 0)]
        shapes = ours.infer_dynamic_shapes(dim_names=True)
        assert shapes == {"x": {0: "x_dim_0", 1: "x_dim_1"}, "y": {1: "x_dim_1"}, "z": {0: "z_dim_0", 1: "z_dim_1"}}

    def test_conventional_names_for_llm_inputs(self, where: str, tmp_path: Path) -> None:
        calls: Calls = [
            ((torch.randint(0, 9, (2, 6)), torch.ones(2, 7, dtype=torch.long)), {}),
            ((torch.randint(0, 9, (3, 8)), torch.ones(3, 9, dtype=torch.long)), {}),
        ]
        ours = source(observe(Llm(), calls), where, tmp_path)
        ids, mask = ours.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
        assert ids == {0: "batch_size", 1: "sequence_length"}
        assert mask == {0: "batch_size", 1: "total_sequence_length"}


class TestExplicitNames:
    def test_a_named_dimension_becomes_dynamic(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        assert ours.infer_dynamic_shapes(dim_names={"y": {0: "one"}}) == (
            {0: "x_dim_0", 1: "x_dim_1"},
            {0: "one", 1: "y_dim_1"},
        )

    def test_a_list_names_each_tensor_of_a_nested_input(self, where: str, tmp_path: Path) -> None:
        class Nested(torch.nn.Module):
            def forward(self, x: torch.Tensor, pair: list[torch.Tensor]) -> torch.Tensor:
                return x + pair[0] + pair[1]

        calls: Calls = [((torch.randn(n, 3), [torch.randn(n, 3), torch.randn(1, 3)]), {}) for n in (2, 4)]
        ours = source(observe(Nested(), calls), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={"pair": [{0: "batch"}, None]})
        assert shapes == ({0: "x_dim_0"}, [{0: "batch"}, {}])
        assert ours.infer_dynamic_shapes(dim_names={"pair": {0: "b"}}) == ({0: "x_dim_0"}, [{0: "b"}, {0: "b"}])
        assert ours.infer_dynamic_shapes(dim_names=True) == ({0: "x_dim_0"}, [{0: "x_dim_0"}, {}])

    @pytest.mark.parametrize(
        ("spec", "match"),
        [
            ({"nope": {0: "b"}}, "'nope' is neither a parameter"),
            ({7: {0: "b"}}, "position 7 is outside"),
            ({"x": {2: "b"}}, "dimension 2 does not exist"),
            ({"x": {0: ""}}, "a name is a non-empty str"),
            ({"x": [{0: "b"}, {0: "c"}]}, "gives 2 entries but the input holds 1 tensors"),
            ({"x": "batch"}, "expected a dict"),
            ("batch", "unexpected type str"),
        ],
    )
    def test_bad_specs_are_value_errors_naming_the_problem(
        self, spec: Any, match: str, where: str, tmp_path: Path
    ) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        with pytest.raises(InputSelectionError, match=match) as info:
            ours.infer_dynamic_shapes(dim_names=spec)
        assert isinstance(info.value, ValueError)


class TestTransformersStructures:
    """Caches are recognised by what was recorded, whatever the argument is called."""

    transformers = pytest.importorskip("transformers")

    @staticmethod
    def _kv(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 2, length, 4), torch.randn(batch, 2, length, 4)

    def _mixed_cache(self, length: int) -> Any:
        """A full layer and a sliding layer (window 4: it keeps 3 tokens); empty when ``length`` is 0."""
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

        cache = DynamicCache()
        cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)]
        cache.layer_class_to_replicate = None
        for layer in range(2):
            if length:
                cache.update(*self._kv(2, length), layer)
        return cache

    @pytest.mark.parametrize("argument", ["cache", "state"])
    def test_self_attention_and_sliding_layers(self, argument: str, where: str, tmp_path: Path) -> None:
        class Decoder(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return input_ids.float().sum() + cache_position.sum()

        calls: Calls = [((torch.ones(2, 5, dtype=torch.long), torch.arange(5)), {argument: self._mixed_cache(0)})]
        calls += [
            ((torch.ones(2, 1, dtype=torch.long), torch.arange(1)), {argument: self._mixed_cache(n)}) for n in (5, 6, 7)
        ]
        ours = source(observe(Decoder(), calls), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
        full = {0: "batch_size", 2: "past_sequence_length"}
        sliding = {0: "batch_size", 2: "sliding_past_sequence_length"}
        assert shapes == {
            "input_ids": {0: "batch_size", 1: "sequence_length"},
            "cache_position": {0: "sequence_length"},
            "kwargs": {argument: [full, full, sliding, sliding]},
        }

    def test_encoder_decoder_cache_and_decoder_inputs(self, where: str, tmp_path: Path) -> None:
        from transformers import DynamicCache, EncoderDecoderCache

        class Seq2Seq(torch.nn.Module):
            def forward(
                self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor, past_key_values: Any
            ) -> torch.Tensor:
                return decoder_input_ids.float().sum() + encoder_hidden_states.sum()

        def caches(length: int, encoder_length: int) -> Any:
            own, cross = DynamicCache(), DynamicCache()
            if length:
                own.update(*self._kv(2, length), 0)
                cross.update(*self._kv(2, encoder_length), 0)
            return EncoderDecoderCache(own, cross)

        calls: Calls = [((torch.ones(2, 3, dtype=torch.long), torch.randn(2, 9, 8), caches(0, 9)), {})]
        calls += [((torch.ones(2, 1, dtype=torch.long), torch.randn(2, 9, 8), caches(n, 9)), {}) for n in (3, 4)]
        ours = source(observe(Seq2Seq(), calls), where, tmp_path)
        ids, encoder, cache = ours.infer_dynamic_shapes(dim_names=True)
        assert ids == {1: "decoder_sequence_length"}
        assert encoder == {}
        own = {2: "past_sequence_length"}
        cross = {2: "encoder_sequence_length"}  # 0 at the first step, then the encoder's length
        assert cache == [[own, own], [cross, cross]]

    def test_static_cache_shares_the_batch(self, where: str, tmp_path: Path) -> None:
        from transformers import LlamaConfig, StaticCache

        config = LlamaConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=10
        )

        class Step(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, past_key_values: Any) -> torch.Tensor:
                return input_ids.float().sum()

        def static(batch: int) -> Any:
            cache = StaticCache(config=config, max_cache_len=6)
            cache.update(*[t[:, :, :2] for t in self._kv(batch, 2)], 0, {"cache_position": torch.arange(2)})
            return cache

        calls: Calls = [((torch.ones(2, 1, dtype=torch.long), static(2)), {}) for _ in range(2)]
        ours = source(observe(Step(), calls), where, tmp_path)
        ids, cache = ours.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
        assert ids == {0: "batch_size"}
        assert cache == [{0: "batch_size"}, {0: "batch_size"}, {}]
        named = ours.infer_dynamic_shapes(dim_names={"past_key_values": [{2: "max_cache_length"}] * 2 + [None]})
        assert named[1][:2] == [{2: "max_cache_length"}, {2: "max_cache_length"}]


class TestExport:
    # torch warns when one name labels several axes, which is what a shared name is for
    @pytest.mark.filterwarnings("ignore:# The axis name:UserWarning")
    def test_torch_onnx_export_takes_the_names_as_they_are(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        shapes = ours.infer_dynamic_shapes(dim_names={"x": {0: "batch", 1: "seq"}, "y": {1: "seq"}})
        model = Add().eval()
        program = torch.onnx.export(model, ours.infer_arguments(), dynamic_shapes=shapes, dynamo=True, verbose=False)
        assert program is not None
        program.save(str(tmp_path / "add.onnx"))
        assert onnx_input_dims(tmp_path / "add.onnx") == {"x": ["batch", "seq"], "y": [1, "seq"]}

    def test_export_turns_names_into_shared_dims(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        ep = ours.export(Add(), dim_names=True)
        x, y = (n.meta["val"] for n in ep.program.graph.nodes if n.op == "placeholder")
        assert str(x.shape[1]) == str(y.shape[1])  # one symbol for the shared name
        assert ep.report.ok

    def test_export_says_which_names_torch_proved_equal(self, tmp_path: Path) -> None:
        calls: Calls = [((torch.randn(2, 3), torch.randn(2, 3)), {}), ((torch.randn(4, 5), torch.randn(4, 5)), {})]
        ours = observe(Add(), calls)
        with pytest.raises(ExportError, match=r"proved relations between named dimensions: c = a; d = b\."):
            ours.export(Add(), dim_names={"x": {0: "a", 1: "b"}, "y": {0: "c", 1: "d"}})
        assert ours.export(Add(), dim_names={"x": {0: "a", 1: "b"}, "y": {0: "a", 1: "b"}}).report.ok

    def test_to_onnx_names_the_graphs_dimensions(self, where: str, tmp_path: Path) -> None:
        ours = source(observe(Add(), add_calls()), where, tmp_path)
        path = ours.to_onnx(Add(), tmp_path / "add.onnx", dim_names=True)
        assert onnx_input_dims(path) == {"x": ["x_dim_0", "x_dim_1"], "y": [1, "x_dim_1"]}
        assert all(row["SUCCESS"] for row in ours.check_discrepancies(path))

    def test_to_onnx_without_names_is_unchanged(self, tmp_path: Path) -> None:
        ours = observe(Add(), add_calls())
        dims = onnx_input_dims(ours.to_onnx(Add(), tmp_path / "add.onnx"))
        assert [d for d in dims["x"]] != ["x_dim_0", "x_dim_1"]
        assert all(isinstance(d, str) and d.startswith("s") for d in dims["x"])


@pytest.mark.slow
def test_llm_cache_lengths_share_one_name_in_the_onnx_graph(tmp_path: Path) -> None:
    """A tiny Llama (2 layers) from generate(): every layer's key and value length is one ONNX dim."""
    pytest.importorskip("transformers")
    from iobundle.demo._llama import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[0, :2] = 0
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=4):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    observer.save(tmp_path / "llama.iobundle")
    bundle = load_bundle(tmp_path / "llama.iobundle")
    shapes = bundle.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
    assert shapes == observer.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)

    path = bundle.to_onnx(model, tmp_path / "llama.onnx", set_batch_dimension_for=True, dim_names=True)
    dims = onnx_input_dims(path)
    caches = {name: d for name, d in dims.items() if name.startswith(("cache_key_", "cache_value_"))}
    assert len(caches) == 4
    assert {d[2] for d in caches.values()} == {"past_sequence_length"}
    assert {d[0] for d in dims.values()} == {"batch_size"}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert all(row["SUCCESS"] for row in bundle.check_discrepancies(path))
