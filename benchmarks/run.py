"""Side-by-side benchmarks of iobundle (GitHub issue 6), reported as ratios.

Run ``make bench`` (or ``.venv/bin/python benchmarks/run.py``). It writes
``benchmarks/results.json`` and the results table of ``BENCHMARKS.md`` (between the
``results`` markers; the text around them is kept). ``--quick`` is a smoke run of under a
minute with small sizes and two repetitions; its numbers mean nothing, it only proves that
every figure still runs (``tests/test_benchmarks.py`` calls it).

Figures (each measured side by side in one run, variants interleaved within a repetition,
ratios are medians of the per-repetition ratios), one module per family:

- ``capture_cost.py``, 1a-1d: recorded-call cost: plain call, a pre-faulted copy floor,
  ``torch.onnx.InputObserver``, iobundle in memory, iobundle streaming to disk; on an elementwise
  model, a Linear and a tiny Llama ``generate()`` (short and long); 1a and 1b with a second floor, the raw
  write of the same bytes to a new file per call; 1e: the time a decode step spends in the observed call
  on the recording thread (µs), unobserved vs in memory vs streaming;
- ``depth.py``, 1f: what streaming adds to a decode call at 2 to 80 layers, per call and per tensor, and its
  growth exponent in depth;
- ``memory.py``, 2: peak RSS growth while recording many calls (one subprocess per variant);
- ``storage.py``, 3, 3r, 4, 6: bundle write throughput vs a raw sequential write,
  ``safetensors.torch.save_file`` and ``torch.save`` (every variant fsyncs), read throughput
  (informational), time to open and inspect a bundle as its tensor bytes grow, file hashes vs the
  disk write;
- ``validation.py``, 5: ``check_discrepancies`` and ``validate`` time vs a bare onnxruntime loop over the same inputs
  (read from files, the floor of the targets; and prepared in memory);
- ``many_calls.py``, 7, 8: the bytes of a streamed ``generate()`` (delta storage), opening and
  inspecting a bundle of many calls.

``common.py`` holds the sizes of a run (``FULL``, ``QUICK``), the result records and the helpers
they share; ``report.py`` renders the Markdown. This file runs the figures and writes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: sys.path[0] is benchmarks/, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.capture_cost import figure_1a, figure_1b, figure_1c, figure_1e
from benchmarks.common import (
    FIGURES,
    FULL,
    QUICK,
    ROOT,
    Config,
    Figure,
    collect,
    empty_trash,
    loadavg,
    machine_info,
    quiet,
    streaming_supported,
    versions,
)
from benchmarks.depth import figure_1f
from benchmarks.many_calls import figure_7, figure_8
from benchmarks.memory import figure_2, memory_child
from benchmarks.report import render_markdown, write_markdown
from benchmarks.storage import figure_3, figure_4, figure_6, read_figure
from benchmarks.validation import figure_5

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
    loadavg_start = loadavg()
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
        ("1e", lambda: figure_1e(cfg, workdir)),
        ("1f", lambda: figure_1f(cfg, workdir)),
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
            read_fig = read_figure() if "3r" in only else None
            try:
                write_fig = figure_3(cfg, workdir, read_fig)
            finally:
                empty_trash()
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
        collect()
        try:
            fig = step()
        finally:
            empty_trash()
        assert fig is not None
        fig.seconds = time.perf_counter() - begin
        results["figures"].append(fig.as_dict())
        log(f"figure {fig_id} done in {fig.seconds:.1f} s")
    results["loadavg_end"] = loadavg()
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
        "make every timing swing by 10x; the other core is left to iobundle's writer process)",
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

    quiet()
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
