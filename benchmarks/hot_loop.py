"""What recording costs the model's thread in a decode loop with no compute, in CPU time: a quick A/B.

A "model" that only grows a ``DynamicCache`` of ``--layers`` layers by one position per call (no compute),
called as ``generate()`` calls it, plain and streamed to a bundle by ``InputObserver``: the recording
CPU per decode call is the thread's CPU time of the recorded loop minus the plain one's. Each checkout
given with ``--tree`` runs in its own interpreter (that tree first on ``sys.path``), the rounds alternate
between checkouts, and each checkout's median is reported, with its ratio to the first.

Without the model's compute between calls, what recording touches stays in the processor's caches:
it costs less here than beside a real model (at 32 layers, about 630 µs per call against the
750-1000 of figure 1f's recording on the model's thread, on the 2-core VM), but the figure moves by a few
percent from one run to the next where figure 1f's moves by 30 % (at 2 layers, a quarter of a millisecond a
call, by 5 % or so: a smaller change needs timers around the steps). Half a minute per checkout; use it to
tell whether a change to the recording path helps, then confirm with figure 1f.

    .venv/bin/python benchmarks/hot_loop.py --tree . --tree ../base

``benchmarks/instructions.py`` counts instructions of the same loop under valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

DECODER = r"""
import gc, json, os, sys, tempfile, time
layers = int(sys.argv[1])
import torch
torch.set_num_threads(1)
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
import iobundle
from iobundle import InputObserver
print("iobundle from", os.path.dirname(iobundle.__file__), file=sys.stderr)

class Decoder(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, cache_position=None):
        new = torch.zeros(1, 2, input_ids.shape[1], 8)
        for i in range(layers):
            past_key_values.update(new, new, i)
        return CausalLMOutputWithPast(logits=torch.zeros(1, input_ids.shape[1], 128), past_key_values=past_key_values)

model = Decoder()

def decode(n):
    cache = DynamicCache()
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 8, dtype=torch.long),
          position_ids=torch.arange(8)[None], past_key_values=cache, cache_position=torch.arange(8))
    begin = time.thread_time()
    for step in range(n):
        p = 8 + step
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), attention_mask=torch.ones(1, p + 1, dtype=torch.long),
              position_ids=torch.tensor([[p]]), past_key_values=cache, cache_position=torch.tensor([p]))
    return time.thread_time() - begin

decode(3)  # warm: first-call costs out of the count
"""
"""The loop's model (its layers: the program's first argument) and its decode loop: ``decode(n)`` returns the
thread's CPU seconds of its ``n`` decode calls (the prefill call not counted)."""

_CLOCK = DECODER + r"""
calls, pairs = int(sys.argv[2]), int(sys.argv[3])
samples = []
for _ in range(pairs):
    plain = decode(calls)
    with InputObserver()(model, store_n_calls=calls + 1, stream_to=tempfile.mkdtemp() + "/b"):
        recorded = decode(calls)
    samples.append((plain / calls, recorded / calls))
print(json.dumps(samples))
"""


def _round(tree: Path, layers: int, calls: int, pairs: int) -> list[tuple[float, float]]:
    """``pairs`` (plain, recorded) seconds of CPU per decode call, measured in a new interpreter on ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    result = subprocess.run(
        [sys.executable, "-c", _CLOCK, str(layers), str(calls), str(pairs)],
        cwd=tree, env=env, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{tree}: the loop failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return [(float(plain), float(recorded)) for plain, recorded in json.loads(result.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--layers", type=int, default=32, help="cache layers (default 32: 4 tensors a layer per call)")
    parser.add_argument("--calls", type=int, default=24, help="decode calls per loop (default 24)")
    parser.add_argument("--rounds", type=int, default=4, help="interpreters per checkout, alternating (default 4)")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers needs at least 1")
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds need at least 1")
    trees = [t.resolve() for t in args.tree or [Path(__file__).resolve().parents[1]]]
    samples: dict[Path, list[float]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            samples[tree] += [recorded - plain for plain, recorded in _round(tree, args.layers, args.calls, 3)]
    first = None
    for tree in trees:
        low, median, high = (q * 1e6 for q in statistics.quantiles(samples[tree], n=4))
        first = first or median
        print(
            f"{tree}: recording {median:.0f} µs of the model's thread per decode call ({median / first:.3f} x the "
            f"first tree; middle half of {len(samples[tree])} loops {low:.0f}-{high:.0f}), {args.layers} layers"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
