"""Complex arithmetic traced on real pairs (the ``complex_as_real`` export patch).

The eager tests run each rotary under the mode and compare with the same code run as written;
the export tests take modules that none of the zoo's families are (a precomputed complex
buffer indexed by positions, Meta's first Llama code; ``torch.complex`` then a product in the
other order) through ``torch.export``, ONNX and onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.fx.experimental._config as fx_config

from iobundle import InputObserver
from iobundle.replay.export._complex_pairs import ComplexAsPairs
from iobundle.replay.export._patches import export_patches

pytest.importorskip("onnxruntime")

DYNAMIC = torch.export.Dim.DYNAMIC


def _inverse_frequencies(dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))


def _deepseek_style(xq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``torch.polar`` frequencies, ``unsqueeze`` over the heads, ``view_as_real(x * f).flatten``."""
    freqs = positions[..., None].float() * _inverse_frequencies(xq.shape[-1])
    cis = torch.polar(torch.ones_like(freqs), freqs) * 1.0
    x = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    return torch.view_as_real(x * cis.unsqueeze(1).to(x.device)).flatten(3).type_as(xq)


def _llama4_style(xq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Heads on axis 2: the frequencies indexed ``[:, :, None, :]``."""
    freqs = positions[..., None].float() * _inverse_frequencies(xq.shape[-1])
    cis = torch.polar(torch.ones_like(freqs), freqs)
    x = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2)).transpose(1, 2)
    return torch.view_as_real(x * cis[:, :, None, :]).flatten(3).transpose(1, 2)


def _other_ops(xq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``torch.complex``, ``[..., None, :]``, ``expand``, ``conj``, a quotient, sums with numbers, ``cat``, reads."""
    angles = positions[..., None].float() * _inverse_frequencies(xq.shape[-1])
    cis = torch.complex(torch.cos(angles), torch.sin(angles))
    x = torch.view_as_complex(xq.unflatten(-1, (-1, 2)).contiguous())
    cis = cis[:, None, ...].expand(x.shape[0], x.shape[1], -1, -1)
    y = 2 * x * cis.conj() / (1 + 0.5j + cis.abs()[..., :1]) - x.real[..., :1]
    assert y.shape == x.shape and y.dtype == torch.complex64 and y.is_complex() and y.dim() == 4
    z = torch.cat([y, (1 - y).transpose(1, 2).transpose(1, 2)], dim=-1)
    return torch.cat([torch.view_as_real(z).flatten(-2), z.angle(), z.imag], dim=-1)


@pytest.mark.parametrize("rotary", [_deepseek_style, _llama4_style, _other_ops], ids=lambda f: f.__name__)
def test_complex_rotary_on_pairs_matches_torch(rotary: Callable[..., torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(0)
    xq = torch.randn(2, 3, 5, 8, generator=gen)
    positions = torch.arange(5)[None].expand(2, 5) + torch.tensor([[0], [3]])
    expected = rotary(xq, positions)
    mode = ComplexAsPairs()
    with mode:
        got = rotary(xq, positions)
    assert "view_as_complex" in mode.used and "mul" in mode.used
    assert not got.is_complex() and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


class _PolarFrequencies(torch.nn.Module):
    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[..., None].float() * torch.tensor([1.0, 0.1])
        return torch.view_as_real(torch.polar(torch.ones_like(freqs), freqs))


def test_polar_traced_as_written_bounds_the_length_and_on_pairs_does_not() -> None:
    # DeepSeek-V2's one program rejected its prefill this way: torch.polar copies its parts into
    # views of a complex tensor, and that copy_ adds a bound on the traced sizes.
    model, decode = _PolarFrequencies(), torch.arange(1)[None].expand(2, 1)
    shapes = ({0: DYNAMIC, 1: DYNAMIC},)
    with fx_config.patch(backed_size_oblivious=True):  # as when the prefill's cache is empty
        plain = torch.export.export(model, (decode,), dynamic_shapes=shapes)
        with ComplexAsPairs() as mode:
            paired = torch.export.export(model, (decode,), dynamic_shapes=shapes)
    prefill = torch.arange(5)[None].expand(1, 5)
    with pytest.raises(AssertionError, match=r"Guard failed: positions.size\(\)\[1\] <= 2"):
        plain.module()(prefill)
    assert mode.used == ["polar", "view_as_real"]
    torch.testing.assert_close(paired.module()(prefill), model(prefill), atol=1e-6, rtol=1e-6)


def test_an_op_not_translated_runs_on_the_complex_tensor() -> None:
    x = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(1))
    expected = torch.view_as_real(torch.exp(torch.view_as_complex(x) * 2))
    with ComplexAsPairs() as mode:
        product = torch.view_as_complex(x) * 2
        exp = torch.exp(product)  # no translation: the complex tensor the pair stands for
        got = torch.view_as_real(exp)
    assert exp.is_complex() and mode.used == ["view_as_complex", "mul", "view_as_real"]
    torch.testing.assert_close(got, expected)


def test_real_code_is_not_touched_nor_listed() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    x = torch.randn(3, 4)
    names: list[str] = []
    with export_patches(model, dynamic_batch=True, applied=names):
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: DYNAMIC},))
    assert names == []
    torch.testing.assert_close(ep.module()(x), model(x), atol=0, rtol=0)


