"""Side-by-side benchmarks of iobundle (GitHub issue 6), reported as ratios.

Run ``make bench`` (or ``.venv/bin/python benchmarks/run.py``). It writes
``benchmarks/results.json`` and the results table of ``BENCHMARKS.md`` (between the
``results`` markers; the text around them is kept). ``--quick`` is a smoke run of under a
minute with small sizes and two repetitions; its numbers mean nothing, it only proves that
every figure still runs (``tests/test_benchmarks.py`` calls it).

Figures (each measured side by side in one run, variants interleaved within a repetition,
ratios are medians of the per-repetition ratios):

1. recorded-call cost: plain call, a pre-faulted copy floor, ``torch.onnx.InputObserver``,
   iobundle in memory, iobundle streaming to disk; on an elementwise model, a Linear and a
   tiny Llama ``generate()``;
2. peak RSS growth while recording many calls (one subprocess per variant);
3. bundle write throughput vs a raw sequential write, ``safetensors.torch.save_file`` and
   ``torch.save`` (every variant fsyncs), and read throughput (informational);
4. time to open and inspect a bundle as its tensor bytes grow;
5. ``check_discrepancies`` time vs a bare onnxruntime loop over the same inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2
MB = 1000**2
RESULTS_BEGIN = "<!-- results:begin (written by benchmarks/run.py; edit outside these markers) -->"
RESULTS_END = "<!-- results:end -->"


@dataclass(frozen=True)
class Config:
    """Sizes and repetitions of one run."""

    quick: bool
    reps: int = 5
    reps_cheap: int = 7
    elementwise_mib: int = 64
    elementwise_calls: int = 3
    linear_rows: int = 8192  # 8192 x 1024 float32 = 32 MiB
    linear_calls: int = 2
    llama_new_tokens: int = 24
    llama_store: int = 40
    llama_long_tokens: int = 200
    llama_long_reps: int = 3
    size_tokens: int = 100  # figure 7: bundle bytes for N and 2N new tokens
    hash_mib: int = 256
    open_many_calls: int = 1000
    reps_open_many: int = 3
    memory_mib: int = 16
    memory_calls: int = 24
    memory_reps: int = 2
    write_mib: int = 512
    write_tensors: int = 4
    open_sizes_mb: tuple[int, ...] = (10, 100, 1000, 2000)
    open_calls: int = 8
    validate_linear_rows: tuple[int, ...] = (2048, 1024, 1536, 512)
    validate_demo: bool = True
    memory_parallel: bool = False
    warmup: bool = True


FULL = Config(quick=False)
QUICK = Config(
    quick=True,
    reps=1,
    reps_cheap=1,
    elementwise_mib=4,
    elementwise_calls=2,
    linear_rows=256,
    linear_calls=2,
    llama_new_tokens=3,
    llama_store=5,
    llama_long_tokens=6,
    llama_long_reps=1,
    size_tokens=4,
    hash_mib=8,
    open_many_calls=50,
    reps_open_many=1,
    memory_mib=2,
    memory_calls=6,
    memory_reps=1,
    write_mib=16,
    write_tensors=2,
    open_sizes_mb=(1, 10),
    open_calls=4,
    validate_linear_rows=(64, 32),
    validate_demo=False,
    memory_parallel=True,
    warmup=False,
)

FIGURES = ("1a", "1b", "1c", "1d", "2", "3", "3r", "4", "5", "6", "7", "8")


# -- statistics and result records -----------------------------------------------------------


def _stats(samples: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
    }


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over repetitions of ``a[i] / b[i]`` (both measured in the same repetition)."""
    return statistics.median(x / y for x, y in zip(a, b) if y)


@dataclass
class Row:
    variant: str
    label: str
    samples: list[float] | None  # None: not available in this run
    ratio: float | None = None  # vs the figure's baseline
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.variant, "label": self.label, "available": self.samples is not None}
        if self.samples is not None:
            out.update(_stats(self.samples))
        out["ratio"] = self.ratio
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class Target:
    check: str  # what the ratio compares
    ratio: float | None
    target: str  # human text, e.g. "≤ 1.10"
    met: bool | None  # None: could not be measured
    row: str  # the variant the target is shown on
    note: str = ""


@dataclass
class Figure:
    id: str
    title: str
    unit: str  # of median/min/max
    baseline: str  # variant the ratio column compares to
    ratio_meaning: str
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio_meaning": self.ratio_meaning,
            "rows": [r.as_dict() for r in self.rows],
            "targets": [asdict(t) for t in self.targets],
            "notes": self.notes,
            "seconds": self.seconds,
        }

    def row(self, variant: str) -> Row:
        return next(r for r in self.rows if r.variant == variant)


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def _at_least(value: float | None, limit: float) -> bool | None:
    return None if value is None else value >= limit


# -- environment --------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info(workdir: Path) -> dict[str, Any]:
    usage = shutil.disk_usage(workdir)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "workdir": str(workdir),
        "workdir_free_gib": round(usage.free / 1024**3, 1),
    }


def versions() -> dict[str, str | None]:
    import torch

    import iobundle

    def version_of(name: str) -> str | None:
        try:
            module = __import__(name)
        except ImportError:
            return None
        return getattr(module, "__version__", None)

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": version_of("onnxruntime"),
        "onnx": version_of("onnx"),
        "transformers": version_of("transformers"),
        "safetensors": version_of("safetensors"),
        "iobundle": iobundle.__version__,
        "iobundle_commit": _git_commit(),
    }


def streaming_supported() -> bool:
    from iobundle import InputObserver

    return "stream_to" in inspect.signature(InputObserver.__call__).parameters


# -- shared helpers -----------------------------------------------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("torch._export").setLevel(logging.ERROR)


def _collect() -> None:
    gc.collect()


def _rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def _observer_call(observer: Any, model: Any, store_n_calls: int, stream_to: Path | None) -> Any:
    if stream_to is None:
        return observer(model, store_n_calls=store_n_calls)
    return observer(model, store_n_calls=store_n_calls, stream_to=str(stream_to))


_TRASH: list[Path] = []


def _defer_remove(path: Path) -> None:
    """Delete ``path`` at the end of the figure: deleting GBs between repetitions makes the file
    system discard blocks in the background while the next variant is timed."""
    _TRASH.append(path)


