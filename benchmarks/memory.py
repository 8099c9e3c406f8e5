"""Figure 2: peak memory growth while recording many calls, one subprocess per variant."""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
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
    observer_call,
    quiet,
    remove,
    rotate,
    streaming_supported,
)

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
    quiet()
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
            with observer_call(observer, model, calls, target):
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
            sys.executable, str(Path(__file__).with_name("run.py")), "--child-memory", variant,
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
            remove(workdir / f"memory-{variant}-{rep}")
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
        for result in _memory_children(cfg, workdir, rotate(variants, rep), rep):
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
            at_most(net, 2.0),
            "streaming",
            missing,
        )
    )
    fig.targets.append(
        Target(
            "streaming growth (raw, incl. the plain loop's own temporaries), in calls of inputs+outputs",
            raw,
            "≤ 2.00",
            at_most(raw, 2.0),
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