class _PrecomputedRotary(torch.nn.Module):
    """Meta's first Llama code: a complex ``freqs_cis`` buffer from ``torch.polar``, indexed by the positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        angles = torch.outer(torch.arange(64).float(), _inverse_frequencies(8))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        xq = self.proj(x).view(batch, length, 2, 8)
        xq_ = torch.view_as_complex(xq.float().reshape(batch, length, 2, -1, 2))
        freqs = self.freqs_cis[positions].view(batch, length, 1, xq_.shape[-1])  # reshape_for_broadcast
        return torch.view_as_real(xq_ * freqs).flatten(3).type_as(x)


class _ComplexFirstRotary(torch.nn.Module):
    """``torch.complex`` of cosines and sines, the product written frequencies first, ``reshape`` back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("inv_freq", _inverse_frequencies(8), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, :, None, None].float() * self.inv_freq
        cis = torch.complex(torch.cos(angles), torch.sin(angles))
        heads = self.proj(x).unflatten(-1, (2, -1, 2))
        return torch.view_as_real(cis * torch.view_as_complex(heads)).reshape(x.shape)


def _calls(lengths: list[int], start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    calls, offset = [], start
    for length in lengths:
        positions = torch.arange(offset, offset + length)[None].expand(2, length).contiguous()
        calls.append((torch.randn(2, length, 16, generator=gen), positions))
        offset += length
    return calls


@pytest.mark.parametrize("make", [_PrecomputedRotary, _ComplexFirstRotary], ids=lambda c: c.__name__)
def test_complex_rotary_module_exports_to_onnx_and_validates(tmp_path: Path, make: type[torch.nn.Module]) -> None:
    model, observer = make().eval(), InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=4):
        for x, positions in _calls([5, 1, 1, 3]):
            model(x, positions)
    path = observer.to_onnx(model, tmp_path / "rotary.onnx", set_batch_dimension_for=True)
    report = observer.export_report()
    assert report is not None and report.ok and "complex_as_real" in report.patches
    rows = observer.check_discrepancies(path)
    assert [r["SUCCESS"] for r in rows] == [True] * 4
    assert max(float(r["abs"]) for r in rows) < 1e-5


def test_complex_rotary_module_fails_onnx_without_the_patch() -> None:
    # What the patch is for: the same program traced as written does not convert to ONNX.
    model = _PrecomputedRotary().eval()
    x, positions = _calls([5])[0]
    ep = torch.export.export(model, (x, positions), dynamic_shapes=({0: DYNAMIC, 1: DYNAMIC}, {0: DYNAMIC, 1: DYNAMIC}))
    with pytest.raises(Exception, match=r"aten\.index.*complex-valued input"):
        torch.onnx.export(ep, (), dynamo=True, verbose=False)
