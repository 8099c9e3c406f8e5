"""onnxscript's optimizer without its O(nodes²) rewrite rules: the rules left out, put back, the same graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.replay.export._onnx_optimizer import linear_rewrite_rules

ort = pytest.importorskip("onnxruntime")
rewriter = pytest.importorskip("onnxscript.rewriter")


class Halves(torch.nn.Module):
    """Two slices of one input, its last axis cut in halves: the case onnxscript's SlicesSplit is about."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x[..., :4], x[..., 4:]
        return torch.cat((-second, first), dim=-1) * 2


def _op_types(path: str) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(path).graph.node]


def _run(path: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_linear_rewrite_rules_leaves_out_the_rules_with_several_outputs_and_puts_them_back():
    before = rewriter._DEFAULT_REWRITE_RULES
    assert any(r.name == "SlicesSplit" for r in before)
    with linear_rewrite_rules() as left_out:
        during = rewriter._DEFAULT_REWRITE_RULES
        assert left_out == ["SlicesSplit"]
        assert all(r._target_pattern.has_single_output_node for r in during)
        assert len(during) == len(before) - 1
    assert rewriter._DEFAULT_REWRITE_RULES is before


def test_linear_rewrite_rules_puts_the_rules_back_on_error():
    before = rewriter._DEFAULT_REWRITE_RULES
    with pytest.raises(RuntimeError, match="inside"), linear_rewrite_rules():
        raise RuntimeError("inside")
    assert rewriter._DEFAULT_REWRITE_RULES is before


def test_export_without_the_left_out_rule_gives_the_same_graph_and_outputs(tmp_path):
    """Two slices of one input cut in halves (what SlicesSplit is about): the graph plain ``torch.onnx.export``
    writes, op for op, and the same values bit for bit."""
    model = Halves().eval()
    x = torch.randn(2, 3, 8)
    plain = str(tmp_path / "plain.onnx")
    torch.onnx.export(model, (x,), plain, dynamo=True, verbose=False)
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=2):
        model(x)
        model(torch.randn(3, 5, 8))
    observer.save(tmp_path / "b.iobundle")
    bundle = load_bundle(tmp_path / "b.iobundle")
    ours = bundle.to_onnx(model, tmp_path / "ours.onnx")
    assert _op_types(ours) == _op_types(plain) == ["Slice", "Slice", "Neg", "Concat", "Mul"]
    np.testing.assert_array_equal(_run(ours, x.numpy()), _run(plain, x.numpy()))
    assert bundle.validate(ours).ok
