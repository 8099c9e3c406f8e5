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
