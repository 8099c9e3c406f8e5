"""Per-layer scaling (GitHub issue 19, item 5): how each export step's time grows with the number of layers.

Run ``make bench-layers`` (or ``nice .venv/bin/python benchmarks/layers.py``); not part of ``make bench``
nor of CI, which runs it on two tiny sizes only (``tests/test_benchmarks.py``). A Llama-shaped decoder
of a small width (hidden 64, so that the time goes to the graph's nodes, not to arithmetic) at each
layer count of ``--layers`` (default 6, 12, 24, 48) is built from a config with random weights and
its greedy ``generate()`` recorded, once per size (``save(include_model=True)``). Then, ``--reps``
times per size (sizes interleaved within each repetition, each a fresh process), what
``iobundle export BUNDLE --from-bundle --batch-all`` and ``iobundle validate`` do, from the bundle
alone, timed step by step with ``time.perf_counter`` (through the progress events and by wrapping
the functions that ``torch.onnx.export`` calls in turn):

- load the model from the bundle; inference (aligned calls, dynamic shapes, arguments);
- ``torch.export``; the check on every recorded call; the check beyond the recorded calls;
- ``torch.onnx.export``, split: what comes before the decompositions (our graph rewrites, torch's
  registry of ONNX functions), the decompositions
  (``run_decompositions``), the FX-to-ONNX translation, onnxscript's optimizer, our own passes after
  it (names of the outputs, inputs and axes, metadata), the save;
- validate (onnxruntime on every recorded call).

Each step's time is its CPU time (``time.process_time``: on a shared machine a process's wall time
follows the others' load, its CPU time much less; both are kept in the JSON). Its growth between two
layer counts is the exponent ``log(time ratio) / log(layer ratio)`` (1 is linear), from the least
repetition of each size; the exponent over the whole range is the
least-squares slope of log time against log layers. ``--profile DIR`` also writes a cProfile of each
export process to ``DIR`` (the timings then include the profiler's overhead).

Writes ``benchmarks/results_layers.json`` and the ``layers`` block of ``BENCHMARKS.md`` (``--out DIR``
writes both there instead).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: sys.path[0] is benchmarks/, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT
from benchmarks.measure import (
    DECODER_SIZES,
    GROWTH_TARGET,
    PhaseSampler,
    capture_decoder,
    check_decoder_arguments,
    child_argv,
    growth,
    layer_counts,
    measure_and_write,
    met,
)
from benchmarks.report import LAYERS_BEGIN, LAYERS_END

# The steps, in the order they run; the names are the phases the export process marks.
STEPS = (
    "load model from the bundle",
    "inference (align, dynamic shapes, arguments)",
    "torch.export",
    "the program as a module (ExportedProgram.module())",
    "check on every recorded call",
    "check beyond the recorded calls",
    "ONNX: before the decompositions (our rewrites, torch's ONNX function registry)",
    "ONNX: decompositions (run_decompositions)",
    "ONNX: FX→ONNX translation",
    "ONNX: onnxscript optimizer",
    "ONNX: our passes (names, axes, metadata)",
    "ONNX: save",
    "validate (onnxruntime, every call)",
)


# -- the child processes ----------------------------------------------------------------------------


class CpuSampler(PhaseSampler):
    """:class:`PhaseSampler` that also counts each phase's CPU seconds (``time.process_time``).

    The machine is shared: a process's wall time follows the others' load, its CPU time much less
    (the work it did, not the time it waited for a core), so the exponents are taken from CPU time.
    """

    def mark(self, name: str) -> None:
        if self.phases and self.phases[-1]["phase"] == name:
            return
        now = time.process_time()
        if self.phases:
            self.phases[-1]["cpu_seconds"] = now - self.phases[-1]["cpu_begin"]
        super().mark(name)
        self.phases[-1]["cpu_begin"] = now


def _wrap(owner: Any, name: str, before: str, after: str | None, sampler: PhaseSampler) -> None:
    """Mark ``before`` when ``owner.name`` is called and ``after`` (if any) when it returns."""
    original = getattr(owner, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        sampler.mark(before)
        try:
            return original(*a, **k)
        finally:
            if after is not None:
                sampler.mark(after)

    setattr(owner, name, wrapped)


def _mark_onnx_steps(sampler: PhaseSampler) -> None:
    """Mark the steps inside ``torch.onnx.export`` by wrapping the functions it calls in turn."""
    import torch
    from torch.onnx._internal.exporter import _core

    _wrap(_core, "_prepare_exported_program_for_export", STEPS[7], None, sampler)
    _wrap(_core, "_exported_program_to_onnx_program", STEPS[8], None, sampler)
    _wrap(torch.onnx.ONNXProgram, "optimize", STEPS[9], STEPS[10], sampler)
    _wrap(torch.onnx.ONNXProgram, "save", STEPS[11], "after the save", sampler)


def _export_and_validate(args: argparse.Namespace) -> dict[str, Any]:
    from iobundle import load_bundle
    from iobundle.replay import ProgressEvent, load_bundle_model

    sampler = CpuSampler()
    _mark_onnx_steps(sampler)

    def on_progress(event: ProgressEvent) -> None:
        if event.task == "torch.export":
            sampler.mark(STEPS[2] if event.done == 0 else STEPS[3])
        elif event.task.startswith("check") and event.done == 0:
            sampler.mark(STEPS[4])
        elif event.task.startswith("check") and event.done == event.total:
            sampler.mark(STEPS[5])

    sampler.mark("open bundle")
    bundle = load_bundle(args.bundle)
    sampler.mark(STEPS[0])
    model = load_bundle_model(bundle)
    sampler.mark(STEPS[1])
    bundle.infer_dynamic_shapes(set_batch_dimension_for=True)
    bundle.infer_arguments()
    result = bundle.export_programs(model, set_batch_dimension_for=True, on_progress=on_progress)
    if not result.ok or len(result.programs) != 1:
        raise SystemExit(f"export: {len(result.programs)} programs, ok={result.ok}")
    sampler.mark(STEPS[6])
    path = result.to_onnx(args.onnx)
    sampler.mark(STEPS[12])
    report = bundle.validate(path)
    if not report.ok:
        raise SystemExit(f"validate: {report.verdict()}")
    phases = sampler.stop()
    cpu, wall = {step: 0.0 for step in STEPS}, {step: 0.0 for step in STEPS}
    for p in phases:
        if p["phase"] in cpu:
            cpu[p["phase"]] += p["cpu_seconds"]
            wall[p["phase"]] += p["seconds"]
    other = sum(p["cpu_seconds"] for p in phases if p["phase"] not in cpu and p["phase"] != "start")
    return {"cpu_seconds": cpu, "wall_seconds": wall, "other_cpu_seconds": other,
            "rss_peak": max(p["rss_peak"] for p in phases)}  # fmt: skip


def run_child(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.common import quiet

    quiet()
    import transformers  # noqa: F401  (imported before the clock starts: not a step)

    import iobundle.replay  # noqa: F401

    if args.child == "capture":
        out = capture_decoder(args)
    elif args.profile:
        import cProfile

        profiler = cProfile.Profile()
        out = profiler.runcall(_export_and_validate, args)
        profiler.dump_stats(args.profile)
    else:
        out = _export_and_validate(args)
    if args.child == "export":  # also beside the ONNX file (kept with --keep): a run cut short keeps its last steps
        Path(args.onnx).with_name("steps.json").write_text(json.dumps(out, indent=1) + "\n", "utf-8")
    print(json.dumps(out))
    return 0


# -- the parent -------------------------------------------------------------------------------------


def _child_argv(args: argparse.Namespace, child: str, layers: int, work: Path, profile: Path | None) -> list[str]:
    argv = child_argv(args, __file__, ("--child", child), layers, work)
    return argv + (["--profile", str(profile)] if profile else [])


def _run(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[3]} at {argv[5]} layers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def slope(layers: list[int], seconds: list[float]) -> float:
    """The least-squares slope of log(seconds) against log(layers): the growth exponent over the range."""
    pairs = [(math.log(n), math.log(s)) for n, s in zip(layers, seconds) if s > 0]
    if len(pairs) < 2:
        return float("nan")
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    return sum((x - mx) * (y - my) for x, y in pairs) / sxx if sxx else float("nan")


def summarise(layer_counts: list[int], runs: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per step: the fastest repetition at each size, the exponent between sizes and over the range."""
    rows = []
    for step in (*STEPS, "total"):
        best = []
        for n in layer_counts:
            times = [sum(r["cpu_seconds"].values()) if step == "total" else r["cpu_seconds"][step] for r in runs[n]]
            best.append(min(times))
        pairs = [
            growth(a, b, la, lb)
            for (a, b), (la, lb) in zip(itertools.pairwise(best), itertools.pairwise(layer_counts))
        ]
        rows.append({"step": step, "cpu_seconds": best, "pair_exponents": pairs, "exponent": slope(layer_counts, best)})
    return rows


