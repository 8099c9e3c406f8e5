"""Dimensions beyond the recorded calls: dynamic=, static-axis hints, the batch check after export."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.cli import main
from iobundle.errors import DynamicShapeError
from iobundle.replay import DYNAMIC

DYN = torch.export.Dim.DYNAMIC


class Tokens(torch.nn.Module):
    """Ids and a mask of one length, like a text model's inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids) * attention_mask[..., None]


@pytest.fixture
def bundle(tmp_path):
    model = Tokens().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for _ in range(2):  # the same shapes twice: nothing varies
            model(input_ids=torch.randint(0, 10, (3, 6)), attention_mask=torch.ones(3, 6, dtype=torch.long))
    observer.save(tmp_path / "tokens.iobundle")
    return load_bundle(tmp_path / "tokens.iobundle")


def test_dynamic_marks_axes_that_never_varied(bundle):
    assert bundle.infer_dynamic_shapes() == {"input_ids": {}, "attention_mask": {}}
    shapes = bundle.infer_dynamic_shapes(dynamic={"input_ids": {1}, 1: {-1}})  # a position, a negative axis
    assert shapes == {"input_ids": {1: DYN}, "attention_mask": {1: DYN}}
    both = bundle.infer_dynamic_shapes(True, dynamic={"input_ids": [1]})
    assert both == {"input_ids": {0: DYN, 1: DYN}, "attention_mask": {0: DYN}}


def test_dynamic_spec_marks_with_iobundle_dynamic_and_shapes_with_torchs(bundle):
    dynamic = {"input_ids": {1}, "attention_mask": {1}}
    spec = bundle.infer_dynamic_spec(True, dynamic=dynamic)
    assert spec == {"input_ids": {0: DYNAMIC, 1: DYNAMIC}, "attention_mask": {0: DYNAMIC, 1: DYNAMIC}}
    assert all(d is DYNAMIC for dims in spec.values() for d in dims.values())
    shapes = bundle.infer_dynamic_shapes(True, dynamic=dynamic)
    assert shapes == {"input_ids": {0: DYN, 1: DYN}, "attention_mask": {0: DYN, 1: DYN}}
    assert not any(isinstance(d, type(DYNAMIC)) for dims in shapes.values() for d in dims.values())
    named = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "sequence_length"},
    }
    assert bundle.infer_dynamic_spec(True, dim_names=True, dynamic=dynamic) == named
    assert bundle.infer_dynamic_shapes(True, dim_names=True, dynamic=dynamic) == named


def test_dynamic_errors_name_the_input_and_axis(bundle):
    with pytest.raises(DynamicShapeError, match=r"'labels'.*Inputs holding tensors: input_ids, attention_mask"):
        bundle.infer_dynamic_shapes(dynamic={"labels": {1}})
    with pytest.raises(DynamicShapeError, match="no tensor of 'input_ids' has axis 2"):
        bundle.infer_dynamic_shapes(dynamic={"input_ids": {2}})


def test_static_dim_hints_batch_and_sequence(bundle):
    hints = bundle.static_dim_hints()
    assert [(h.kind, h.size, h.axes) for h in hints] == [
        ("batch", 3, (("input_ids", 0), ("attention_mask", 0))),
        ("sequence", 6, (("input_ids", 1), ("attention_mask", 1))),
    ]
    assert "--dynamic input_ids:1 --dynamic attention_mask:1" in hints[1].message()
    assert bundle.static_dim_hints(True, dynamic={"input_ids": {1}, "attention_mask": {1}}) == []


def test_export_checks_another_batch_size(bundle):
    model = Tokens().eval()
    ep = bundle.export(model, set_batch_dimension_for=True, dynamic={"input_ids": {1}, "attention_mask": {1}})
    check = ep.report.batch_check
    assert (check.recorded_batch, check.batch, check.success) == (3, 2, True)
    assert check.abs_eager == 0.0 and check.abs_recorded == 0.0
    assert "batch 2 (call 0 cut from batch 3): ok" in check.summary()
    assert bundle.export(model).report.batch_check is None  # the batch is static: nothing to cut