def _empty_trash() -> None:
    while _TRASH:
        _remove(_TRASH.pop())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Elementwise:
    """``x * 2 + y``, as a module (built lazily so that importing this file does not import torch)."""

    @staticmethod
    def build() -> Any:
        import torch

        class _Elementwise(torch.nn.Module):
            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return x * 2 + y

        return _Elementwise()


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

    def observed(factory: Callable[[], Any], stream: bool, same: bool = False) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            observer = factory()
            target = workdir / f"stream-{fig.id}-{rep}.iobundle" if stream else None
            times = []
            with torch.no_grad(), _observer_call(observer, model, calls, target):
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
                _defer_remove(target)
            return {
                "call": statistics.mean(times),
                "with_flush": statistics.mean(times) + flush / calls,
                "first_call": times[0],
                "later_calls": statistics.mean(times[1:]) if len(times) > 1 else times[0],
                "flush": flush,
            }

        return run

    variants: dict[str, Callable[[int], dict[str, float]]] = {"plain": plain, "floor": floor}
    variants["reference"] = observed(_reference_observer, False)
    variants["iobundle"] = observed(InputObserver, False)
    if with_same_inputs:
        variants["iobundle_same"] = observed(InputObserver, False, same=True)
    if streaming:
        variants["streaming"] = observed(InputObserver, True)
    samples = _run_interleaved(cfg.reps, variants, warmup=cfg.warmup)

    def ms(name: str, key: str = "call") -> list[float]:
        return [v * 1e3 for v in samples[name][key]]

    fig.rows.append(Row("plain", "plain call (unobserved)", ms("plain")))
    fig.rows.append(
        Row("floor", "pre-faulted copy floor (plain + copy inputs/output into pre-touched buffers)", ms("floor"))
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
    _fill_ratios(fig, "plain")
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
    if fig.id != "1a" and streaming:
        r = _ratio_between(fig, "streaming", "floor")
        fig.notes.append(f"streaming / floor = {r:.2f} (no target on this figure).")


def _reference_observer() -> Any:
    from torch.onnx import InputObserver as Reference

    return Reference()


def _run_interleaved(
    reps: int, variants: dict[str, Callable[[int], dict[str, float]]], warmup: bool = True
) -> dict[str, dict[str, list[float]]]:
    """Run every variant once per repetition, in an order rotated by repetition; one warm-up round first."""
    names = list(variants)
    if warmup:
        for name in names:
            _collect()
            variants[name](-1)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for rep in range(reps):
        for name in _rotate(names, rep):
            _collect()
            for key, value in variants[name](rep).items():
                samples[name].setdefault(key, []).append(value)
    return samples


def _fill_ratios(fig: Figure, baseline: str) -> None:
    base = fig.row(baseline).samples
    for row in fig.rows:
        if row.samples is not None and base is not None:
            row.ratio = paired_ratio(row.samples, base)


def _ratio_between(fig: Figure, a: str, b: str) -> float | None:
    ra, rb = fig.row(a).samples, fig.row(b).samples
    if ra is None or rb is None:
        return None
    return paired_ratio(ra, rb)


def _capture_targets(fig: Figure, *, with_floor: bool) -> None:
    if with_floor:
        r = _ratio_between(fig, "streaming", "floor")
        fig.targets.append(
            Target(
                "streaming / floor",
                r,
                "≤ 1.15",
                _at_most(r, 1.15),
                "streaming",
                "" if r is not None else "streaming capture not available",
            )
        )
    r = _ratio_between(fig, "iobundle", "reference")
    fig.targets.append(Target("iobundle in memory / reference", r, "< 1.00", _below(r, 1.0), "iobundle"))
    r = _ratio_between(fig, "streaming", "reference")
    fig.targets.append(
        Target(
            "iobundle streaming / reference",
            r,
            "< 1.00",
            _below(r, 1.0),
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
            with torch.no_grad(), _observer_call(observer, model, store, target):
                begin = time.perf_counter()
                generate()
                elapsed = time.perf_counter() - begin
                exit_begin = time.perf_counter()
            flush = time.perf_counter() - exit_begin
            n_calls["n"] = observer.num_obs()
            del observer
            if target is not None:
                _defer_remove(target)
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
    samples = _run_interleaved(cfg.llama_long_reps if long else cfg.reps_cheap, variants, warmup=cfg.warmup)

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
    _fill_ratios(fig, "plain")
    _capture_targets(fig, with_floor=False)
    limit = 1.3 if long else 1.25
    r = fig.row("streaming").ratio
    fig.targets.append(
        Target(
            f"streamed generate() / plain, {tokens} new tokens", r, f"≤ {limit:.2f}", _at_most(r, limit), "streaming"
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


# -- figure 2: peak memory growth (subprocesses) ------------------------------------------------


def _proc_status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kib() -> int:
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def memory_child(variant: str, mib: int, calls: int, workdir: Path) -> dict[str, Any]:
    """Record ``calls`` calls of the elementwise model in this process; return the peak RSS growth."""
    _quiet()
    import torch

    from iobundle import InputObserver

    model = Elementwise.build()
    n = mib * MIB // 4
    x, y = torch.rand(n), torch.rand(n)
    reference = None
    if variant == "reference":
        from torch.onnx import InputObserver as Reference

        reference = Reference
    with torch.no_grad():
        out = model(x, y)
        del out
    gc.collect()
    reset = _reset_peak()
    baseline = _peak_kib()
    rss_before = _proc_status_kib("VmRSS")
    begin = time.perf_counter()
    observer: Any = None
    with torch.no_grad():
        # x[0] += 1 bumps the version counters: every call has "new" inputs, as in a real loop
        # (iobundle stores a tensor seen unchanged before only once)
        if variant == "plain":
            for _ in range(calls):
                x[0] += 1
                y[0] += 1
                out = model(x, y)
        else:
            observer = reference() if reference is not None else InputObserver()
            target = workdir / "memory-child.iobundle" if variant == "streaming" else None
            with _observer_call(observer, model, calls, target):
                for _ in range(calls):
                    x[0] += 1
                    y[0] += 1
                    out = model(x, y)
    elapsed = time.perf_counter() - begin
    del out
    peak = _peak_kib()
    recorded = observer.num_obs() if observer is not None else 0
    return {
        "variant": variant,
        "growth_mib": (peak - baseline) / 1024,
        "baseline_mib": baseline / 1024,
        "rss_before_mib": (rss_before or 0) / 1024,
        "peak_reset": reset,
        "recorded": recorded,
        "seconds": elapsed,
    }


def _memory_children(cfg: Config, workdir: Path, variants: list[str], rep: int) -> list[dict[str, Any]]:
    """Run one child per variant (all at once when ``cfg.memory_parallel``); return their results."""
    import torch

    def command(variant: str) -> list[str]:
        return [
            sys.executable, str(Path(__file__).resolve()), "--child-memory", variant,
            "--child-mib", str(cfg.memory_mib), "--child-calls", str(cfg.memory_calls),
            "--workdir", str(workdir / f"memory-{variant}-{rep}"), "--threads", str(torch.get_num_threads()),
        ]  # fmt: skip

    # A fixed mmap threshold: large blocks are mapped and unmapped, never kept in glibc's heap, so
    # the high-water mark counts memory that was live, not the allocator's retention policy.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MIB))
    results = []
    batches = [variants] if cfg.memory_parallel else [[v] for v in variants]
    for batch in batches:
        for variant in batch:
            (workdir / f"memory-{variant}-{rep}").mkdir(exist_ok=True)
        procs = [
            (v, subprocess.Popen(command(v), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            for v in batch
        ]
        for variant, proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {variant} failed:\n{stderr[-3000:]}")
            result = json.loads(stdout.strip().splitlines()[-1])
            if variant != "plain" and result["recorded"] != cfg.memory_calls:
                raise RuntimeError(f"memory child {variant} recorded {result['recorded']} calls")
            results.append(result)
            _remove(workdir / f"memory-{variant}-{rep}")
    return results


def figure_2(cfg: Config, workdir: Path) -> Figure:
    per_call = 3 * cfg.memory_mib
    fig = Figure(
        "2",
        f"Peak RSS growth while recording {cfg.memory_calls} calls of x*2+y on {cfg.memory_mib} MiB inputs "
        f"({per_call} MiB of inputs+outputs per call)",
        "MiB",
        "iobundle",
        "growth / iobundle in-memory growth",
    )
    variants = ["plain", "reference", "iobundle"]
    streaming = streaming_supported()
    if streaming:
        variants.append("streaming")
    samples: dict[str, list[float]] = {v: [] for v in variants}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    reset_ok = True
    for rep in range(cfg.memory_reps):
        for result in _memory_children(cfg, workdir, _rotate(variants, rep), rep):
            reset_ok = reset_ok and result["peak_reset"]
            samples[result["variant"]].append(result["growth_mib"])
            seconds[result["variant"]].append(result["seconds"])
    fig.rows.append(Row("plain", "plain calls (unobserved), for comparison", samples["plain"]))
    fig.rows.append(Row("reference", "torch.onnx.InputObserver (in memory)", samples["reference"]))
    fig.rows.append(Row("iobundle", "iobundle, in memory", samples["iobundle"]))
    if streaming:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk", samples["streaming"]))
    else:
        fig.rows.append(Row("streaming", "iobundle, streaming to disk: not available in this iobundle", None))
    plain = statistics.median(samples["plain"])
    for row in fig.rows:
        if row.samples is not None:
            med = statistics.median(row.samples)
            row.ratio = med / statistics.median(samples["iobundle"]) if samples["iobundle"] else None
            row.note = (
                f"{med / per_call:.2f} calls' worth ({(med - plain) / per_call:+.2f} over plain); "
                f"{statistics.median(seconds[row.variant]):.1f} s"
            )
    raw = statistics.median(samples["streaming"]) / per_call if streaming else None
    net = (statistics.median(samples["streaming"]) - plain) / per_call if streaming else None
    missing = "" if streaming else "streaming capture not available"
    fig.targets.append(
        Target(
            "streaming growth beyond the plain loop's, in calls of inputs+outputs",
            net,
            "≤ 2.00",
            _at_most(net, 2.0),
            "streaming",
            missing,
        )
    )
    fig.targets.append(
        Target(
            "streaming growth (raw, incl. the plain loop's own temporaries), in calls of inputs+outputs",
            raw,
            "≤ 2.00",
            _at_most(raw, 2.0),
            "streaming",
            missing,
        )
    )
    how = (
        "VmHWM reset through /proc/self/clear_refs"
        if reset_ok
        else "VmHWM could not be reset: baseline is the peak so far"
    )
    fig.notes.append(
        "One fresh subprocess per variant and repetition; growth = VmHWM at the end of the block minus "
        f"VmRSS just before it ({how}); the inputs, a warm-up call and the imports are in the baseline. "
        "Every call gets new inputs (an in-place bump of x and y), so no tensor is stored once for several calls. "
        "MALLOC_MMAP_THRESHOLD_=1MiB in the children: blocks of 1 MiB and more are returned to the system when "
        "freed, so the peak counts live memory, not what glibc's heap keeps."
    )
    fig.notes.append(
        "The plain loop grows too: the x*2 temporary and the output of the next call coexist with the previous "
        "output. The first target subtracts that growth (memory the capture itself adds at the peak)."
    )
    return fig


# -- figure 3: write and read throughput ---------------------------------------------------------


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def figure_3(cfg: Config, workdir: Path, read_fig: Figure | None) -> Figure:
    import safetensors.torch
    import torch

    from iobundle import InputObserver

    fig = Figure(
        "3",
        f"Write throughput: {cfg.write_mib} MiB in {cfg.write_tensors} float32 tensors, every variant fsyncs",
        "MB/s",
        "raw",
        "throughput / raw write (paired by repetition)",
    )
    each = cfg.write_mib * MIB // cfg.write_tensors // 4
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.rand(each, generator=generator) for _ in range(cfg.write_tensors)]
    named = {f"t{i}": t for i, t in enumerate(tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    class Sink(torch.nn.Module):
        def forward(self, tensors: list[torch.Tensor]) -> None:
            return None

    sink = Sink()
    observer = InputObserver()
    with observer(sink, store_n_calls=1):
        sink(tensors)
    if observer.num_obs() != 1:
        raise RuntimeError("figure 3: the observer did not record the call")
    # A new file name per repetition; the files are deleted once the figure is done (see _defer_remove).
    last: dict[str, Path] = {}

    def target(kind: str, rep: int) -> Path:
        path = workdir / f"write-{rep}.{kind}"
        _remove(path)
        _defer_remove(path)
        last[kind] = path
        return path

    def raw(rep: int) -> dict[str, float]:
        path = target("raw", rep)
        begin = time.perf_counter()
        with open(path, "wb") as f:
            for t in tensors:
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        return {"t": time.perf_counter() - begin}

    def bundle(rep: int) -> dict[str, float]:
        path = target("iobundle", rep)
        begin = time.perf_counter()
        observer.save(path)
        elapsed = time.perf_counter() - begin
        written = sum(p.stat().st_size for p in path.rglob("*.safetensors"))
        if written < nbytes:
            raise RuntimeError(f"figure 3: the bundle holds {written} bytes of tensor files, expected {nbytes}")
        return {"t": elapsed}

    def safetensors_file(rep: int) -> dict[str, float]:
        path = target("safetensors", rep)
        begin = time.perf_counter()
        safetensors.torch.save_file(named, str(path))
        _fsync_path(path)
        return {"t": time.perf_counter() - begin}

    def torch_save(rep: int) -> dict[str, float]:
        path = target("pt", rep)
        begin = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(named, f)
            f.flush()
            os.fsync(f.fileno())
        return {"t": time.perf_counter() - begin}

    variants = {"raw": raw, "iobundle": bundle, "safetensors": safetensors_file, "torch.save": torch_save}
    samples = _run_interleaved(cfg.reps, variants, warmup=False)
    labels = {
        "raw": "raw sequential write of the same bytes + fsync",
        "iobundle": "iobundle observer.save() (safetensors + sha256 + fsync + rename + manifest)",
        "safetensors": "safetensors.torch.save_file + fsync afterwards",
        "torch.save": "torch.save to a file + fsync",
    }
    for name, label in labels.items():
        mbps = [nbytes / MB / s for s in samples[name]["t"]]
        fig.rows.append(Row(name, label, mbps))
    _fill_ratios(fig, "raw")
    r = fig.row("iobundle").ratio
    fig.targets.append(Target("iobundle write / raw write", r, "≥ 0.90", _at_least(r, 0.9), "iobundle"))
    fig.notes.append(
        f"{nbytes / MB:.0f} MB per write, to a new file in {workdir} each time (files deleted after the figure)."
    )
    if read_fig is not None:
        _figure_3_read(cfg, read_fig, tensors, nbytes, last["raw"], last["iobundle"], last["safetensors"], last["pt"])
    return fig


def _figure_3_read(
    cfg: Config,
    fig: Figure,
    tensors: list[Any],
    nbytes: int,
    raw_path: Path,
    bundle_dir: Path,
    st_path: Path,
    pt_path: Path,
) -> None:
    import safetensors.torch
    import torch

    from iobundle import load_bundle

    buffer = bytearray(max(t.numel() * t.element_size() for t in tensors))

    def touch(loaded: Any) -> None:
        """Read one byte of every page, so that lazily mapped tensors are really read."""
        for t in loaded:
            t.reshape(-1).view(torch.uint8)[::4096].sum()

    def raw(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        with open(raw_path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        return {"t": time.perf_counter() - begin}

    def bundle(verify: bool) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            b = load_bundle(bundle_dir, verify=verify)
            loaded = [b.tensor(k) for k in b.manifest.tensors]
            touch(loaded)
            elapsed = time.perf_counter() - begin
            del loaded, b
            return {"t": elapsed}

        return run

    def safetensors_file(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        loaded = safetensors.torch.load_file(str(st_path))
        touch(loaded.values())
        elapsed = time.perf_counter() - begin
        del loaded
        return {"t": elapsed}

    def torch_load(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        loaded = torch.load(pt_path, weights_only=True)
        touch(loaded.values())
        elapsed = time.perf_counter() - begin
        del loaded
        return {"t": elapsed}

    variants = {
        "raw": raw,
        "iobundle": bundle(True),
        "iobundle_noverify": bundle(False),
        "safetensors": safetensors_file,
        "torch.load": torch_load,
    }
    samples = _run_interleaved(cfg.reps, variants, warmup=cfg.warmup)
    labels = {
        "raw": "raw sequential read into a reused buffer",
        "iobundle": "load_bundle + every tensor (memory-mapped), sha256 verified on first use",
        "iobundle_noverify": "same, load_bundle(verify=False)",
        "safetensors": "safetensors.torch.load_file",
        "torch.load": "torch.load(weights_only=True)",
    }
    for name, label in labels.items():
        fig.rows.append(Row(name, label, [nbytes / MB / s for s in samples[name]["t"]]))
    _fill_ratios(fig, "raw")
    fig.notes.append(
        "Informational (no target). The files were just written, so they are read from the page cache: "
        "this measures copies, hashing and parsing, not the disk. Every variant touches one byte per page of "
        "every tensor it returns, so lazily memory-mapped tensors (iobundle, recent safetensors) are really read."
    )


def _read_figure() -> Figure:
    return Figure(
        "3r",
        "Read throughput of the same tensors (page cache hot)",
        "MB/s",
        "raw",
        "throughput / raw read (paired by repetition)",
    )


# -- figure 4: open + inspect time vs bundle size -----------------------------------------------


def _rchar() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _build_bundle(path: Path, total_bytes: int, calls: int) -> int:
    """Record ``calls`` calls whose two inputs together hold ``total_bytes``; return the tensor bytes written."""
    import torch

    from iobundle import InputObserver

    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x[:1] + y[:1]

    model = Pair()
    width = 256
    rows = max(1, total_bytes // (2 * calls * width * 4) - calls)
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=calls):
        for i in range(calls):
            x = torch.full((rows + i, width), float(i))
            model(x, x + 1)
            del x
    observer.save(path, overwrite=True)
    del observer
    gc.collect()
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def figure_4(cfg: Config, workdir: Path) -> Figure:
    from iobundle import load_bundle

    fig = Figure(
        "4",
        "Open + inspect a bundle (load_bundle, manifest, num_obs, infer_dynamic_shapes) as its tensor bytes grow",
        "ms",
        "",  # set below: the smallest bundle
        "time / time for the smallest bundle (paired by repetition)",
    )
    free = shutil.disk_usage(workdir).free
    sizes = [mb for mb in cfg.open_sizes_mb if mb * MB * 1.5 < free]
    skipped = [mb for mb in cfg.open_sizes_mb if mb not in sizes]
    paths: dict[int, Path] = {}
    built: dict[int, int] = {}
    try:
        for mb in sizes:
            paths[mb] = workdir / f"open-{mb}MB.iobundle"
            built[mb] = _build_bundle(paths[mb], mb * MB, cfg.open_calls)
        read_bytes: dict[int, list[int]] = {mb: [] for mb in sizes}

        def opener(mb: int) -> Callable[[int], dict[str, float]]:
            def run(rep: int) -> dict[str, float]:
                before = _rchar()
                begin = time.perf_counter()
                bundle = load_bundle(paths[mb])
                _ = bundle.manifest.producer
                n = bundle.num_obs()
                bundle.infer_dynamic_shapes()
                elapsed = time.perf_counter() - begin
                after = _rchar()
                if n != cfg.open_calls:
                    raise RuntimeError(f"bundle of {mb} MB has {n} calls")
                if before is not None and after is not None and rep >= 0:
                    read_bytes[mb].append(after - before)
                return {"t": elapsed}

            return run

        samples = _run_interleaved(cfg.reps_cheap, {str(mb): opener(mb) for mb in sizes}, warmup=cfg.warmup)
        manifest_sizes = {mb: (paths[mb] / "manifest.json").stat().st_size for mb in sizes}
    finally:
        for path in paths.values():
            _remove(path)
    fig.baseline = str(sizes[0])
    for mb in sizes:
        row = Row(
            str(mb),
            f"{built[mb] / MB:,.0f} MB of tensors in {cfg.open_calls} calls",
            [s * 1e3 for s in samples[str(mb)]["t"]],
        )
        reads = read_bytes[mb]
        if reads:
            row.note = f"read {statistics.median(reads) / 1e3:.1f} kB (manifest {manifest_sizes[mb] / 1e3:.1f} kB)"
        fig.rows.append(row)
    _fill_ratios(fig, str(sizes[0]))
    for mb in sizes:
        med = statistics.median(fig.row(str(mb)).samples or [float("nan")])
        fig.targets.append(Target(f"open+inspect {mb} MB (ms)", med, "< 50 ms", _below(med, 50.0), str(mb)))
    largest = fig.row(str(sizes[-1]))
    fig.targets.append(
        Target(
            f"{sizes[-1]} MB / {sizes[0]} MB (not growing with tensor bytes)",
            largest.ratio,
            "≤ 1.50",
            _at_most(largest.ratio, 1.5),
            str(sizes[-1]),
        )
    )
    fig.notes.append(
        "'read' is the growth of /proc/self/io rchar during open+inspect (bytes read by read() calls; "
        "memory-mapped reads would not show, but a tensor file that is opened is also hashed through read())."
    )
    if skipped:
        fig.notes.append(f"Skipped for lack of disk space: {skipped} MB.")
    return fig


# -- figure 6: integrity hashes vs the disk write ------------------------------------------------


def figure_6(cfg: Config, workdir: Path) -> Figure:
    import hashlib
    import importlib.util

    import xxhash

    fig = Figure(
        "6",
        f"Integrity hashes vs writing the same {cfg.hash_mib} MiB to a file (page cache, then fsync)",
        "GB/s",
        "write",
        "throughput / write throughput (paired by repetition)",
    )
    data = os.urandom(cfg.hash_mib * MB)
    view = memoryview(data)
    target = workdir / "hash-write.bin"

    def timed(fn: Callable[[], Any]) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            fn()
            return {"gbps": len(data) / (time.perf_counter() - begin) / 1e9}

        return run

    def write() -> None:
        with open(target, "wb") as f:
            for start in range(0, len(view), 4 * MB):
                f.write(view[start : start + 4 * MB])

    def write_fsync() -> None:
        with open(target, "wb") as f:
            for start in range(0, len(view), 4 * MB):
                f.write(view[start : start + 4 * MB])
            f.flush()
            os.fsync(f.fileno())

    variants: dict[str, Callable[[int], dict[str, float]]] = {
        "write": timed(write),
        "write_fsync": timed(write_fsync),
        "sha256": timed(lambda: hashlib.sha256(view).hexdigest()),
        "xxh3": timed(lambda: xxhash.xxh3_128(view).hexdigest()),
    }
    has_blake3 = importlib.util.find_spec("blake3") is not None
    if has_blake3:
        import blake3

        variants["blake3"] = timed(lambda: blake3.blake3(view).hexdigest())
    try:
        samples = _run_interleaved(cfg.reps, variants, warmup=cfg.warmup)
    finally:
        target.unlink(missing_ok=True)
    labels = {
        "write": "write to a file (page cache)",
        "write_fsync": "write to a file + fsync",
        "sha256": "sha256 (hashlib; format version 1)",
        "blake3": "BLAKE3 (blake3 package, one thread)",
        "xxh3": "XXH3-128 (xxhash; what format version 2 writes)",
    }
    for name in ("write", "write_fsync", "sha256", "blake3", "xxh3"):
        if name in samples:
            fig.rows.append(Row(name, labels[name], samples[name]["gbps"]))
        elif name == "blake3":
            fig.rows.append(Row(name, labels[name] + ": not installed", None))
    _fill_ratios(fig, "write")
    r = fig.row("xxh3").ratio
    fig.targets.append(
        Target("XXH3-128 / write (integrity check vs disk write)", r, "≥ 4.00", _at_least(r, 4.0), "xxh3")
    )
    fig.notes.append(
        "Hashing runs in the writer's helper thread while the file is written; below the write speed it "
        "holds the writer back. sha256 and BLAKE3 (one thread) do, XXH3-128 does not: it is the one written."
    )
    return fig


# -- figure 7: bundle bytes of a streamed generate() ---------------------------------------------


def _distinct_bytes(observer: Any) -> int:
    """Bytes of data a generate() really produced: each tensor less the longest earlier tensor it extends.

    Brute force over *every* earlier tensor (not only the recent ones the writer compares with):
    an independent count of the distinct data the bundle must hold.
    """
    from iobundle.calls import extends_bytes

    table = observer._table  # the snapshots, by key, in recording order
    keys: dict[str, None] = {}
    for call in observer._recorded().calls:
        keys.update(dict.fromkeys(_call_tensor_keys(call)))
    seen: dict[tuple[Any, int], list[Any]] = {}
    total = 0
    for key in keys:
        t = table.get(key)
        best = 0
        shape = tuple(t.shape)
        for prev in seen.get((t.dtype, t.dim()), ()):
            p = tuple(prev.shape)
            differ = [d for d in range(len(shape)) if p[d] != shape[d]]
            if len(differ) > 1 or (differ and p[differ[0]] > shape[differ[0]]) or not prev.numel():
                continue
            dim = differ[0] if differ else 0
            if prev.numel() * prev.element_size() > best and extends_bytes(t, prev, dim):
                best = prev.numel() * prev.element_size()
        total += t.numel() * t.element_size() - best
        seen.setdefault((t.dtype, t.dim()), []).append(t)
    return total


def _call_tensor_keys(call: Any) -> list[str]:
    from iobundle.calls import tensor_keys

    keys = [k for a in call.args for k in tensor_keys(a)]
    keys += [k for v in call.kwargs.values() for k in tensor_keys(v)]
    if call.outputs is not None:
        keys += tensor_keys(call.outputs)
    return keys


def figure_7(cfg: Config, workdir: Path) -> Figure:
    import torch

    from iobundle import InputObserver

    n = cfg.size_tokens
    fig = Figure(
        "7",
        f"Bundle bytes of a streamed greedy generate() of the tiny Llama: N = {n} and 2N = {2 * n} new tokens",
        "KiB",
        f"n{n}",
        f"bytes / bytes for N = {n}",
    )
    model = tiny_llama()
    prompt = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    measured: dict[int, dict[str, float]] = {}
    for tokens in (n, 2 * n):
        path = workdir / f"size-{tokens}.iobundle"
        observer = InputObserver()
        with torch.no_grad(), observer(model, store_n_calls=tokens + 16, stream_to=path):
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        files = [p for p in path.rglob("*") if p.is_file()]
        tensor_files = [p for p in files if p.suffix == ".safetensors"]
        total = sum(p.stat().st_size for p in files)
        # distinct data: counted on an in-memory recording of the same generate()
        memory = InputObserver()
        with torch.no_grad(), memory(model, store_n_calls=tokens + 16):
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        distinct = _distinct_bytes(memory)
        whole = sum(
            t.numel() * t.element_size()
            for t in (memory._table.get(k) for k in {k for c in memory._recorded().calls for k in _call_tensor_keys(c)})
        )
        last = memory._recorded().calls[-1]
        final_cache = sum(
            t.numel() * t.element_size()
            for t in (
                memory._table.get(k) for k in _call_tensor_keys(last.model_copy(update={"args": [], "kwargs": {}}))
            )
            if t.dim() == 4
        )
        measured[tokens] = {
            "total": total,
            "tensor_files": sum(p.stat().st_size for p in tensor_files),
            "manifest": (path / "manifest.json").stat().st_size,
            "distinct": distinct,
            "whole": whole,
            "final_cache": final_cache,
            "files": len(files),
        }
        _remove(path)
    for tokens in (n, 2 * n):
        m = measured[tokens]
        fig.rows.append(
            Row(
                f"n{tokens}",
                f"{tokens} new tokens: whole bundle (tensor files + manifest.json)",
                [m["total"] / 1024],
                note=(
                    f"tensor files {m['tensor_files'] / 1024:,.1f} KiB, manifest {m['manifest'] / 1024:,.1f} KiB "
                    f"({m['manifest'] / tokens:,.0f} B per call), "
                    f"{m['files']} files; distinct data {m['distinct'] / 1024:,.1f} KiB (final cache "
                    f"{m['final_cache'] / 1024:,.1f} KiB); every tensor whole would be {m['whole'] / 1024:,.1f} KiB"
                ),
            )
        )
        fig.rows.append(Row(f"distinct{tokens}", f"{tokens} new tokens: distinct data", [m["distinct"] / 1024]))
    fig.rows[0].ratio = 1.0
    growth = measured[2 * n]["total"] / measured[n]["total"]
    fig.rows[2].ratio = growth
    fig.rows[1].ratio = measured[n]["distinct"] / measured[n]["total"]
    fig.rows[3].ratio = measured[2 * n]["distinct"] / measured[n]["total"]
    fig.targets.append(Target(f"size({2 * n}) / size({n})", growth, "≤ 2.10", _at_most(growth, 2.1), f"n{2 * n}"))
    for tokens in (n, 2 * n):
        m = measured[tokens]
        r = m["total"] / m["distinct"]
        fig.targets.append(
            Target(f"bundle / distinct data, {tokens} tokens", r, "≤ 1.20", _at_most(r, 1.2), f"n{tokens}")
        )
        r = m["tensor_files"] / m["distinct"]
        fig.targets.append(
            Target(f"tensor files / distinct data, {tokens} tokens (no manifest)", r, "(no target)", None, f"n{tokens}")
        )
    fig.notes.append(
        "Distinct data: each recorded tensor less the longest earlier tensor it extends bit for bit (brute force "
        "over all earlier tensors), i.e. the final cache plus the new part of every other input and output."
    )
    return fig


# -- figure 8: open + inspect a bundle of many calls ------------------------------------------------


def figure_8(cfg: Config, workdir: Path) -> Figure:
    import io

    import torch

    from iobundle import InputObserver, load_bundle
    from iobundle.cli import main as cli_main
    from iobundle.schema import load_journal, load_manifest

    calls = cfg.open_many_calls
    fig = Figure(
        "8",
        f"Open + inspect a bundle of {calls} decoder-step calls (a 2-layer cache growing by one position per call)",
        "ms",
        "saved",
        "time / saved bundle (paired by repetition)",
    )

    class Step(torch.nn.Module):
        def forward(self, input_ids, past, attention_mask, cache_position):
            return {"logits": input_ids.float(), "past": [torch.cat([p, p[:, :, -1:]], dim=2) for p in past]}

    def record(stream_to: Path | None) -> InputObserver:
        observer = InputObserver()
        past = [torch.randn(1, 2, 4, 8) for _ in range(4)]
        with observer(Step(), store_n_calls=calls, stream_to=stream_to) as obs:
            model = obs._observed_model
            for i in range(calls):
                out = model(torch.tensor([[i]]), past, torch.ones(1, 4 + i), torch.tensor([4 + i]))
                past = out["past"]
        return observer

    saved, journal = workdir / "many-saved.iobundle", workdir / "many-journal.iobundle"
    v2 = workdir / "many-v2.iobundle"
    record(None).save(saved)
    shutil.copytree(saved, journal)  # the same calls as a killed stream leaves them: journal only
    (journal / "journal.jsonl").write_bytes(_as_journal(saved))
    (journal / "manifest.json").unlink()
    shutil.copytree(saved, v2)  # the same calls as format version 2 wrote them (whole trees, indented)
    (v2 / "manifest.json").write_text(
        load_manifest(saved).model_copy(update={"format_version": 2}).model_dump_json(indent=1)
    )

    def opener(path: Path, parse: Callable[[Path], Any]) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            parsed = parse(path)
            parsing = time.perf_counter() - begin
            del parsed
            begin = time.perf_counter()
            bundle = load_bundle(path)
            n = bundle.num_obs()
            bundle.infer_dynamic_shapes()
            opened = time.perf_counter() - begin
            begin = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(["inspect", str(path)])
            cli = time.perf_counter() - begin
            if n != calls or code != 0:
                raise RuntimeError(f"{path}: {n} calls, inspect exit code {code}")
            return {"t": opened, "cli": cli, "parse": parsing}

        return run

    try:
        samples = _run_interleaved(
            cfg.reps_open_many,
            {
                "saved": opener(saved, load_manifest),
                "journal": opener(journal, load_journal),
                "v2": opener(v2, load_manifest),
            },
            warmup=cfg.warmup,
        )
        manifest_kib = (saved / "manifest.json").stat().st_size / 1024
        v2_kib = (v2 / "manifest.json").stat().st_size / 1024
    finally:
        _remove(saved)
        _remove(journal)
        _remove(v2)
    open_all = "load_bundle + num_obs + infer_dynamic_shapes"
    rows = [  # row id, variant, sample, label, note
        ("saved", "saved", "t", f"manifest.json: {open_all}", f"manifest {manifest_kib:,.0f} KiB"),
        (
            "saved_cli",
            "saved",
            "cli",
            "manifest.json: `iobundle inspect` (in process)",
            "past 20 calls, one row per run of consecutive calls that differ only in tensor sizes",
        ),
        ("journal", "journal", "t", f"journal.jsonl only (killed stream): {open_all}", ""),
        ("journal_cli", "journal", "cli", "journal.jsonl only: `iobundle inspect` (in process)", ""),
        ("saved_parse", "saved", "parse", "manifest.json: load_manifest alone (the part of the open above that parses)", ""),
        ("journal_parse", "journal", "parse", "journal.jsonl only: load_journal alone", ""),
        ("v2", "v2", "t", f"the same calls as format version 2: {open_all}", f"manifest {v2_kib:,.0f} KiB"),
        ("v2_parse", "v2", "parse", "format version 2: load_manifest alone", ""),
    ]
    for row_id, variant, sample, label, note in rows:
        fig.rows.append(Row(row_id, label, [t * 1e3 for t in samples[variant][sample]], note=note))
    _fill_ratios(fig, "saved")
    for variant in ("saved", "saved_cli", "journal", "journal_cli"):
        med = statistics.median(fig.row(variant).samples or [float("nan")])
        fig.targets.append(
            Target(f"open+inspect {calls} calls, {variant} (ms)", med, "< 50 ms", _below(med, 50.0), variant)
        )
    return fig


def _as_journal(bundle: Path) -> bytes:
    """The journal a stream of ``bundle``'s calls would have written (head, then one line per call)."""
    from iobundle.schema import journal_call_line, journal_head_line, load_manifest

    manifest = load_manifest(bundle)
    lines = [journal_head_line(manifest.model_copy(update={"calls": [], "tensors": {}, "files": {}}))]
    for call in manifest.calls:
        file = f"calls/{call.index:06d}.safetensors"
        tensors = {k: e for k, e in manifest.tensors.items() if e.file == file}
        files = {file: manifest.files[file]} if file in manifest.files else {}
        lines.append(journal_call_line(call, tensors, files))
    return b"".join(lines)


# -- figure 5: check_discrepancies vs a bare onnxruntime loop --------------------------------------


def _export_linear(cfg: Config, workdir: Path) -> tuple[Path, Path]:
    import torch

    from iobundle import InputObserver, load_bundle

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model, store_n_calls=len(cfg.validate_linear_rows)):
        for rows in cfg.validate_linear_rows:
            model(torch.rand(rows, 1024))
    bundle_path = workdir / "validate-linear.iobundle"
    observer.save(bundle_path, overwrite=True)
    onnx_path = workdir / "linear.onnx"
    load_bundle(bundle_path).to_onnx(model, onnx_path)
    return bundle_path, onnx_path


def _export_demo(workdir: Path) -> tuple[Path, Path]:
    from iobundle import load_bundle
    from iobundle.demo import capture_demo, demo_model

    bundle_path, _ = capture_demo(workdir)
    onnx_path = workdir / "demo.onnx"
    load_bundle(bundle_path).to_onnx(demo_model(), onnx_path)
    return bundle_path, onnx_path


def _validation_case(cfg: Config, fig: Figure, bundle_path: Path, onnx_path: Path) -> None:
    import numpy as np
    import onnxruntime as ort

    from iobundle import load_bundle

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    meta = dict(session.get_modelmeta().custom_metadata_map)
    names = [i.name for i in session.get_inputs()]
    slots = json.loads(meta["iobundle.input_slots"]) if "iobundle.input_slots" in meta else dict(zip(names, range(99)))
    source = load_bundle(bundle_path)
    feeds = []
    for i in range(source.num_obs()):
        flat = source.infer_arguments(i, flat=True)
        feeds.append({n: np.array(flat[slots[n]].numpy(), copy=True) for n in names})
    del source, session

    def options() -> Any:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        return opts

    def bare(rep: int) -> dict[str, float]:
        begin = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), options(), providers=["CPUExecutionProvider"])
        created = time.perf_counter()
        for f in feeds:
            sess.run(None, f)
        end = time.perf_counter()
        return {"t": end - begin, "runs": end - created}

    ok = {"all": True}

    def check(verify: bool) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            begin = time.perf_counter()
            rows = load_bundle(bundle_path, verify=verify).check_discrepancies(onnx_path)
            elapsed = time.perf_counter() - begin
            ok["all"] = ok["all"] and all(r["SUCCESS"] for r in rows) and len(rows) == len(feeds)
            return {"t": elapsed}

        return run

    samples = _run_interleaved(
        cfg.reps_cheap, {"bare": bare, "check": check(True), "check_noverify": check(False)}, warmup=cfg.warmup
    )
    case = onnx_path.stem
    fig.rows.append(
        Row(
            f"{case}:bare",
            f"{case}: bare onnxruntime loop (session + {len(feeds)} runs)",
            [s * 1e3 for s in samples["bare"]["t"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:bare_runs",
            f"{case}: the {len(feeds)} session.run calls alone",
            [s * 1e3 for s in samples["bare"]["runs"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:check",
            f"{case}: load_bundle(...).check_discrepancies(onnx)",
            [s * 1e3 for s in samples["check"]["t"]],
        )
    )
    fig.rows.append(
        Row(
            f"{case}:check_noverify",
            f"{case}: same with load_bundle(verify=False)",
            [s * 1e3 for s in samples["check_noverify"]["t"]],
        )
    )
    base = samples["bare"]["t"]
    for name in ("bare", "check", "check_noverify"):
        fig.row(f"{case}:{name}").ratio = paired_ratio(samples[name]["t"], base)
    fig.row(f"{case}:bare_runs").ratio = paired_ratio(samples["bare"]["runs"], base)
    r = fig.row(f"{case}:check").ratio
    fig.targets.append(
        Target(
            f"{case}: check_discrepancies / bare loop",
            r,
            "≤ 1.10",
            _at_most(r, 1.1),
            f"{case}:check",
            "" if ok["all"] else "some calls did not pass validation",
        )
    )


def figure_5(cfg: Config, workdir: Path) -> Figure:
    fig = Figure(
        "5",
        "Validation: check_discrepancies vs a bare onnxruntime loop over the same inputs",
        "ms",
        "bare",
        "time / bare loop (session creation + runs) of the same case, paired by repetition",
    )
    linear_bundle, linear_onnx = _export_linear(cfg, workdir)
    _validation_case(cfg, fig, linear_bundle, linear_onnx)
    paths = [linear_bundle, linear_onnx]
    if cfg.validate_demo:
        demo_bundle, demo_onnx = _export_demo(workdir)
        _validation_case(cfg, fig, demo_bundle, demo_onnx)
        paths += [demo_bundle, demo_onnx]
    fig.notes.append(
        f"linear: Linear(1024, 1024) on {len(cfg.validate_linear_rows)} calls of {list(cfg.validate_linear_rows)}x1024; "
        "demo: iobundle.demo.capture_demo (the tiny decoder, prefill + 5 decode calls). Both exported with "
        "Bundle.to_onnx; feeds of the bare loop are prepared in memory beforehand."
    )
    for path in paths:
        _remove(path)
    return fig


# -- output -----------------------------------------------------------------------------------------


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "—"
    if value != value:  # nan
        return "nan"
    magnitude = abs(value)
    if magnitude >= 100:
        text = f"{value:,.0f}"
    elif magnitude >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return text + unit


def _fmt_ratio(value: float | None) -> str:
    """Ratios near a threshold get three decimals, so that 0.996 does not print as a "1.00" that passes."""
    if value is None or value != value or abs(value) >= 10:
        return _fmt(value)
    return f"{value:.3f}"


def _met(met: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[met]


def render_markdown(results: dict[str, Any]) -> str:
    m, v = results["machine"], results["versions"]
    lines = [
        f"Run of {results['started']} ({'--quick smoke run: sizes are tiny, numbers mean nothing' if results['quick'] else 'full run'}), "
        f"{results['seconds']:.0f} s in all.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['ram_gib']} GiB RAM; "
        f"load average {results['loadavg_start']} at the start, {results['loadavg_end']} at the end.",
        f"- Versions: python {v['python']}, torch {v['torch']}, onnxruntime {v['onnxruntime']}, "
        f"transformers {v['transformers']}, safetensors {v['safetensors']}, iobundle {v['iobundle']} "
        f"({v['iobundle_commit']}).",
        f"- Streaming capture (`stream_to=`): {'available' if results['streaming_available'] else 'not available in this iobundle'}.",
        f"- torch intra-op threads: {results.get('torch_threads')} (onnxruntime: its default).",
        "- Ratios are medians of per-repetition ratios (variants interleaved within each repetition); "
        "median and min–max are over repetitions.",
        "",
        "### Targets",
        "",
        "| figure | check | ratio | target | met? |",
        "|---|---|---|---|---|",
    ]
    for fig in results["figures"]:
        for t in fig["targets"]:
            note = f" ({t['note']})" if t["note"] else ""
            lines.append(
                f"| {fig['id']} | {t['check']}{note} | {_fmt_ratio(t['ratio'])} | {t['target']} | {_met(t['met'])} |"
            )
    for fig in results["figures"]:
        lines += ["", f"### {fig['id']}. {fig['title']}", ""]
        lines.append(f"Unit: {fig['unit']}. Ratio: {fig['ratio_meaning']}.")
        lines += ["", "| variant | median | min–max | ratio | target | met? | note |", "|---|---|---|---|---|---|---|"]
        for row in fig["rows"]:
            targets = [t for t in fig["targets"] if t["row"] == row["variant"]]
            target_text = "; ".join(f"{t['check']}: {_fmt_ratio(t['ratio'])} {t['target']}" for t in targets) or ""
            met_text = "; ".join(_met(t["met"]) for t in targets) or ""
            if not row["available"]:
                lines.append(f"| {row['label']} | not available | — | — | {target_text} | {met_text} | |")
                continue
            lines.append(
                f"| {row['label']} | {_fmt(row['median'])} | {_fmt(row['min'])}–{_fmt(row['max'])} | "
                f"{_fmt(row['ratio'])} | {target_text} | {met_text} | {row.get('note', '')} |"
            )
        for note in fig["notes"]:
            lines.append("")
            lines.append(f"- {note}")
        lines.append("")
        lines.append(f"({fig['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"


BENCHMARKS_HEADER = """# Benchmarks

Side-by-side measurements of iobundle against the plain call, `torch.onnx.InputObserver`,
raw file writes, safetensors, `torch.save` and a bare onnxruntime loop (GitHub issue 6).
Run `make bench` (about eight minutes on two busy cores; `--only 1c,7` for single figures) to refresh the block below;
`benchmarks/results.json` holds every sample. `benchmarks/gpu_check.py` measures the CUDA
figures (decode-loop overhead, D2H throughput of the snapshot) where a GPU is present.

"""


def write_markdown(path: Path, table: str) -> None:
    block = f"{RESULTS_BEGIN}\n{table}{RESULTS_END}\n"
    if path.exists():
        text = path.read_text("utf-8")
        if RESULTS_BEGIN in text and RESULTS_END in text:
            head, rest = text.split(RESULTS_BEGIN, 1)
            _, tail = rest.split(RESULTS_END, 1)
            path.write_text(head + block + tail.lstrip("\n"), "utf-8")
            return
    path.write_text(BENCHMARKS_HEADER + block, "utf-8")


# -- main -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    root = Path(tempfile.mkdtemp(prefix="iobundle-bench-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(cfg: Config, workdir: Path, only: set[str], log: Callable[[str], None]) -> dict[str, Any]:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    loadavg_start = _loadavg()
    results: dict[str, Any] = {
        "started": started,
        "quick": cfg.quick,
        "config": asdict(cfg),
        "machine": machine_info(workdir),
        "versions": versions(),
        "streaming_available": streaming_supported(),
        "loadavg_start": loadavg_start,
        "figures": [],
    }
    steps: list[tuple[str, Callable[[], Figure | None]]] = [
        ("1a", lambda: figure_1a(cfg, workdir)),
        ("1b", lambda: figure_1b(cfg, workdir)),
        ("1c", lambda: figure_1c(cfg, workdir)),
        ("1d", lambda: figure_1c(cfg, workdir, long=True)),
        ("2", lambda: figure_2(cfg, workdir)),
        ("3", lambda: None),  # figure 3 and 3r together, below
        ("4", lambda: figure_4(cfg, workdir)),
        ("5", lambda: figure_5(cfg, workdir)),
        ("6", lambda: figure_6(cfg, workdir)),
        ("7", lambda: figure_7(cfg, workdir)),
        ("8", lambda: figure_8(cfg, workdir)),
    ]
    for fig_id, step in steps:
        if fig_id == "3":
            if not only & {"3", "3r"}:
                continue
            begin = time.perf_counter()
            log("figure 3 ...")
            read_fig = _read_figure() if "3r" in only else None
            try:
                write_fig = figure_3(cfg, workdir, read_fig)
            finally:
                _empty_trash()
            figs = [write_fig] if "3" in only else []
            if read_fig is not None:
                figs.append(read_fig)
            elapsed = time.perf_counter() - begin
            for f in figs:
                f.seconds = elapsed / len(figs)
                results["figures"].append(f.as_dict())
            log(f"figure 3 done in {elapsed:.1f} s")
            continue
        if fig_id not in only:
            continue
        log(f"figure {fig_id} ...")
        begin = time.perf_counter()
        _collect()
        try:
            fig = step()
        finally:
            _empty_trash()
        assert fig is not None
        fig.seconds = time.perf_counter() - begin
        results["figures"].append(fig.as_dict())
        log(f"figure {fig_id} done in {fig.seconds:.1f} s")
    results["loadavg_end"] = _loadavg()
    results["seconds"] = time.perf_counter() - t0
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repetitions: a smoke run (< 1 min)")
    parser.add_argument(
        "--out", help="directory for results.json and BENCHMARKS.md (default: benchmarks/ and the repository root)"
    )
    parser.add_argument("--only", help=f"comma-separated figures to run, among {','.join(FIGURES)}")
    parser.add_argument("--workdir", help="where bundles and files are written (default: a fresh dir under /tmp)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a small shared machine more threads than free cores "
        "make every timing swing by 10x; the other core is left to iobundle's writer thread)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite BENCHMARKS.md from an existing results.json, measure nothing",
    )
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    parser.add_argument("--child-mib", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-calls", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    if args.child_memory:
        print(json.dumps(memory_child(args.child_memory, args.child_mib, args.child_calls, Path(args.workdir))))
        return 0

    _quiet()
    cfg = QUICK if args.quick else FULL
    only = set(FIGURES) if not args.only else {s.strip() for s in args.only.split(",")}
    unknown = only - set(FIGURES)
    if unknown:
        parser.error(f"unknown figures {sorted(unknown)}; choose among {FIGURES}")

    def log(message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out / "results.json", out / "BENCHMARKS.md"
    else:
        json_path, md_path = ROOT / "benchmarks" / "results.json", ROOT / "BENCHMARKS.md"
    if args.render_only:
        results = json.loads(json_path.read_text("utf-8"))
    else:
        with _workdir(args.workdir) as workdir:
            results = run(cfg, workdir, only, log)
        results["torch_threads"] = args.threads
        json_path.write_text(json.dumps(results, indent=1) + "\n", "utf-8")
    table = render_markdown(results)
    write_markdown(md_path, table)
    print(table)
    log(f"wrote {json_path} and {md_path} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