def measure(args: argparse.Namespace, workdir: Path, log: Any) -> dict[str, Any]:
    sizes: dict[int, dict[str, Any]] = {}
    for n in args.layer_counts:
        work = workdir / f"layers-{n}"
        shutil.rmtree(work, ignore_errors=True)
        (work / "onnx").mkdir(parents=True)
        sizes[n] = _run(_child_argv(args, "capture", n, work, None))
        log(f"{n} layers: captured {sizes[n]['calls']} calls, {sizes[n]['params'] / 1e6:.2f} M parameters")
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.layer_counts}
    for rep in range(args.reps):
        for n in args.layer_counts:
            profile = Path(args.profile) / f"export-{n}-{rep}.prof" if args.profile else None
            out = _run(_child_argv(args, "export", n, workdir / f"layers-{n}", profile))
            runs[n].append(out)
            log(f"rep {rep + 1}/{args.reps}, {n} layers: {sum(out['cpu_seconds'].values()):.1f} CPU s of steps "
                f"({sum(out['wall_seconds'].values()):.1f} s wall)")  # fmt: skip
    if not args.keep:
        for n in args.layer_counts:
            shutil.rmtree(workdir / f"layers-{n}", ignore_errors=True)
    return {
        "sizes": [{"layers": n, **sizes[n], "runs": runs[n]} for n in args.layer_counts],
        "steps": summarise(args.layer_counts, runs),
    }