class BatchCentred(torch.nn.Module):
    """Each row minus the batch's mean: a row's output depends on the other rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


def test_batch_check_says_when_the_eager_model_differs_from_the_recorded_rows():
    model = BatchCentred().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for length in (4, 5):
            model(torch.arange(3 * length, dtype=torch.float32).reshape(3, length) ** 2)
    check = observer.export(model, set_batch_dimension_for=True).report.batch_check
    assert (check.batch, check.success, check.abs_eager) == (2, True, 0.0)  # the program is the eager model
    assert check.rows_differ is not None and check.rows_differ == check.abs_recorded > 1
    assert check.stand_ins == []
    assert "differs from the recorded rows by" in check.summary()
    assert "depends on the other rows of the recorded batch" in check.summary()
    assert check.rows_differ_at is not None and f"(first at {check.rows_differ_at})" in check.summary()


def test_batch_check_is_silent_on_rows_when_they_agree(bundle):
    ep = bundle.export(Tokens().eval(), set_batch_dimension_for=True, dynamic={"input_ids": {1}, "attention_mask": {1}})
    check = ep.report.batch_check
    assert check.rows_differ is None and "recorded rows by" not in check.summary()


def test_cli_dynamic_flag_and_warnings(bundle, capsys):
    assert main(["shapes", str(bundle.path), "--json"]) == 0
    err = capsys.readouterr().err
    assert (
        "warning: the batch axes (input_ids axis 0, attention_mask axis 0) are 3 in every call" in err
        and "--dynamic input_ids:1" in err
    )
    assert (
        main(["shapes", str(bundle.path), "--json", "--batch-all", "--dynamic", "0:1", "--dynamic", "attention_mask:1"])
        == 0
    )
    captured = capsys.readouterr()
    assert '"1": "DYNAMIC"' in captured.out and "warning" not in captured.err
    assert main(["inspect", str(bundle.path)]) == 0
    assert "looks like a sequence length" in capsys.readouterr().err
    for bad in ("input_ids", "input_ids:x", "labels:1", "5:1"):
        assert main(["shapes", str(bundle.path), "--dynamic", bad]) == 2
        assert "--dynamic" in capsys.readouterr().err


class SliceCopy(torch.nn.Module):
    """Two parts copied into slices of an empty tensor, the way latent attention builds its keys."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        batch, _, length, dim = x.shape
        out = x.new_empty(batch, 2, length, 2 * dim)
        out[..., :dim].copy_(x.expand(-1, 2, -1, -1))
        out[..., dim:].copy_(y.expand(-1, 2, -1, -1))
        return out + z.sum()


def record_slice_copy(model: torch.nn.Module) -> InputObserver:
    # z of length 1 and 2 makes the export size-oblivious; the copies into slices then add the
    # minimum batch >= 2 and the first program refuses batch 1.
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for length in (1, 2):
            model(torch.randn(2, 1, 5, 3), torch.randn(2, 1, 5, 3), torch.ones(length))
    return observer


def test_a_guard_beyond_the_recorded_calls_is_explained_and_served_by_a_second_program():
    model = SliceCopy()
    observer = record_slice_copy(model)
    ep = observer.export(model, set_batch_dimension_for=True)
    check = observer.export_report().batch_check
    assert (check.batch, check.success, check.error) == (1, True, None)
    assert check.refused == "AssertionError: Guard failed: x.size()[0] >= 2"
    assert check.assumption.startswith("the program assumes axis 0 of x >= 2: a minimum bound torch.export added")
    assert (
        check.assumption in check.summary() and "served by a second program traced from these inputs" in check.summary()
    )
    assert check.remedy is None and check.tried == [
        "layout_copies_every_rank: still refused (AssertionError: Guard failed: x.size()[0] >= 2)",
        "a second program traced from these inputs: served",
    ]
    assert check.split == {
        "first": [{"of": [["x", 0]], "op": ">=", "value": 2}],
        "second": [{"of": [["x", 0]], "op": "<", "value": 2}],
    }
    # export_program returns the first program (it refuses batch 1); the second serves batch 1.
    x, y, z = torch.randn(1, 1, 5, 3), torch.randn(1, 1, 5, 3), torch.ones(2)
    with pytest.raises(AssertionError, match="Guard failed"):
        ep.program.module()(x, y, z)
    torch.testing.assert_close(ep.split.program.module()(x, y, z), model(x, y, z), atol=0, rtol=0)


