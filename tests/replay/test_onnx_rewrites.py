"""Rewrites of an exported program before torch.onnx.export: each op the exporter cannot convert, and its value kept."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, load_bundle

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")


class InvertedMask(torch.nn.Module):
    """``1.0 - mask`` on an integer mask, as Mllama's cross-attention mask is inverted."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        inverted = (1.0 - mask).to(x.dtype)
        return x * inverted + (2.5 - (mask > 0).to(torch.int32))


def _recorded_bundle(tmp_path):
    model = InvertedMask().eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        for rows in (2, 3):
            model(torch.randn(rows, 4), torch.randint(-2, 3, (rows, 4)))
    observer.save(tmp_path / "mask.iobundle")
    return load_bundle(tmp_path / "mask.iobundle")


def test_rsub_of_an_integer_tensor_exports_and_validates(tmp_path):
    bundle = _recorded_bundle(tmp_path)
    path = bundle.to_onnx(InvertedMask().eval(), tmp_path / "mask.onnx")
    report = bundle.export_report()
    assert "rewritten for ONNX: aten.rsub.Scalar of an integer tensor: the tensor cast to the result's dtype first" in (
        report.options
    )
    rows = bundle.check_discrepancies(path, atol=0.0, rtol=0.0)
    assert [(r["index"], r["SUCCESS"]) for r in rows] == [(0, True), (1, True)]


def test_rsub_rewrite_keeps_the_program_s_values():
    from iobundle.replay.export._onnx_rewrites import rewrite_for_onnx

    x, mask = torch.randn(3, 4), torch.tensor([[0, 1, 2, -3]] * 3)
    ep = torch.export.export(InvertedMask(), (x, mask))
    assert rewrite_for_onnx(ep) == [
        "aten.rsub.Scalar of an integer tensor: the tensor cast to the result's dtype first"
    ]
    casts = [n for n in ep.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert [c.kwargs["dtype"] for c in casts] == [torch.float32, torch.float32]
    torch.testing.assert_close(ep.module()(x, mask), InvertedMask()(x, mask), atol=0.0, rtol=0.0)
    assert rewrite_for_onnx(ep) == []  # the float tensors need no second cast


def test_torch_onnx_still_fails_on_the_rsub_the_rewrite_removes(tmp_path):
    # When torch.onnx converts it by itself, this rewrite can go.
    ep = torch.export.export(InvertedMask(), (torch.randn(3, 4), torch.ones(3, 4, dtype=torch.long)))
    with pytest.raises(Exception, match="Failed to decompose the FX graph"):
        torch.onnx.export(ep, (), tmp_path / "plain.onnx", dynamo=True, verbose=False)
