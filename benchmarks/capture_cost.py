"""Figure 1 (1a-1d): the cost of a recorded call, plain vs torch.onnx.InputObserver vs iobundle."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MIB,
    Config,
    Elementwise,
    Figure,
    Row,
    Target,
    at_most,
    below,
    defer_remove,
    fill_ratios,
    observer_call,
    paired_ratio,
    run_interleaved,
    streaming_supported,
)

# -- figure 1: recorded-call cost ---------------------------------------------------------------


def _capture_tensor_model(
    cfg: Config,
    fig: Figure,
    model: Any,
    inputs: list[tuple[Any, ...]],
    workdir: Path,
    *,
    with_same_inputs: bool = False,
) -> None:
    """Fill ``fig`` with per-call times (ms) of ``model(*inputs[i])``, recorded or not (figures 1a and 1b).

    Each call gets its own input tensors (``inputs[i]``), as in a real loop: iobundle stores a
    tensor seen unchanged in an earlier call only once, which would hide the copy of the inputs.
    """
    import torch

    from iobundle import InputObserver

    calls = len(inputs)
    streaming = streaming_supported()
    with torch.no_grad():
        out = model(*inputs[0])
    in_bufs = [torch.empty_like(t).fill_(0) for t in inputs[0]]
    out_buf = torch.empty_like(out).fill_(0)
    del out

    def plain(rep: int) -> dict[str, float]:
        times = []
        with torch.no_grad():
            for args in inputs:
                begin = time.perf_counter()
                out = model(*args)
                times.append(time.perf_counter() - begin)
                del out
        return {"call": statistics.mean(times)}

    def floor(rep: int) -> dict[str, float]:
        times = []
        with torch.no_grad():
            for args in inputs:
                begin = time.perf_counter()
                for buf, t in zip(in_bufs, args):
                    buf.copy_(t)
                out = model(*args)
                out_buf.copy_(out)
                times.append(time.perf_counter() - begin)
                del out
        return {"call": statistics.mean(times)}

    def write_floor(rep: int) -> dict[str, float]:
        times = []
        with torch.no_grad():
            for i, args in enumerate(inputs):
                path = workdir / f"raw-{fig.id}-{rep}-{i}.bin"
                begin = time.perf_counter()
                out = model(*args)
                with open(path, "wb", buffering=0) as f:
                    for t in (*args, out):
                        f.write(t.numpy().data)
                times.append(time.perf_counter() - begin)
                del out
                defer_remove(path)
        return {"call": statistics.mean(times)}

    def observed(factory: Callable[[], Any], stream: bool, same: bool = False) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            observer = factory()
            target = workdir / f"stream-{fig.id}-{rep}.iobundle" if stream else None
            times = []
            with torch.no_grad(), observer_call(observer, model, calls, target):
                for args in inputs:
                    begin = time.perf_counter()
                    out = model(*(inputs[0] if same else args))
                    times.append(time.perf_counter() - begin)
                    del out
                exit_begin = time.perf_counter()
            flush = time.perf_counter() - exit_begin
            if observer.num_obs() != calls:
                raise RuntimeError(f"{fig.id}: expected {calls} recorded calls, got {observer.num_obs()}")
            del observer
            if target is not None:
                defer_remove(target)
            return {
                "call": statistics.mean(times),
                "with_flush": statistics.mean(times) + flush / calls,
                "first_call": times[0],
                "later_calls": statistics.mean(times[1:]) if len(times) > 1 else times[0],
                "flush": flush,
            }

        return run

    variants: dict[str, Callable[[int], dict[str, float]]] = {
        "plain": plain,
        "floor": floor,
        "write_floor": write_floor,
    }
    variants["reference"] = observed(_reference_observer, False)
    variants["iobundle"] = observed(InputObserver, False)
    if with_same_inputs:
        variants["iobundle_same"] = observed(InputObserver, False, same=True)
    if streaming:
        variants["streaming"] = observed(InputObserver, True)
    samples = run_interleaved(cfg.reps, variants, warmup=cfg.warmup)

    def ms(name: str, key: str = "call") -> list[float]:
        return [v * 1e3 for v in samples[name][key]]

    fig.rows.append(Row("plain", "plain call (unobserved)", ms("plain")))
    fig.rows.append(
        Row("floor", "pre-faulted copy floor (plain + copy inputs/output into pre-touched buffers)", ms("floor"))
    )
    fig.rows.append(
        Row("write_floor", "raw write floor (plain + write inputs/output to a new file per call)", ms("write_floor"))
    )
    fig.rows.append(
        Row(
            "larger_floor",
            "the larger of the two floors, per repetition",
            [max(a, b) for a, b in zip(ms("floor"), ms("write_floor"))],
        )
    )
    fig.rows.append(Row("reference", "torch.onnx.InputObserver (in memory)", ms("reference")))
    fig.rows.append(Row("iobundle", "iobundle InputObserver, in memory", ms("iobundle")))
    if with_same_inputs:
        fig.rows.append(
            Row(
                "iobundle_same",
                "iobundle in memory, the same input tensors in every call (stored once)",
                ms("iobundle_same"),
            )
        )
    if streaming:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk (stream_to=...)", ms("streaming")))
        fig.rows.append(
            Row(
                "streaming_flush",
                "iobundle streaming, incl. the flush at the end of the block (amortised per call)",
                ms("streaming", "with_flush"),
            )
        )
    else:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk: not available in this iobundle", None))
    fill_ratios(fig, "plain")
    fig.notes.append(
        f"{calls} calls per repetition, each with its own input tensors; each recorded repetition uses a fresh "
        "observer; gc.collect() between runs."
    )
    for name in ("reference", "iobundle", "streaming"):
        if name in samples:
            s = samples[name]
            fig.notes.append(
                f"{name}: first call of a fresh observer {statistics.median(s['first_call']) * 1e3:.1f} ms, "
                f"later calls {statistics.median(s['later_calls']) * 1e3:.1f} ms, leaving the block "
                f"{statistics.median(s['flush']) * 1e3:.1f} ms (medians)."
            )
    _capture_targets(fig, with_floor=fig.id == "1a")
    if streaming:
        r = _ratio_between(fig, "streaming", "larger_floor")
        fig.notes.append(f"streaming without the flush / larger floor = {r:.2f} (no target).")
    fig.notes.append(
        "The raw write floor writes the call's bytes with one write() per tensor to a file created for the "
        "call (no fsync, as streaming without durable mode), the way streaming creates files."
    )


def _reference_observer() -> Any:
    from torch.onnx import InputObserver as Reference

    return Reference()


def _ratio_between(fig: Figure, a: str, b: str) -> float | None:
    ra, rb = fig.row(a).samples, fig.row(b).samples
    if ra is None or rb is None:
        return None
    return paired_ratio(ra, rb)


def _capture_targets(fig: Figure, *, with_floor: bool) -> None:
    if with_floor:
        # incl. the flush: the raw write floor writes every byte inside the call, streaming partly after it
        r = _ratio_between(fig, "streaming_flush", "larger_floor") if streaming_supported() else None
        fig.targets.append(
            Target(
                "streaming incl. the flush / larger floor (copy into warm buffers; raw write to new files)",
                r,
                "≤ 1.15",
                at_most(r, 1.15),
                "streaming_flush",
                "" if r is not None else "streaming capture not available",
            )
        )
    r = _ratio_between(fig, "iobundle", "reference")
    fig.targets.append(Target("iobundle in memory / reference", r, "< 1.00", below(r, 1.0), "iobundle"))
    r = _ratio_between(fig, "streaming", "reference")
    fig.targets.append(
        Target(
            "iobundle streaming / reference",
            r,
            "< 1.00",
            below(r, 1.0),
            "streaming",
            "" if r is not None else "streaming capture not available",
        )
    )


def figure_1a(cfg: Config, workdir: Path) -> Figure:
    import torch

    n = cfg.elementwise_mib * MIB // 4
    fig = Figure(
        "1a",
        f"Recorded-call cost: elementwise x*2+y on two {cfg.elementwise_mib} MiB float32 inputs",
        "ms per call",
        "plain",
        "time / plain call (paired by repetition)",
    )
    generator = torch.Generator().manual_seed(0)
    inputs = [
        (torch.rand(n, generator=generator), torch.rand(n, generator=generator)) for _ in range(cfg.elementwise_calls)
    ]
    _capture_tensor_model(cfg, fig, Elementwise.build(), inputs, workdir, with_same_inputs=True)
    fig.notes.append(f"A recorded call copies {3 * cfg.elementwise_mib} MiB (two inputs, one output).")
    return fig


def figure_1b(cfg: Config, workdir: Path) -> Figure:
    import torch

    fig = Figure(
        "1b",
        f"Recorded-call cost: torch.nn.Linear(1024, 1024) on a {cfg.linear_rows}x1024 float32 input "
        f"({cfg.linear_rows * 1024 * 4 // MIB} MiB)",
        "ms per call",
        "plain",
        "time / plain call (paired by repetition)",
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).eval()
    inputs = [(torch.rand(cfg.linear_rows, 1024),) for _ in range(cfg.linear_calls)]
    _capture_tensor_model(cfg, fig, model, inputs, workdir)
    return fig


def tiny_llama() -> Any:
    """The tiny Llama of figure 1c (also used by gpu_check.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def figure_1c(cfg: Config, workdir: Path, *, long: bool = False) -> Figure:
    import torch
    from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

    from iobundle import InputObserver

    tokens = cfg.llama_long_tokens if long else cfg.llama_new_tokens
    store = tokens + 16
    fig = Figure(
        "1d" if long else "1c",
        f"Recorded-call cost: tiny Llama (2 layers, hidden 64) generate() of {tokens} new tokens, "
        f"every call recorded (store_n_calls={store})",
        "ms per generate()",
        "plain",
        "time / plain generate() (paired by repetition)",
    )
    model = tiny_llama()
    prompt = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    # torch.onnx.InputObserver flattens with torch pytree, which knows no transformers 5 cache:
    # register them the way transformers does for torch.export, else the reference fails on DynamicCache.
    register_cache_pytrees_for_model(model)
    n_calls = {"n": 0}

    def generate() -> Any:
        return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)

    def plain(rep: int) -> dict[str, float]:
        with torch.no_grad():
            begin = time.perf_counter()
            generate()
            return {"call": time.perf_counter() - begin}

    def observed(factory: Callable[[], Any], stream: bool) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            observer = factory()
            target = workdir / f"stream-1c-{rep}.iobundle" if stream else None
            with torch.no_grad(), observer_call(observer, model, store, target):
                begin = time.perf_counter()
                generate()
                elapsed = time.perf_counter() - begin
                exit_begin = time.perf_counter()
            flush = time.perf_counter() - exit_begin
            n_calls["n"] = observer.num_obs()
            del observer
            if target is not None:
                defer_remove(target)
            return {"call": elapsed, "with_flush": elapsed + flush}

        return run

    streaming = streaming_supported()
    variants: dict[str, Callable[[int], dict[str, float]]] = {
        "plain": plain,
        "reference": observed(_reference_observer, False),
        "iobundle": observed(InputObserver, False),
    }
    if streaming:
        variants["streaming"] = observed(InputObserver, True)
    samples = run_interleaved(cfg.llama_long_reps if long else cfg.reps_cheap, variants, warmup=cfg.warmup)

    def ms(name: str, key: str = "call") -> list[float]:
        return [v * 1e3 for v in samples[name][key]]

    fig.rows.append(Row("plain", "plain generate() (unobserved)", ms("plain")))
    fig.rows.append(Row("reference", "torch.onnx.InputObserver (in memory)", ms("reference")))
    fig.rows.append(Row("iobundle", "iobundle InputObserver, in memory", ms("iobundle")))
    if streaming:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk", ms("streaming")))
        fig.rows.append(
            Row(
                "streaming_flush",
                "iobundle streaming, incl. the flush at the end of the block",
                ms("streaming", "with_flush"),
            )
        )
    else:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk: not available in this iobundle", None))
    fill_ratios(fig, "plain")
    _capture_targets(fig, with_floor=False)
    limit = 1.3 if long else 1.25
    r = fig.row("streaming").ratio
    fig.targets.append(
        Target(
            f"streamed generate() / plain, {tokens} new tokens", r, f"≤ {limit:.2f}", at_most(r, limit), "streaming"
        )
    )
    plain_median = statistics.median(samples["plain"]["call"])
    for name in ("reference", "iobundle", "streaming"):
        if name in samples and n_calls["n"]:
            extra = (statistics.median(samples[name]["call"]) - plain_median) / n_calls["n"]
            fig.notes.append(f"{name}: {extra * 1e3:+.2f} ms per recorded call over plain (medians).")
    fig.notes.append(
        f"{n_calls['n']} forward calls per generate(), all recorded. The reference runs with transformers' "
        "cache pytree registration (register_cache_pytrees_for_model), which it needs to flatten a DynamicCache."
    )
    return fig