def test_the_split_of_a_size_oblivious_bound_validates_both_batches_in_onnxruntime(tmp_path):
    model = SliceCopy()
    record_slice_copy(model).save(tmp_path / "slices.iobundle")
    result = load_bundle(tmp_path / "slices.iobundle").export_programs(model, set_batch_dimension_for=True)
    assert [(p.phase.name, p.phase.calls, p.split_of) for p in result.programs] == [
        ("p0", (0, 1), None),
        ("p1", (), "p0"),
    ]
    index = result.to_onnx(tmp_path / "slices.onnx")
    other = InputObserver()  # batch 1 and 2, lengths of z never traced
    with torch.no_grad(), other(model):
        for batch in (1, 2, 1):
            model(torch.randn(batch, 1, 5, 3), torch.randn(batch, 1, 5, 3), torch.ones(3))
    rows = other.check_discrepancies(index)
    assert [(r["index"], r["program"], r["SUCCESS"]) for r in rows] == [
        (0, "p1", True),
        (1, "p0", True),
        (2, "p1", True),
    ]


class TokenScores(torch.nn.Module):
    """Per-token scores transposed to (experts, tokens) and flattened, the way mixture-of-experts routing weighs tokens.

    ``rows=True`` scores the last position of each row instead: a (batch, experts) tensor.
    Whether the transposed scores are a view when flattened depends on there being one token
    (one row): traced from a decode step of a batch of 2, torch.export guards that number != 1.
    """

    def __init__(self, how: str, rows: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.score = torch.nn.Linear(4, 3)
        self.how, self.rows = how, rows

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        tokens = x[:, -1, :] if self.rows else x.reshape(-1, 4)
        scores = self.score(tokens)
        if self.how == "reshape":
            flat = scores.transpose(0, 1).reshape(-1)
        elif self.how == "flatten":
            flat = scores.t().flatten()
        else:
            flat = scores.t().contiguous().view(-1)
        out = flat.view(3, -1).t()
        out = out[:, None, :] if self.rows else out.reshape(x.shape[0], x.shape[1], 3)
        return out if past is None else torch.cat([past, out], dim=1)


def record_decode(model: torch.nn.Module) -> InputObserver:
    """A prefill of a batch of 2 (no ``past``), then two decode steps of one token each."""
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        past = model(torch.randn(2, 5, 4))
        for _ in range(2):
            past = model(torch.randn(2, 1, 4), past)
    return observer


@pytest.mark.parametrize(
    ("how", "rows", "guard"),
    [
        ("reshape", False, "x.size()[1] * x.size()[0] != 1"),
        ("flatten", False, "x.size()[1] * x.size()[0] != 1"),
        ("contiguous", False, "x.size()[1] * x.size()[0] != 1"),
        ("flatten", True, "x.size()[0] != 1"),
    ],
)
def test_a_batch_refused_on_a_guard_is_served_by_a_remedy(how, rows, guard):
    model = TokenScores(how, rows).eval()
    observer = record_decode(model)
    ep = observer.export(model, set_batch_dimension_for=True)
    report = observer.export_report()
    check = report.batch_check
    assert report.ok and len(report.calls) == 3  # every recorded call still reproduces
    assert (check.batch, check.success, check.remedy) == (1, True, "layout_copies_every_rank")
    assert check.refused == f"AssertionError: Guard failed: {guard}"
    assert check.assumption.endswith("taken for the size the trace saw") and "!= 1" in check.assumption
    assert check.tried == ["layout_copies_every_rank: served"]
    assert "ok (max abs vs eager 0" in check.summary() and "served by re-exporting with the remedy" in check.summary()
    assert any(option.startswith("remedy layout_copies_every_rank: ") for option in report.options)
    # The refused size, served: at batch 1 (one token, and several) the program is the eager model.
    with torch.no_grad():
        for length in (1, 3):
            x, past = torch.randn(1, length, 4), torch.randn(1, 6, 3)
            torch.testing.assert_close(ep.program.module()(x, past), model(x, past), atol=0, rtol=0)


BRANCH = textwrap.dedent(
    """
    import torch

    class OneTokenPath(torch.nn.Module):
        # A fast path of the model's own code for a single token: if batch * length == 1.

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, h, past=None):
            if h.shape[0] * h.shape[1] == 1:
                out = self.proj(h.reshape(4)).reshape(1, 1, 4)
            else:
                out = self.proj(h)
            out = out[:, -1:, :]
            return out if past is None else out + past

    def build():
        return OneTokenPath().eval()
    """
)


@pytest.fixture
def one_token_path(tmp_path, monkeypatch):
    """``guards.py`` (``guards:build``, for ``--model``) in ``tmp_path``, the working directory, and its module."""
    (tmp_path / "guards.py").write_text(BRANCH)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import guards

    yield guards
    sys.modules.pop("guards", None)


def test_a_branch_of_the_models_code_is_served_by_a_second_program(one_token_path, capsys):
    model = one_token_path.build()
    observer = record_decode(model)
    ep = observer.export(model, set_batch_dimension_for=True)
    report = observer.export_report()
    check = report.batch_check
    assert report.ok and len(report.calls) == 3  # the first program serves every recorded call
    assert (check.success, check.remedy, check.error) == (True, None, None)
    assert check.refused == "AssertionError: Guard failed: h.size()[1] * h.size()[0] != 1"
    assert check.tried == [
        "layout_copies_every_rank: still refused (AssertionError: Guard failed: h.size()[1] * h.size()[0] != 1)",
        "a second program traced from these inputs: served",
    ]
    assert check.split == {
        "first": [{"of": [["h", 1], ["h", 0]], "op": "!=", "value": 1}],
        "second": [{"of": [["h", 1], ["h", 0]], "op": "==", "value": 1}],
    }
    one = (torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    with pytest.raises(AssertionError, match="Guard failed"):
        ep.program.module()(*one)
    torch.testing.assert_close(ep.split.program.module()(*one), model(*one), atol=0, rtol=0)
    observer.save("one_token.iobundle")
    export = ["export", "one_token.iobundle", "--model", "guards:build", "--batch-all", "-o", "one_token.onnx"]
    code = main([*export, "--report", "one_token.json"])
    out = capsys.readouterr().out
    assert code == 0 and "2 programs, split by the sizes a program refused" in out, out
    assert "program p1: no recorded call (every structure of the calls; sizes: axis 1 of h * axis 0 of h == 1)" in out
    index = json.loads(Path("one_token.programs.json").read_text())
    assert index["format_version"] == 2
    assert [(p["name"], p["calls"], p["sizes"]) for p in index["programs"]] == [
        ("p0", [0, 1, 2], [{"of": [["h", 1], ["h", 0]], "op": "!=", "value": 1}]),
        ("p1", [], [{"of": [["h", 1], ["h", 0]], "op": "==", "value": 1}]),
    ]
    written = json.loads(Path("one_token.json").read_text())["programs"]
    assert [(p["name"], p["split_of"]) for p in written] == [("p0", None), ("p1", "p0")]
    assert written[0]["batch_check"]["split"]["second"] == [{"of": [["h", 1], ["h", 0]], "op": "==", "value": 1}]
    # A batch of 1 token goes to the second program, a batch of 2 to the first: both equal the eager model.
    other = InputObserver()
    with torch.no_grad(), other(model):
        model(*one)
        model(torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    other.save("other.iobundle")
    assert main(["validate", "other.iobundle", "one_token.programs.json"]) == 0
    table = capsys.readouterr().out
    assert [line.split()[:3] for line in table.splitlines() if line.strip()[:1].isdigit()] == [
        ["0", "p1", "ok"],
        ["1", "p0", "ok"],
    ]


def test_a_call_no_size_rule_serves_is_a_clear_error(one_token_path, capsys):
    model = one_token_path.build()
    record_decode(model).save("one_token.iobundle")
    assert main(["export", "one_token.iobundle", "--model", "guards:build", "--batch-all", "-o", "t.onnx", "-q"]) == 0
    index = json.loads(Path("t.programs.json").read_text())
    index["programs"] = index["programs"][:1]  # without the program of one token
    Path("t.programs.json").write_text(json.dumps(index))
    other = InputObserver()
    with torch.no_grad(), other(model):
        model(torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    rows = other.check_discrepancies("t.programs.json")
    assert rows[0]["SUCCESS"] is False and rows[0]["program"] is None
    assert rows[0]["error"] == (
        "no program of t.programs.json serves call 0 (every input present; its sizes meet no size rule: "
        "p0: axis 1 of h * axis 0 of h != 1); programs: p0"
    )


class SquarePath(torch.nn.Module):
    """A branch of the model's own code on a relation of two sizes: ``if batch == length``."""

    def forward(self, h: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        out = h.sum(dim=1, keepdim=True) if h.shape[0] == h.shape[1] else h.mean(dim=1, keepdim=True)
        return out if past is None else out + past


def test_a_guard_relating_two_sizes_beyond_the_recorded_calls_is_served_by_a_second_program():
    model = SquarePath().eval()
    observer = record_decode(model)
    ep = observer.export(model, set_batch_dimension_for=True)
    check = observer.export_report().batch_check
    assert (check.batch, check.success, check.remedy) == (1, True, None)
    assert check.split == {
        "first": [{"of": [["h", 0], ["h", 1]], "op": "!=", "value": 0, "expr": "s0 - s1"}],
        "second": [{"of": [["h", 0], ["h", 1]], "op": "==", "value": 0, "expr": "s0 - s1"}],
    }
    h, past = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    torch.testing.assert_close(ep.splits[0].program.module()(h, past), model(h, past), atol=0, rtol=0)


class MaxPath(SquarePath):
    """A branch on the larger of two sizes, which no size rule expresses: ``if max(batch, length) == 1``."""

    def forward(self, h: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        out = h.sum(dim=1, keepdim=True) if max(h.shape[0], h.shape[1]) == 1 else h.mean(dim=1, keepdim=True)
        return out if past is None else out + past


def test_a_guard_neither_a_remedy_nor_a_second_program_serves_is_said_plainly():
    model = MaxPath().eval()
    observer = record_decode(model)
    observer.export(model, set_batch_dimension_for=True)
    report = observer.export_report()
    check = report.batch_check
    assert report.ok and (check.success, check.remedy, check.split) == (False, None, None)
    assert check.error.startswith("AssertionError: Guard failed: ") and "h.size()[1]" in check.error
    assert len(check.tried) == 2 and check.tried[1].startswith("a second program: no size rule to split on (the guard ")
    assert "max(" in check.tried[1] and "uses what a size rule has not" in check.tried[1]
    assert "none serves it, the first program is kept" in check.summary()


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        ("Guard failed: position_ids.size()[0] >= 2", "the program assumes axis 0 of position_ids >= 2: a minimum"),
        ("Guard failed: x.size()[1] * x.size()[0] != 1", "the program assumes axis 1 of x * axis 0 of x != 1: a prod"),
        ("Guard failed: x.size()[0] != 1", "the program assumes axis 0 of x != 1: a size that was not 1"),
        ("Guard failed: cache['key_0'].size()[0] == 2", "the program assumes axis 0 of cache['key_0'] == 2: a size"),
        ("Guard failed: x.size()[1] <= y.size()[1] + 1", "the program assumes axis 1 of x <= axis 1 of y + 1: a rel"),
    ],
)
def test_explain_guard_names_the_assumption(guard, expected):
    from iobundle.replay.export import explain_guard

    assert explain_guard(f"AssertionError: {guard}", 2).startswith(expected)
    assert explain_guard("RuntimeError: shapes differ", 2) is None


def test_the_program_a_remedy_serves_runs_the_refused_batch_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = TokenScores("reshape").eval()
    observer = record_decode(model)
    path = observer.to_onnx(model, tmp_path / "scores.onnx", set_batch_dimension_for=True)
    assert observer.export_report().batch_check.remedy == "layout_copies_every_rank"
    assert all(row["SUCCESS"] for row in observer.check_discrepancies(path))  # every recorded call
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    with torch.no_grad():
        for length in (1, 3):
            x, past = torch.randn(1, length, 4), torch.randn(1, 6, 3)
            (got,) = session.run(None, dict(zip(names, [x.numpy(), past.numpy()])))
            torch.testing.assert_close(torch.from_numpy(got), model(x, past), atol=1e-6, rtol=1e-5)
