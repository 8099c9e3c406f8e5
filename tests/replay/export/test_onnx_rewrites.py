"""The rewrites of an exported graph before ``torch.onnx.export``: each one needed, and the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iobundle.replay.export._onnx_rewrites import rewrite_for_onnx

ort = pytest.importorskip("onnxruntime")

DYNAMIC = torch.export.Dim.DYNAMIC


class InvertedMask(torch.nn.Module):
    """ProphetNet-style: ``1.0 - mask`` of an integer mask, scaled to the additive bias of the scores."""

    def forward(self, mask: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = (1.0 - mask[:, None, None, :].repeat(1, 4, 1, 1)) * torch.finfo(torch.float32).min
        return scores + bias, torch.rsub(mask, 1.5, alpha=2)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]])
    return mask, torch.randn(2, 4, 1, 7, generator=torch.Generator().manual_seed(0))


def _export(model: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    return torch.export.export(model, args, dynamic_shapes=tuple({0: DYNAMIC} for _ in args))


def test_rsub_of_an_integer_mask_fails_to_convert_without_the_rewrite() -> None:
    with pytest.raises(Exception, match="decompose"):
        torch.onnx.export(_export(InvertedMask(), _inputs()), (), dynamo=True, verbose=False)


def test_rsub_of_an_integer_mask_rewritten_converts_with_the_same_values() -> None:
    model, args = InvertedMask(), _inputs()
    ep = _export(model, args)
    assert rewrite_for_onnx(ep) == [
        "aten.rsub.Scalar of an integer tensor -> aten.rsub.Scalar of its torch.float32 cast"
    ]
    for got, want in zip(ep.module()(*args), model(*args)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    program = torch.onnx.export(ep, (), dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    mask, scores = torch.ones(3, 7, dtype=torch.long), torch.randn(3, 4, 1, 7)  # another batch, too
    mask[1, :3] = 0
    feeds = {i.name: v.numpy() for i, v in zip(session.get_inputs(), (mask, scores))}
    for got, want in zip(session.run(None, feeds), model(mask, scores)):
        np.testing.assert_array_equal(got, want.numpy())


def test_rsub_of_a_float_tensor_is_left_as_it_is() -> None:
    class FloatMask(torch.nn.Module):
        def forward(self, mask: torch.Tensor) -> torch.Tensor:
            return 1.0 - mask.float()

    ep = _export(FloatMask(), (torch.ones(2, 3, dtype=torch.long),))
    assert rewrite_for_onnx(ep) == []


class CrossMask(torch.nn.Module):
    """Mllama-style: ``(1.0 - mask).to(dtype)`` of an integer cross-attention mask."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * (1.0 - mask).to(x.dtype)


def test_rsub_rewrite_is_on_the_export_report_and_the_onnx_file_validates(tmp_path) -> None:
    from iobundle import InputObserver, load_bundle

    model, observer = CrossMask().eval(), InputObserver()
    with torch.no_grad(), observer(model):
        for rows in (2, 3):
            model(torch.randn(rows, 4), torch.randint(-2, 3, (rows, 4)))
    observer.save(tmp_path / "mask.iobundle")
    bundle = load_bundle(tmp_path / "mask.iobundle")
    path = bundle.to_onnx(CrossMask().eval(), tmp_path / "mask.onnx")
    assert (
        "rewritten for ONNX: aten.rsub.Scalar of an integer tensor -> aten.rsub.Scalar of its torch.float32 cast"
        in bundle.export_report().options
    )
    rows = bundle.check_discrepancies(path, atol=0.0, rtol=0.0)
    assert [(r["index"], r["SUCCESS"]) for r in rows] == [(0, True), (1, True)]


class TrainingNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3)
        with torch.no_grad():  # running statistics far from any batch's
            self.norm.running_mean.fill_(5.0)
            self.norm.running_var.fill_(9.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * 2


def test_a_batch_norm_in_training_mode_converts_with_the_batch_statistics() -> None:
    model, x = TrainingNorm().train(), torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(0))
    ep = _export(model, (x,))
    assert rewrite_for_onnx(ep) == [
        "aten.batch_norm in training mode -> the batch's statistics (no running statistics)"
    ]
    assert rewrite_for_onnx(torch.export.export(TrainingNorm().eval(), (x,))) == []  # eval mode: left as it is
    program = torch.onnx.export(ep, (), dynamo=True, verbose=False)  # without the rewrite: the running statistics
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (4, 7):  # another batch, too
        x = torch.randn(rows, 3, 6)
        with torch.no_grad():
            want = TrainingNorm().train()(x)
        np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], want.numpy(), atol=1e-5)
