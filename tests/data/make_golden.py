"""Write the golden bundles under ``tests/data/bundles/``: ``python tests/data/make_golden.py``.

The golden bundles are the compatibility contract of the format: ``tests/schema/test_golden.py``
loads them and checks what replay infers from them. Once committed they must keep loading
forever, so regenerate them only to add a bundle (or on purpose, with a format version bump),
never to make a failing test pass.

Each bundle is a few KB: tiny tensors from a fixed seed.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from iobundle import InputObserver

HERE = Path(__file__).parent / "bundles"


class MLP(torch.nn.Module):
    """An 8x8 MLP called positionally: ``forward(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Nested(torch.nn.Module):
    """Nested inputs: a dict of a tensor and a list of tensors, an optional kwarg, an int constant."""

    def forward(self, x, inputs, mask=None, *, n_heads: int = 1):
        y = x + inputs["bias"] + sum(t.sum() for t in inputs["extra"])
        if mask is not None:
            y = y * mask
        return {"y": y.reshape(y.shape[0], n_heads, -1), "parts": [y.sum(dim=-1)]}


def make_plain(path: Path) -> None:
    torch.manual_seed(0)
    model, observer = MLP(), InputObserver()
    with observer(model):
        model(torch.randn(2, 8))
        model(torch.randn(3, 8))
    observer.save(path, overwrite=True)


def make_nested(path: Path) -> None:
    torch.manual_seed(0)
    model, observer = Nested(), InputObserver()
    with observer(model):
        for batch in (2, 3, 4):
            inputs = {"bias": torch.randn(4), "extra": [torch.randn(batch, 3), torch.randn(5)]}
            if batch == 2:  # the first call has no mask: an absent kwarg
                model(torch.randn(batch, 4), inputs, n_heads=2)
            else:
                model(torch.randn(batch, 4), inputs, mask=torch.ones(batch, 4, dtype=torch.bool), n_heads=2)
    observer.save(path, overwrite=True)


def make_streamed(path: Path) -> None:
    """The plain MLP, written call by call while capturing (``stream_to``)."""
    torch.manual_seed(0)
    model, observer = MLP(), InputObserver()
    with observer(model, stream_to=path, overwrite=True):
        for batch in (1, 2, 3):
            model(torch.randn(batch, 8))


def make_llama_cache(path: Path) -> None:
    """A 1-layer Llama (hidden 8) during generate(): a DynamicCache, empty at prefill, and ModelOutputs."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=16, max_position_embeddings=32,
    )  # fmt: skip
    model, observer = transformers.LlamaForCausalLM(config).eval(), InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=3):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    observer.save(path, overwrite=True)


BUNDLES: dict[str, Callable[[Path], None]] = {
    "plain": make_plain,
    "nested": make_nested,
    "streamed": make_streamed,
    "llama_cache": make_llama_cache,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", default=sorted(BUNDLES), help=f"bundles to write (default: all of {sorted(BUNDLES)})"
    )
    parser.add_argument("--out", type=Path, default=HERE, help="parent directory (default: tests/data/bundles)")
    args = parser.parse_args(argv)
    for name in args.names:
        target = args.out / name
        if target.exists():
            shutil.rmtree(target)
        BUNDLES[name](target)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        print(f"wrote {target} ({size} bytes)")


if __name__ == "__main__":
    main()
