"""Redacted bundles: synthetic inputs of the same dtype and shape, no outputs or weights unless kept, still exportable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iobundle import (
    BundleExistsError,
    InputObserver,
    ModelLoadError,
    NothingToCompareError,
    load_bundle,
    redact_bundle,
)
from iobundle.cli import main
from iobundle.replay import validate_onnx
from iobundle.travel._redact import synthetic_like

VOCAB = 50


class TokenModel(torch.nn.Module):
    """Embedding lookups: an id out of the vocabulary is an IndexError, so synthetic ids must stay in range."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask=None, position_ids=None, scale=1.0):
        y = self.lin(self.emb(input_ids)) * scale
        if position_ids is not None:
            y = y + position_ids.unsqueeze(-1).float()
        return y if attention_mask is None else y * attention_mask.unsqueeze(-1)


def capture(path: Path) -> Path:
    model, observer = TokenModel(), InputObserver()
    with observer(model, store_n_calls=3):
        model(
            torch.tensor([[3, 17, 42, 8, 9]]),
            attention_mask=torch.tensor([[0, 1, 1, 1, 1]]),
            position_ids=torch.arange(5)[None],
            scale=2.0,
        )
        model(
            torch.tensor([[5, 6, 7], [44, 45, 46]]),
            attention_mask=torch.ones(2, 3, dtype=torch.int64),
            position_ids=torch.tensor([[5, 6, 7], [5, 6, 7]]),
            scale=2.0,
        )
    observer.save(path)
    return path


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    return capture(tmp_path_factory.mktemp("redact") / "run.iobundle")


@pytest.fixture(scope="module")
def redacted(original: Path) -> Path:
    out = original.parent / "redacted.iobundle"
    redact_bundle(original, out)
    return out


