"""Dimensions beyond the recorded calls: dynamic=, static-axis hints, the batch check after export."""

from __future__ import annotations

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
    check = ep.iobundle_report.batch_check
    assert (check.recorded_batch, check.batch, check.success) == (3, 2, True)
    assert check.abs_eager == 0.0 and check.abs_recorded == 0.0
    assert "batch 2 (call 0 cut from batch 3): ok" in check.summary()
    assert bundle.export(model).iobundle_report.batch_check is None  # the batch is static: nothing to cut


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


def test_a_guard_beyond_the_recorded_calls_is_explained():
    # z of length 1 and 2 makes the export size-oblivious; the copies into slices then add the
    # minimum batch >= 2 and the program refuses batch 1.
    model = SliceCopy()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for length in (1, 2):
            model(torch.randn(2, 1, 5, 3), torch.randn(2, 1, 5, 3), torch.ones(length))
    observer.export(model, set_batch_dimension_for=True)
    check = observer.export_report().batch_check
    assert (check.batch, check.success, check.error) == (1, False, "AssertionError: Guard failed: x.size()[0] >= 2")
    assert check.assumption.startswith("the program assumes axis 0 of x >= 2: a minimum bound torch.export added")
    assert check.assumption in check.summary()


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        ("Guard failed: position_ids.size()[0] >= 2", "the program assumes axis 0 of position_ids >= 2: a minimum"),
        ("Guard failed: cache['key_0'].size()[0] == 2", "the program assumes axis 0 of cache['key_0'] == 2: a size"),
        ("Guard failed: x.size()[1] <= y.size()[1] + 1", "the program assumes axis 1 of x <= axis 1 of y + 1: a rel"),
    ],
)
def test_explain_guard_names_the_assumption(guard, expected):
    from iobundle.replay.export import explain_guard

    assert explain_guard(f"AssertionError: {guard}", 2).startswith(expected)
    assert explain_guard("RuntimeError: shapes differ", 2) is None
