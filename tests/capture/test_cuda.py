"""CUDA capture: tensors recorded on the GPU land on CPU in the bundle. Skipped without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch

from iobundle import InputObserver, load_bundle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        y = x * 2
        return {"y": y, "cache": [y.sum(-1, keepdim=True)] if cache is None else [*cache, y.sum(-1, keepdim=True)]}


@pytest.mark.parametrize("stream", [False, True])
def test_cuda_calls_are_saved_on_cpu_bit_exactly(tmp_path, stream):
    model = Scale()
    observer = InputObserver()
    inputs = [torch.randn(2, 8, device="cuda"), torch.randn(3, 8, device="cuda", dtype=torch.bfloat16)]
    target = tmp_path / "b"
    with observer(model, stream_to=target if stream else None):
        out = model(inputs[0])
        model(inputs[1].float(), cache=out["cache"])
    if not stream:
        observer.save(target)
    bundle = load_bundle(target)
    assert bundle.manifest.producer.devices == ["cuda:0"]
    assert {e.device for e in bundle.manifest.tensors.values()} == {"cuda:0"}
    (x0,) = bundle.infer_arguments(0, flat=True)[:1]
    assert x0.device.type == "cpu"
    assert torch.equal(x0, inputs[0].cpu())
    assert torch.equal(bundle.outputs(1)["y"], (inputs[1].float() * 2).cpu())
    if not stream:  # in memory, the observer keeps what it saw on the device
        assert observer.infer_arguments(0, flat=True)[0].device.type == "cuda"


@pytest.mark.parametrize("writer", ["process", "auto", "thread"])
def test_cuda_decode_steps_streamed_by_each_writer_are_bit_exact(tmp_path, monkeypatch, writer):
    """The writer process takes a call's CUDA tensors in one packed copy per device (issue 27): bytes unchanged."""
    from iobundle.capture import _stream

    monkeypatch.setattr(_stream, "WRITER", writer)
    model, observer = Scale(), InputObserver()
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    inputs = [(torch.randn(2, 8 + i, device="cuda") * 10).to(dtypes[i % 4]) for i in range(6)]
    with observer(model, store_n_calls=6, stream_to=tmp_path / "b"):
        out = None
        for x in inputs:
            out = model(x.float(), cache=None if out is None else out["cache"])
            out["y"].mul_(3)  # changed after the call: the bundle keeps what the model returned
    bundle = load_bundle(tmp_path / "b")
    assert bundle.verify() == []
    for i, x in enumerate(inputs):
        assert torch.equal(bundle.outputs(i)["y"], (x.float() * 2).cpu())