def figure_1e(cfg: Config, workdir: Path) -> Figure:
    """Per-call cost on the recording thread: the time a decode step spends in the observed call."""
    import torch
    from transformers import DynamicCache

    from iobundle import InputObserver

    steps = cfg.decode_steps
    fig = Figure(
        "1e",
        f"Per-call cost on the recording thread: tiny Llama (2 layers, hidden 64) decode steps, batch 2, "
        f"{steps} steps after an 8-token prefill",
        "µs per decode call (median over the calls of a repetition)",
        "plain",
        "time / unobserved call (paired by repetition)",
    )
    model = tiny_llama()
    tokens = torch.randint(0, 256, (2, 8 + steps), generator=torch.Generator().manual_seed(0))

    def decode(rep: int, observer: Any = None, stream: bool = False) -> dict[str, float]:
        target = workdir / f"stream-1e-{rep}.iobundle" if stream else None
        times = []
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if observer is not None:
                stack.enter_context(observer_call(observer, model, steps + 1, target))
            cache = DynamicCache(config=model.config)
            model(input_ids=tokens[:, :8], past_key_values=cache, use_cache=True)
            for i in range(8, 8 + steps):
                begin = time.perf_counter()
                model(input_ids=tokens[:, i : i + 1], past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - begin)
            exit_begin = time.perf_counter()
        flush = time.perf_counter() - exit_begin
        if observer is not None and observer.num_obs() != steps + 1:
            raise RuntimeError(f"1e: expected {steps + 1} recorded calls, got {observer.num_obs()}")
        if target is not None:
            defer_remove(target)
        return {"call": statistics.median(times), "mean": statistics.mean(times), "flush": flush}

    variants: dict[str, Callable[[int], dict[str, float]]] = {
        "plain": decode,
        "iobundle": lambda rep: decode(rep, InputObserver()),
    }
    streaming = streaming_supported()
    if streaming:
        variants["streaming"] = lambda rep: decode(rep, InputObserver(), stream=True)
    samples = run_interleaved(cfg.reps_cheap, variants, warmup=cfg.warmup)

    def us(name: str, key: str = "call") -> list[float]:
        return [v * 1e6 for v in samples[name][key]]

    fig.rows.append(Row("plain", "unobserved decode call", us("plain")))
    fig.rows.append(Row("iobundle", "iobundle InputObserver, in memory", us("iobundle")))
    if streaming:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk", us("streaming")))
    else:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk: not available in this iobundle", None))
    fill_ratios(fig, "plain")
    plain = us("plain")
    for name, check in (("iobundle", None), ("streaming", 300.0)):
        if name not in samples:
            fig.targets.append(Target(f"{name}: µs added per decode call", None, "≤ 300 µs", None, name,
                                      "streaming capture not available"))  # fmt: skip
            continue
        added = statistics.median(a - b for a, b in zip(us(name), plain))
        if check is None:
            fig.targets.append(Target(f"{name}: µs added per decode call", added, "(no target)", None, name))
        else:
            fig.targets.append(
                Target(f"{name}: µs added per decode call", added, f"≤ {check:.0f} µs", at_most(added, check), name)
            )
        fig.notes.append(
            f"{name}: mean per call {statistics.median(us(name, 'mean')):.0f} µs (plain "
            f"{statistics.median(us('plain', 'mean')):.0f}), leaving the block "
            f"{statistics.median(samples[name]['flush']) * 1e3:.1f} ms (medians over repetitions)."
        )
    fig.notes.append(
        "Each step is timed on the recording thread around the model call alone (a new token and the growing "
        "DynamicCache, as generate() passes them): what the model's own loop waits for. The prefill call is "
        "recorded but not timed."
    )
    return fig