def _inputs(bundle) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every recorded input, in call order."""
    pairs = []
    for call in bundle.manifest.calls:
        for name, node in call.kwargs.items():
            if node.kind == "tensor":
                pairs.append((name, bundle.tensor(node.key)))
        for j, node in enumerate(call.args):
            if node.kind == "tensor":
                pairs.append((str(j), bundle.tensor(node.key)))
    return pairs


# --------------------------------------------------------------------------- synthetic values


class TestSyntheticLike:
    gen = staticmethod(lambda: torch.Generator().manual_seed(0))

    def test_token_ids_stay_within_the_observed_range(self):
        ids = torch.tensor([[3, 40, 17, 9], [22, 5, 31, 12]])
        fake = synthetic_like(ids, self.gen())
        assert fake.dtype == ids.dtype and fake.shape == ids.shape
        assert int(fake.min()) >= 3 and int(fake.max()) <= 40
        assert not torch.equal(fake, ids)

    @pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool, torch.uint8])
    def test_masks_stay_masks(self, dtype):
        mask = (torch.rand(4, 64, generator=self.gen()) > 0.3).to(dtype)
        fake = synthetic_like(mask, torch.Generator().manual_seed(1))
        assert fake.dtype == dtype and fake.shape == mask.shape
        assert set(fake.flatten().tolist()) <= {0, 1}  # True == 1 and False == 0 too
        assert 0.5 < float(fake.float().mean()) < 0.9  # drawn at the observed frequency (about 0.7)

    def test_all_ones_mask_stays_all_ones(self):
        assert torch.equal(synthetic_like(torch.ones(3, 7, dtype=torch.int64), self.gen()), torch.ones(3, 7).long())

    def test_additive_mask_keeps_its_two_values(self):
        mask = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
        fake = synthetic_like(mask, self.gen())
        assert set(fake.flatten().tolist()) <= {0.0, float("-inf")}

    def test_positions_counting_up_are_kept(self):
        positions = torch.arange(3, 10)[None].repeat(2, 1)
        assert torch.equal(synthetic_like(positions, self.gen(), name="position_ids"), positions)
        assert torch.equal(synthetic_like(torch.tensor([7]), self.gen(), name="cache_position"), torch.tensor([7]))
        assert torch.equal(synthetic_like(torch.arange(6)[None], self.gen()), torch.arange(6)[None])

    def test_token_ids_counting_up_are_drawn_afresh(self):
        ids = torch.arange(40, 48)[None]
        for name in ("input_ids", None):  # by name, and by structure (a row that does not start at 0)
            fake = synthetic_like(ids, self.gen(), name=name)
            assert not torch.equal(fake, ids) and int(fake.min()) >= 40 and int(fake.max()) <= 47

    def test_one_token_is_drawn_within_the_bounds_given(self):
        draws = {
            int(synthetic_like(torch.tensor([[1]]), torch.Generator().manual_seed(s), name="input_ids", bounds=(0, 49)))
            for s in range(20)
        }
        assert len(draws) > 5 and draws <= set(range(50))  # {0, 1} token ids are no mask either
        wide = synthetic_like(torch.tensor([[3, 9, 4, 7]] * 16), self.gen(), name="input_ids", bounds=(0, 49))
        assert int(wide.min()) >= 3 and int(wide.max()) <= 9  # a tensor with a range of its own keeps to it

    def test_two_values_that_are_no_mask_are_drawn_afresh(self):
        x = torch.tensor([[3.5, 7.25, 3.5, 7.25]] * 8)
        assert not set(synthetic_like(x, self.gen()).flatten().tolist()) <= {3.5, 7.25}
        ids = torch.tensor([[12, 30, 30, 12]] * 8)
        fake = synthetic_like(ids, self.gen())
        assert not set(fake.flatten().tolist()) <= {12, 30} and int(fake.min()) >= 12 and int(fake.max()) <= 30

    def test_lowest_float_mask_keeps_its_two_values(self):
        low = torch.finfo(torch.float16).min
        mask = torch.triu(torch.full((6, 6), low, dtype=torch.float16), diagonal=1)
        assert set(synthetic_like(mask, self.gen()).flatten().tolist()) <= {0.0, low}

    def test_increasing_rows_stay_increasing(self):
        rows = torch.tensor([[0, 3, 3, 9, 20], [1, 2, 8, 8, 11]])
        fake = synthetic_like(rows, self.gen())
        assert bool((fake[:, 1:] >= fake[:, :-1]).all())
        assert bool((fake.min(dim=1).values >= rows.min(dim=1).values).all())
        assert bool((fake.max(dim=1).values <= rows.max(dim=1).values).all())
        assert not torch.equal(fake, rows)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
    def test_floats_keep_dtype_and_scale(self, dtype):
        x = (torch.randn(64, 64, generator=self.gen()) * 3 + 10).to(dtype)
        fake = synthetic_like(x, torch.Generator().manual_seed(1))
        assert fake.dtype == dtype and fake.shape == x.shape
        assert abs(float(fake.float().mean()) - 10) < 0.5 and abs(float(fake.float().std()) - 3) < 0.5
        assert not torch.equal(fake, x)

    @pytest.mark.parametrize(
        "dtype",
        [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.complex64],
    )
    @pytest.mark.parametrize("shape", [(1,), (3, 5)])
    def test_a_float_tensor_of_one_value_never_keeps_it(self, dtype, shape):
        value = 0.375 + 2j if dtype.is_complex else 0.375
        t = torch.full(shape, value, dtype=dtype)
        fake = synthetic_like(t, self.gen())
        wide = torch.complex128 if dtype.is_complex else torch.float64
        assert fake.dtype == dtype and fake.shape == t.shape
        assert not bool((fake.to(wide) == t.to(wide)).any())

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8])
    @pytest.mark.parametrize(("bounds", "allowed"), [(None, {6, 8}), ((7, 7), {6, 8}), ((3, 9), {3, 4, 5, 6, 8, 9})])
    def test_an_integer_tensor_of_one_value_never_keeps_it(self, dtype, bounds, allowed):
        t = torch.full((4, 6), 7, dtype=dtype)
        values = set(synthetic_like(t, self.gen(), bounds=bounds).flatten().tolist())
        assert values <= allowed and 7 not in values

    def test_rows_of_one_value_each_are_drawn_afresh(self):
        rows = torch.tensor([[5] * 8, [2] * 8])
        fake = synthetic_like(rows, self.gen())
        assert not torch.equal(fake[0], rows[0]) and not torch.equal(fake[1], rows[1])
        assert bool((fake[:, 1:] >= fake[:, :-1]).all()) and int(fake.min()) >= 2 and int(fake.max()) <= 5

    def test_empty_tensors_stay_empty(self):
        fake = synthetic_like(torch.empty(1, 2, 0, 4), self.gen())
        assert fake.shape == (1, 2, 0, 4)


# --------------------------------------------------------------------------- redacted bundles


def test_redacted_inputs_differ_but_keep_dtypes_shapes_and_ranges(original, redacted):
    before, after = load_bundle(original), load_bundle(redacted)
    pairs = list(zip(_inputs(before), _inputs(after)))
    assert pairs
    for (name, real), (name2, fake) in pairs:
        assert name == name2 and real.dtype == fake.dtype and real.shape == fake.shape
        if name == "input_ids":
            assert int(fake.min()) >= int(real.min()) and int(fake.max()) <= int(real.max())
            assert not torch.equal(real, fake)
        if name == "attention_mask":
            assert set(fake.flatten().tolist()) <= {0, 1}
        if name == "position_ids":
            assert bool((fake[:, 1:] > fake[:, :-1]).all())


def test_redacted_bundle_has_no_outputs_and_says_it_is_redacted(original, redacted):
    manifest = json.loads((redacted / "manifest.json").read_text("utf-8"))
    assert manifest["redacted"] == {"outputs_kept": False, "model_kept": False, "seed": 0}
    bundle = load_bundle(redacted)
    assert all(call.outputs is None for call in bundle.manifest.calls)
    assert bundle.verify() == []
    assert len(bundle.manifest.tensors) < len(load_bundle(original).manifest.tensors)  # outputs are gone
    assert bundle.infer_dynamic_shapes() == load_bundle(original).infer_dynamic_shapes()
    assert bundle.manifest.calls[0].cst_kwargs == load_bundle(original).manifest.calls[0].cst_kwargs


def test_keep_outputs_keeps_the_recorded_outputs(original, tmp_path):
    manifest = redact_bundle(original, tmp_path / "kept", keep_outputs=True)
    assert manifest.redacted is not None and manifest.redacted.outputs_kept
    before, after = load_bundle(original), load_bundle(tmp_path / "kept")
    for i in range(before.num_obs()):
        assert torch.equal(before.outputs(i), after.outputs(i))


def test_same_seed_same_bundle_other_seed_other_values(original, tmp_path):
    a = redact_bundle(original, tmp_path / "a", seed=1)
    b = redact_bundle(original, tmp_path / "b", seed=1)
    c = redact_bundle(original, tmp_path / "c", seed=2)
    assert a.files == b.files and a.files != c.files


def test_redact_reports_each_call_synthesized_then_written(original, tmp_path):
    events = []
    manifest = redact_bundle(original, tmp_path / "r", on_progress=events.append)
    n = len(manifest.calls)
    assert n == 2
    assert [(e.task, e.done, e.total) for e in events] == [("redact", i, n) for i in range(n + 1)] + [
        ("write", i, n) for i in range(n + 1)
    ]
    assert [e.detail for e in events if e.task == "write"][1:] == ["call 0", "call 1"]


def test_redact_refuses_a_non_empty_target(original, redacted):
    with pytest.raises(BundleExistsError, match="overwrite"):
        redact_bundle(original, redacted)


def test_keep_model_without_a_stored_model_says_so(original, tmp_path):
    with pytest.raises(ModelLoadError, match="stores no model"):
        redact_bundle(original, tmp_path / "x", keep_model=True)


def test_only_redacted_bundles_carry_the_field(original):
    # Other manifests are written as before the field existed, so older iobundle versions still read them.
    assert "redacted" not in json.loads((original / "manifest.json").read_text("utf-8"))
    assert load_bundle(original).manifest.redacted is None


def _tiny_llama():
    """A seeded one-layer Llama of vocabulary ``VOCAB``, built from a config."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=VOCAB,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_keep_model_keeps_config_and_weights(tmp_path):
    model = _tiny_llama()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=2):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    observer.save(tmp_path / "llama", include_model=True)
    dropped = redact_bundle(tmp_path / "llama", tmp_path / "no-model")
    kept = redact_bundle(tmp_path / "llama", tmp_path / "with-model", keep_model=True)
    assert dropped.model is None and not (tmp_path / "no-model" / "model").exists()
    assert kept.model is not None and kept.redacted is not None and kept.redacted.model_kept
    from iobundle.replay import load_bundle_model

    rebuilt = load_bundle_model(tmp_path / "with-model")
    assert torch.equal(rebuilt.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("include_model", [False, True], ids=["observed-range", "vocabulary"])
def test_no_generated_token_survives_redaction_at_batch_1(tmp_path, include_model):
    model = _tiny_llama()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=8):
        model.generate(torch.tensor([[3, 4, 5, 40]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    observer.save(tmp_path / "llama", include_model=include_model)
    redact_bundle(tmp_path / "llama", tmp_path / "redacted")

    def decode_ids(bundle):
        ids = [t for name, t in _inputs(bundle) if name == "input_ids"]
        assert len(ids) == 8 and ids[0].shape == (1, 4) and all(t.shape == (1, 1) for t in ids[1:])
        return torch.cat([t.flatten() for t in ids[1:]])

    real, fake = decode_ids(load_bundle(tmp_path / "llama")), decode_ids(load_bundle(tmp_path / "redacted"))
    assert not torch.equal(real, fake)  # the generated text is not spelled out (one draw may collide by chance)
    assert int(fake.min()) >= 0 and int(fake.max()) < VOCAB
    if not include_model:  # within what was observed over every call of input_ids, prompt included
        assert int(fake.min()) >= 3 and int(fake.max()) <= max(40, int(real.max()))


@pytest.mark.slow
def test_export_works_from_a_redacted_bundle_and_validate_says_nothing_to_compare(original, redacted, capsys):
    onnx_path = redacted.parent / "redacted.onnx"
    bundle = load_bundle(redacted)
    bundle.to_onnx(TokenModel(), onnx_path)  # token ids in range: the embedding lookups run
    report = bundle.export_report()
    assert report is not None and report.ok
    # No recorded outputs: each call of the exported program is checked against the eager model instead.
    assert [(c.success, c.reference) for c in report.calls] == [(True, "eager"), (True, "eager")]
    assert "2 without recorded outputs compared with the eager model" in report.summary()
    with pytest.raises(NothingToCompareError, match="nothing to compare"):
        validate_onnx(bundle._recorded(), onnx_path)
    assert main(["validate", str(redacted), str(onnx_path)]) == 4
    err = capsys.readouterr().err
    assert "nothing to compare the model's outputs against" in err
    # The same ONNX model validates against the original bundle.
    assert validate_onnx(load_bundle(original)._recorded(), onnx_path).ok


def test_constant_inputs_are_redacted_into_other_values(tmp_path):
    class Scaled(torch.nn.Module):
        def forward(self, x, scale, offset):
            return x * scale + offset.float().sum()

    model, observer = Scaled(), InputObserver()
    scale, offset = torch.full((1, 4), 0.125), torch.full((3,), 5, dtype=torch.int64)
    with observer(model):
        for n in (2, 3):
            model(torch.randn(n, 4), scale=scale, offset=offset)  # the same values in every call
    observer.save(tmp_path / "run.iobundle")
    redact_bundle(tmp_path / "run.iobundle", tmp_path / "out.iobundle")
    after = load_bundle(tmp_path / "out.iobundle")
    for name, t in _inputs(after):
        if name == "scale":
            assert t.dtype == torch.float32 and not bool((t == 0.125).any())
        elif name == "offset":
            assert t.dtype == torch.int64 and not bool((t == 5).any())
    assert {name for name, _ in _inputs(after)} == {"0", "scale", "offset"}
    files = b"".join(p.read_bytes() for p in (tmp_path / "out.iobundle" / "calls").iterdir())
    assert torch.full((1, 4), 0.125).numpy().tobytes() not in files  # not byte for byte either


def test_what_is_kept_verbatim_is_what_the_readme_lists(tmp_path):
    source = capture(tmp_path / "run.iobundle")
    manifest = json.loads((source / "manifest.json").read_text("utf-8"))
    manifest["producer"]["torch"] = "a private build"
    (source / "manifest.json").write_text(json.dumps(manifest), "utf-8")
    redact_bundle(source, tmp_path / "out.iobundle")
    before, after = load_bundle(source).manifest, load_bundle(tmp_path / "out.iobundle").manifest
    assert after.signature == before.signature
    assert [(c.status, c.latency, c.cst_kwargs, c.filled) for c in after.calls] == [
        (c.status, c.latency, c.cst_kwargs, c.filled) for c in before.calls
    ]
    assert after.producer.torch == torch.__version__ != before.producer.torch  # the redacting machine's
    kept = [
        name
        for (name, b), (_, a) in zip(_inputs(load_bundle(source)), _inputs(load_bundle(tmp_path / "out.iobundle")))
        if torch.equal(a, b)
    ]
    assert sorted(kept) == ["attention_mask", "position_ids", "position_ids"]  # an all-ones mask, two arange rows
