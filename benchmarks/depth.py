"""Figure 1f: what recording adds to a decode call as the model gets deeper (issue 27).

A tiny Llama (hidden 32, 4 heads, 2 key-value heads, vocabulary 128) at several depths, batch 1, an
8-token prompt and ``depth_tokens`` new tokens: plain ``generate()`` against ``generate()`` under
``InputObserver`` streaming to a bundle, interleaved, one repetition of each per round. A decode call
carries about four tensors per layer (the cache in and out) plus a few: a cost per tensor is a cost per
layer. Reported per depth: the plain time per call, what streaming adds per call (wall clock: the median
of the differences between the two runs of a round, which sit side by side in time, so that the machine's
slow spells cancel), the ratio (the median of the rounds' ratios), and the CPU time recording takes on the
model's thread per call and per recorded tensor: the thread's CPU outside the model's own forward (a timing
wrapper under the observer's measures that), streamed minus plain, so that the model's compute, the
noisiest part, is not in it. Then the growth exponent of the added time in depth (a least-squares slope of
log(added) on log(layers): 0 is a cost per call, 1 per tensor).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Config, Figure, Row, Target, at_most, defer_remove, observer_call, run_interleaved


def tensor_count(node: Any) -> int:
    """The tensors of a recorded tree (a manifest node)."""
    if getattr(node, "kind", None) == "tensor":
        return 1
    return sum(tensor_count(item) for item in getattr(node, "items", ()) or ())


def llama_of_depth(layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _growth(layers: list[int], added: list[float]) -> float | None:
    """Least-squares slope of log(added) on log(layers); None unless every added time is positive."""
    if len(layers) < 2 or any(a <= 0 for a in added):
        return None
    xs, ys = [math.log(n) for n in layers], [math.log(a) for a in added]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _measure(
    cfg: Config, workdir: Path, layers: int, prompt: Any
) -> tuple[dict[str, dict[str, list[float]]], int, int]:
    """Plain and streamed runs at one depth: the samples (seconds per generate(): wall, the thread's CPU, and
    its CPU outside the model's forward), the forward calls per generate() and the tensors of a decode call."""
    import torch

    from iobundle import InputObserver, load_bundle

    tokens = cfg.depth_tokens
    model = llama_of_depth(layers)
    calls = {"n": 0, "tensors": 0}
    inside = [0.0]  # the thread's CPU inside the model's own forward, this generate()
    forward = model.forward

    @functools.wraps(forward)
    def timed_forward(*args: Any, **kwargs: Any) -> Any:  # under the observer's wrapper: the model alone
        begin = time.thread_time()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.thread_time() - begin

    model.forward = timed_forward

    def generate() -> dict[str, float]:
        inside[0] = 0.0
        begin, cpu = time.perf_counter(), time.thread_time()
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        wall, cpu = time.perf_counter() - begin, time.thread_time() - cpu
        return {"wall": wall, "cpu": cpu, "outside": cpu - inside[0]}

    def plain(rep: int) -> dict[str, float]:
        with torch.no_grad():
            return generate()

    def streamed(rep: int) -> dict[str, float]:
        observer, target = InputObserver(), workdir / f"depth-{layers}-{rep}.iobundle"
        with torch.no_grad(), observer_call(observer, model, tokens + 8, target):
            sample = generate()
        if not calls["n"]:
            recorded = load_bundle(target).calls
            last = recorded[-1]
            calls["n"] = len(recorded)
            calls["tensors"] = sum(map(tensor_count, [*last.args, *last.kwargs.values(), last.outputs]))
        defer_remove(target)
        return sample

    variants: dict[str, Callable[[int], dict[str, float]]] = {"plain": plain, "streamed": streamed}
    samples = run_interleaved(cfg.depth_reps, variants, warmup=cfg.warmup)
    return samples, max(calls["n"], 1), calls["tensors"]


def _paired_median(samples: dict[str, dict[str, list[float]]], key: str) -> float:
    """The median over rounds of streamed minus plain (``key``, seconds per generate())."""
    return statistics.median(s - p for s, p in zip(samples["streamed"][key], samples["plain"][key]))


def figure_1f(cfg: Config, workdir: Path) -> Figure:
    import torch

    tokens = cfg.depth_tokens
    fig = Figure(
        "1f",
        f"Recording cost by depth: tiny Llama (hidden 32) generate() of {tokens} new tokens, batch 1, "
        f"every call streamed, at {', '.join(map(str, cfg.depth_layers))} layers",
        "ms per forward call",
        f"plain_{cfg.depth_layers[0]}",
        "streamed / plain at the same depth (paired by repetition)",
    )
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    added_by_depth, per_tensor = [], {}
    for layers in cfg.depth_layers:
        samples, n, tensors = _measure(cfg, workdir, layers, prompt)
        plain_ms = [w * 1e3 / n for w in samples["plain"]["wall"]]
        streamed_ms = [w * 1e3 / n for w in samples["streamed"]["wall"]]
        rows = (
            Row(f"plain_{layers}", f"{layers} layers: plain generate() (unobserved)", plain_ms),
            Row(f"streamed_{layers}", f"{layers} layers: streamed to a bundle ({tensors} tensors per decode call)", streamed_ms),
        )  # fmt: skip
        rows[0].ratio = 1.0
        rows[1].ratio = statistics.median(s / p for s, p in zip(streamed_ms, plain_ms))
        fig.rows.extend(rows)
        added = _paired_median(samples, "wall") * 1e3 / n
        added_by_depth.append(added)
        cpu_added = _paired_median(samples, "cpu") / n
        recording = _paired_median(samples, "outside") / n
        per_tensor[layers] = recording * 1e6 / max(tensors, 1)
        fig.notes.append(
            f"{layers} layers: {n} forward calls per generate(), {tensors} tensors per decode call; added "
            f"{added:+.2f} ms per call (wall; {statistics.median(streamed_ms) - statistics.median(plain_ms):+.2f} "
            f"as the difference of the medians); recording on the model's thread {recording * 1e3:.2f} ms per call "
            f"(CPU outside the model's forward), {per_tensor[layers]:.1f} µs per tensor; the thread's whole CPU "
            f"{cpu_added * 1e3:+.2f} ms per call."
        )
    reference = 32 if 32 in cfg.depth_layers else cfg.depth_layers[-1]
    at = cfg.depth_layers.index(reference)
    added = added_by_depth[at]
    ratio = fig.row(f"streamed_{reference}").ratio
    fig.targets.append(
        Target(f"{reference} layers: ms added per decode call", added, "≤ 1.00 ms", at_most(added, 1.0), f"streamed_{reference}")
    )  # fmt: skip
    fig.targets.append(
        Target(f"{reference} layers: streamed / plain", ratio, "≤ 1.10", at_most(ratio, 1.10), f"streamed_{reference}")
    )
    cost = per_tensor[reference]
    fig.targets.append(
        Target(
            f"{reference} layers: recording CPU on the model's thread per recorded tensor (µs)",
            cost,
            "≤ 5 µs",
            at_most(cost, 5.0),
            f"streamed_{reference}",
        )
    )
    slope = _growth(list(cfg.depth_layers), added_by_depth)
    fig.targets.append(
        Target(
            "growth exponent of the added time in depth (0: a cost per call, the goal; 1: per tensor)",
            slope,
            "(no target)",
            None,
            f"streamed_{cfg.depth_layers[-1]}",
            "" if slope is not None else "an added time was not positive: no slope",
        )
    )
    fig.notes.append(
        f"{cfg.depth_reps} rounds; each runs plain and streamed once, in alternating order, after one warm-up "
        "round; one torch thread; the writer process (the default writer for calls this size) has the other core."
    )
    return fig