def _exp(value: float) -> str:
    return "nan" if value != value else f"{value:.2f}"


def render(results: dict[str, Any]) -> str:
    cfg, layers = results["config"], results["config"]["layers"]
    sizes = ", ".join(f"{s['layers']} ({s['params'] / 1e6:.2f} M)" for s in results["sizes"])
    lines = [
        f"Run of {results['started']}, {results['seconds']:.0f} s in all (`benchmarks/layers.py`).",
        "",
        f"- Llama-shaped decoder, random weights, float32: hidden {cfg['hidden']}, intermediate {cfg['intermediate']}, "
        f"{cfg['heads']} heads ({cfg['kv_heads']} key/value), vocabulary {cfg['vocab']}; layers (parameters): {sizes}; "
        f"recorded: greedy generate() of {cfg['new_tokens']} new tokens on a batch of {cfg['batch']} × "
        f"{cfg['prompt']} prompt tokens ({results['sizes'][0]['calls']} calls); torch threads {cfg['threads']}.",
        f"- Machine: {results['machine']}; load average {results['loadavg_start']} at the start, "
        f"{results['loadavg_end']} at the end.",
        f"- Each step's time is its CPU time (`time.process_time`: the machine is shared, and wall time follows the "
        f"others' load), the least of {cfg['reps']} repetitions (sizes interleaved, each a fresh process). "
        "Exponent: log(time ratio) / log(layer ratio) between neighbouring sizes; over the range, the "
        f"least-squares slope of log time against log layers. 1 is linear; target ≤ {GROWTH_TARGET}.",
        "",
        "| step | " + " | ".join(f"{n} layers" for n in layers) + " | "
        + " | ".join(f"exp. {a}→{b}" for a, b in itertools.pairwise(layers)) + " | exponent | no worse than linear? |",
        "|---|" + "---|" * (2 * len(layers) - 1) + "---|---|",
    ]  # fmt: skip
    for row in results["steps"]:
        name = f"**{row['step']}**" if row["step"] == "total" else row["step"]
        times = " | ".join(f"{s:.2f} s" for s in row["cpu_seconds"])
        pairs = " | ".join(_exp(e) for e in row["pair_exponents"])
        ok = not row["exponent"] > GROWTH_TARGET  # nan (a step too short to time) is not a failure
        lines.append(f"| {name} | {times} | {pairs} | {_exp(row['exponent'])} | {met(ok)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,12,24,48", type=layer_counts,
                        help="layer counts at the same width (default 6,12,24,48)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=2, help="export processes per size (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--intermediate", type=int, default=128, help="MLP size (default 128)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    parser.add_argument("--batch", type=int, default=2, help="batch of the recorded generate() (default 2)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--new-tokens", type=int, default=3, help="new tokens (default 3: 3 recorded calls)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--workdir", help="where bundles and ONNX files go (default: a fresh dir under /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep each size's bundle and ONNX file")
    parser.add_argument("--profile", help="directory for a cProfile of each export process (export-N-REP.prof)")
    parser.add_argument("--out", help="directory for results_layers.json and BENCHMARKS.md "
                        "(default: benchmarks/ and the repository root)")  # fmt: skip
    parser.add_argument("--child", choices=("capture", "export"), help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    parser.add_argument("--onnx", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_decoder_arguments(parser, args, "reps")
    args.layer_counts = args.layers
    if args.child:
        if len(args.layer_counts) != 1 or not args.bundle or not args.onnx:
            parser.error("--child takes one --layers count, --bundle and --onnx")
        args.layers = args.layer_counts[0]
    elif len(args.layer_counts) < 2:
        parser.error("--layers: give at least two layer counts, the growth is measured between them")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    return measure_and_write(
        args,
        name="layers",
        measure=measure,
        render=render,
        config_keys=(*DECODER_SIZES, "reps"),
        markers=(LAYERS_BEGIN, LAYERS_END),
    )


if __name__ == "__main__":
    sys.exit(main())
