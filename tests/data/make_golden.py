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
import time
from collections.abc import Callable
from pathlib import Path

import torch

from iobundle import InputObserver
from iobundle.schema import FORMAT_VERSION

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


class Growing(torch.nn.Module):
    """A decoder step in miniature: a per-layer cache and a mask that grow by one position per call."""

    def forward(self, x, past, mask):
        new = [torch.cat([p, x.reshape(1, 1, 1, -1).expand(1, 2, 1, 4)], dim=2) for p in past]
        return {"y": x * mask.sum(), "past": new}


def make_growing(path: Path) -> None:
    """Format version 2: the cache and the mask of each call after the first stored as extensions."""
    torch.manual_seed(0)
    model, observer = Growing(), InputObserver()
    past = [torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)]
    with observer(model, store_n_calls=4):
        for n in (2, 3, 4, 5):
            out = model(torch.randn(4), past, torch.ones(1, n, dtype=torch.int64))
            past = out["past"]
    observer.save(path, overwrite=True)


def make_journal(path: Path) -> None:
    """Format version 2: the growing model streamed, as a killed writer leaves it (journal.jsonl, no manifest)."""
    from iobundle.schema import load_manifest

    torch.manual_seed(0)
    model, observer = Growing(), InputObserver()
    past = [torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)]
    tmp = path.with_name(path.name + ".tmp")
    with observer(model, store_n_calls=3, stream_to=tmp, overwrite=True):
        for n in (2, 3, 4):
            past = model(torch.randn(4), past, torch.ones(1, n, dtype=torch.int64))["past"]
        while len(load_manifest(tmp).calls) < 3:  # the writer appends the last call's line
            time.sleep(0.01)
        shutil.copytree(tmp, path)  # the stream is still open: no manifest.json yet
    shutil.rmtree(tmp)


def make_compact_nested(path: Path) -> None:
    """Format version 3: the nested model (two call structures, constants, dicts) plus value_if_missing."""
    torch.manual_seed(1)
    model, observer = Nested(), InputObserver(value_if_missing={"mask": torch.zeros(2, 4, dtype=torch.bool)})
    with observer(model):
        for batch in (2, 3, 4):
            inputs = {"bias": torch.randn(4), "extra": [torch.randn(batch, 3), torch.randn(5)]}
            if batch == 2:
                model(torch.randn(batch, 4), inputs, n_heads=2)
            else:
                model(torch.randn(batch, 4), inputs, mask=torch.ones(batch, 4, dtype=torch.bool), n_heads=2)
    observer.save(path, overwrite=True)


def make_compact_growing(path: Path) -> None:
    """Format version 3: the growing model (one structure, caches stored as extensions)."""
    make_growing(path)


def make_compact_journal(path: Path) -> None:
    """Format version 3: the growing model streamed, as a killed writer leaves it (journal.jsonl, no manifest)."""
    make_journal(path)


def make_segments_nested(path: Path) -> None:
    """Format version 4: the nested model; every call's tensors are ranges of one segment, value_if_missing its own file."""
    make_compact_nested(path)


def make_segments_growing(path: Path) -> None:
    """Format version 4: the growing model; the caches, stored as extensions, are ranges of one segment."""
    make_growing(path)


def make_segments_journal(path: Path) -> None:
    """Format version 4: the growing model streamed, as a killed writer leaves it: journal.jsonl, no manifest,
    and half of a fourth call's range appended to the segment past what the journal lists."""
    make_journal(path)
    with (path / "calls" / "segment-000000.bin").open("ab") as f:
        f.write(bytes(range(40)))


def make_segments_model(path: Path) -> None:
    """Format version 4, self-contained: the 1-layer Llama of ``llama_cache`` called twice, stored with
    include_model (model/config.json and model/weights.safetensors), written before a config could hold inf."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=16, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    model, observer = transformers.LlamaForCausalLM(config).eval(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)
        model(torch.tensor([[4, 5, 6, 7, 8]]), use_cache=False)
    observer.save(path, overwrite=True, include_model=True)


def make_autocast(path: Path) -> None:
    """Format version 5: the MLP (float32 weights) called under ``torch.autocast("cpu", bfloat16)`` twice, then once
    without: the first two calls record the autocast state (their outputs are bfloat16), the third none."""
    torch.manual_seed(0)
    model, observer = MLP(), InputObserver()
    with torch.no_grad(), observer(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))
            model(torch.randn(3, 8))
        model(torch.randn(4, 8))
    observer.save(path, overwrite=True)


def make_sealed_nested(path: Path) -> None:
    """Format version 6: the nested model; the segment is a safetensors file (its header sealed at save)."""
    make_compact_nested(path)


def make_sealed_growing(path: Path) -> None:
    """Format version 6: the growing model; its sealed segment holds the caches' new parts, named by call and path."""
    make_growing(path)


def make_sealed_journal(path: Path) -> None:
    """Format version 6: the growing model streamed, as a killed writer leaves it: journal.jsonl, no manifest, an
    unsealed segment (header length 0), and half of a fourth call's range appended past what the journal lists."""
    make_journal(path)
    with (path / "calls" / "segment-000000.bin").open("ab") as f:
        f.write(bytes(range(40)))


def make_sealed_llama(path: Path) -> None:
    """Format version 6: the 1-layer Llama of ``llama_cache`` streamed during generate() (3 new tokens), closed."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=16, max_position_embeddings=32,
    )  # fmt: skip
    model, observer = transformers.LlamaForCausalLM(config).eval(), InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=3, stream_to=path, overwrite=True):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)


BUNDLES: dict[str, Callable[[Path], None]] = {
    # format version 1: written before version 2 existed; this script cannot write them again
    "plain": make_plain,
    "nested": make_nested,
    "streamed": make_streamed,
    "llama_cache": make_llama_cache,
    # format version 2: likewise, since version 3
    "growing": make_growing,
    "journal": make_journal,
    # format version 3: likewise, since version 4
    "compact_nested": make_compact_nested,
    "compact_growing": make_compact_growing,
    "compact_journal": make_compact_journal,
    # format version 4: likewise, since version 5
    "segments_nested": make_segments_nested,
    "segments_growing": make_segments_growing,
    "segments_journal": make_segments_journal,
    "segments_model": make_segments_model,
    # format version 5: likewise, since version 6
    "autocast": make_autocast,
    # format version 6
    "sealed_nested": make_sealed_nested,
    "sealed_growing": make_sealed_growing,
    "sealed_journal": make_sealed_journal,
    "sealed_llama": make_sealed_llama,
}
OLDER = (
    {name: 1 for name in ("plain", "nested", "streamed", "llama_cache")}
    | {"growing": 2, "journal": 2}
    | {name: 3 for name in ("compact_nested", "compact_growing", "compact_journal")}
    | {name: 4 for name in ("segments_nested", "segments_growing", "segments_journal", "segments_model")}
    | {"autocast": 5}
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"bundles to write, among {sorted(BUNDLES)} (default: those missing)")
    parser.add_argument("--out", type=Path, default=HERE, help="parent directory (default: tests/data/bundles)")
    args = parser.parse_args(argv)
    names = args.names or [n for n in BUNDLES if not (args.out / n).exists()]
    for name in names:
        if name in OLDER:
            raise SystemExit(
                f"{name} is a format-version-{OLDER[name]} bundle: this iobundle writes version {FORMAT_VERSION}. "
                "Keep the committed one."
            )
        target = args.out / name
        if target.exists():
            shutil.rmtree(target)
        BUNDLES[name](target)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        print(f"wrote {target} ({size} bytes)")


if __name__ == "__main__":
    main()
