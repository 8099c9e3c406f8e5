"""Real sizes (GitHub issue 19, item 5): capture, export and validate a Llama-shaped decoder from its bundle alone.

Run ``make bench-large`` (or ``nice .venv/bin/python benchmarks/large.py``); not part of ``make bench``
nor of CI, which runs it on a tiny decoder only (``tests/test_benchmarks.py``). For each layer count
of ``--layers`` (the same width), three fresh processes, one per stage:

- capture: build ``LlamaForCausalLM`` from a config with random weights (seeded), record a greedy
  batch-2 ``generate()`` with ``iobundle.InputObserver`` and ``save(include_model=True)``;
- export: what ``iobundle export BUNDLE --from-bundle --batch-all`` does, through the public API
  (``load_bundle``, ``load_bundle_model``, ``Bundle.export_programs``, ``ProgramSet.to_onnx``), so that
  the progress events mark the phases;
- validate: what ``iobundle validate BUNDLE MODEL.onnx`` does (``Bundle.validate``), onnxruntime on
  every recorded call.

Each stage reports its wall time and its peak RSS (the peak of its own process), set against the
model's weight bytes, and each phase's peak (the kernel's ``VmHWM``, reset as each phase starts):
model load, ``torch.export``, the check on every call, the check beyond the recorded calls,
``torch.onnx.export``'s translation, the ONNX save. Between layer counts, each figure's growth is
reported as the exponent ``log(ratio of figures) / log(ratio of layers)``: 1 is linear.

Writes ``benchmarks/results_large.json`` and the ``large`` block of ``BENCHMARKS.md`` (``--out DIR``
writes both there instead).
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
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
    GB,
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
from benchmarks.report import LARGE_BEGIN, LARGE_END

STAGES = ("capture", "export", "validate")
PEAK_TARGET = 3.0  # peak RSS / weight bytes

# -- the stages (each in its own process) ---------------------------------------------------------


def _stage_capture(args: argparse.Namespace, sampler: PhaseSampler) -> dict[str, Any]:
    return capture_decoder(args, sampler.mark)


def _patch_onnx_save(sampler: PhaseSampler) -> None:
    """Mark the ONNX save apart from the translation (both run inside ``ProgramSet.to_onnx``)."""
    import torch

    original = torch.onnx.ONNXProgram.save

    def save(self: Any, *a: Any, **k: Any) -> Any:
        sampler.mark("ONNX save")
        try:
            return original(self, *a, **k)
        finally:
            sampler.mark("after ONNX save")

    torch.onnx.ONNXProgram.save = save  # type: ignore[method-assign]


def _stage_export(args: argparse.Namespace, sampler: PhaseSampler) -> dict[str, Any]:
    from iobundle import load_bundle
    from iobundle.replay import ProgressEvent, load_bundle_model

    _patch_onnx_save(sampler)

    def on_progress(event: ProgressEvent) -> None:
        if event.task == "torch.export":
            sampler.mark("torch.export" if event.done == 0 else "after torch.export")
        elif event.task.startswith("check") and event.done == 0:
            sampler.mark("check on every recorded call")
        elif event.task.startswith("check") and event.done == event.total:
            sampler.mark("check beyond the recorded calls")

    sampler.mark("open bundle")
    bundle = load_bundle(args.bundle)
    sampler.mark("load model from the bundle")
    model = load_bundle_model(bundle)
    sampler.mark("plan")
    result = bundle.export_programs(model, set_batch_dimension_for=True, on_progress=on_progress)
    if not result.ok:
        raise SystemExit(f"export: the exported program does not reproduce every recorded call: {result}")
    sampler.mark("torch.onnx.export (translation)")
    path = result.to_onnx(args.onnx)
    files = [p for p in Path(args.onnx).parent.iterdir() if p.is_file()]
    return {"programs": len(result.programs), "onnx": path, "onnx_bytes": sum(p.stat().st_size for p in files),
            "onnx_files": sorted(p.name for p in files)}  # fmt: skip


def _stage_validate(args: argparse.Namespace, sampler: PhaseSampler) -> dict[str, Any]:
    from iobundle import load_bundle

    sampler.mark("open bundle")
    bundle = load_bundle(args.bundle)
    sampler.mark("validate (onnxruntime, every call)")
    report = bundle.validate(args.onnx)
    if not report.ok:
        raise SystemExit(f"validate: {report.verdict()}")
    return {"verdict": report.verdict()}


def run_stage(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.common import quiet

    quiet()
    sampler = PhaseSampler()
    sampler.mark("imports")
    import transformers  # noqa: F401  (imported by every stage: counted in its baseline, not in its work)

    import iobundle.replay  # noqa: F401

    baseline = sampler.rss()
    begin = time.perf_counter()
    out = {"capture": _stage_capture, "export": _stage_export, "validate": _stage_validate}[args.stage](args, sampler)
    out["seconds"] = time.perf_counter() - begin
    out["phases"] = sampler.stop()
    out["rss_baseline"] = baseline
    # the process's peak: ru_maxrss where the phase marks could not reset the high-water mark
    out["rss_peak"] = max(p["rss_peak"] for p in out["phases"])
    if not sampler.reset:
        out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps(out))
    return 0


# -- the parent: one process per stage and layer count, then the report ----------------------------


def _run_child(argv: list[str], log: Any) -> dict[str, Any]:
    begin = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        raise SystemExit(f"stage {argv[3]} at {argv[5]} layers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = wall  # incl. the interpreter start and imports
    log(f"  {argv[3]}: {out['seconds']:.1f} s of work, peak RSS {out['rss_peak'] / GB:.2f} GB")
    for p in out["phases"]:
        log(f"    {p['phase']}: {p['seconds']:.1f} s, RSS {p['rss_begin'] / GB:.2f} -> peak {p['rss_peak'] / GB:.2f} GB")
    return out


def measure(args: argparse.Namespace, workdir: Path, log: Any) -> dict[str, Any]:
    sizes = []
    for layers in args.layer_counts:
        work = workdir / f"layers-{layers}"
        shutil.rmtree(work, ignore_errors=True)
        (work / "onnx").mkdir(parents=True)
        log(f"{layers} layers ...")
        stages = {stage: _run_child(child_argv(args, __file__, ("--stage", stage), layers, work), log) for stage in STAGES}
        weight_bytes = stages["capture"]["weight_bytes"]
        bundle_bytes = sum(p.stat().st_size for p in (work / "run.iobundle").rglob("*") if p.is_file())
        for out in stages.values():
            out["peak_over_weights"] = out["rss_peak"] / weight_bytes
            for phase in out["phases"]:
                phase["peak_over_weights"] = phase["rss_peak"] / weight_bytes
        sizes.append({"layers": layers, "params": stages["capture"]["params"], "weight_bytes": weight_bytes,
                      "bundle_bytes": bundle_bytes, "onnx_bytes": stages["export"]["onnx_bytes"],
                      "onnx_files": stages["export"]["onnx_files"], "stages": stages})  # fmt: skip
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    for small, large in itertools.pairwise(sizes):
        for stage in STAGES:
            a, b = small["stages"][stage], large["stages"][stage]
            rows.append({
                "stage": stage, "layers": [small["layers"], large["layers"]],
                "time_ratio": b["seconds"] / a["seconds"], "peak_ratio": b["rss_peak"] / a["rss_peak"],
                "time_exponent": growth(a["seconds"], b["seconds"], small["layers"], large["layers"]),
                "peak_exponent": growth(a["rss_peak"], b["rss_peak"], small["layers"], large["layers"]),
            })  # fmt: skip
    return {"sizes": sizes, "growth": rows}


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"Run of {results['started']}, {results['seconds']:.0f} s in all (`benchmarks/large.py`, "
        f"{'a tiny smoke size: numbers mean nothing' if results['sizes'][0]['params'] < 10**7 else 'make bench-large'}).",
        "",
        f"- Llama-shaped decoder, random weights, float32: hidden {cfg['hidden']}, intermediate {cfg['intermediate']}, "
        f"{cfg['heads']} heads ({cfg['kv_heads']} key/value), vocabulary {cfg['vocab']}, untied embeddings; "
        f"recorded: greedy generate() of {cfg['new_tokens']} new tokens on a batch of {cfg['batch']} × "
        f"{cfg['prompt']} prompt tokens; torch threads {cfg['threads']}.",
        f"- Machine: {results['machine']}; load average {results['loadavg_start']} at the start, "
        f"{results['loadavg_end']} at the end.",
        "- Each stage is a fresh process. Time: the stage's work after its imports; peak: the process's peak RSS "
        "(`VmHWM`, interpreter, torch and transformers included), over the weight bytes.",
        "",
        "| layers | params | weights | bundle | ONNX (files) | stage | time | peak RSS | peak / weights | ≤ 3×? |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in results["sizes"]:
        for stage in STAGES:
            out = size["stages"][stage]
            lines.append(
                f"| {size['layers']} | {size['params'] / 1e6:,.0f} M | {size['weight_bytes'] / GB:.2f} GB | "
                f"{size['bundle_bytes'] / GB:.2f} GB | {size['onnx_bytes'] / GB:.2f} GB ({len(size['onnx_files'])}) | "
                f"{stage} | {out['seconds']:.1f} s | {out['rss_peak'] / GB:.2f} GB | {out['peak_over_weights']:.2f} | "
                f"{met(out['peak_over_weights'] <= PEAK_TARGET)} |"
            )
    if results["growth"]:
        lines += [
            "",
            "Growth with the number of layers (exponent = log(figure ratio) / log(layer ratio); 1 is linear, "
            f"target ≤ {GROWTH_TARGET}):",
            "",
            "| stage | layers | time ratio | time exponent | peak ratio | peak exponent | no worse than linear? |",
            "|---|---|---|---|---|---|---|",
        ]
        for g in results["growth"]:
            ok = g["time_exponent"] <= GROWTH_TARGET and g["peak_exponent"] <= GROWTH_TARGET
            lines.append(
                f"| {g['stage']} | {g['layers'][0]} → {g['layers'][1]} | {g['time_ratio']:.2f} | "
                f"{g['time_exponent']:.2f} | {g['peak_ratio']:.2f} | {g['peak_exponent']:.2f} | {met(ok)} |"
            )
    for size in results["sizes"]:
        lines += ["", f"Phases of each stage, {size['layers']} layers (peak RSS: the kernel's high-water mark, reset as each phase starts):", "",
                  "| stage | phase | time | RSS at start | peak RSS | peak / weights |", "|---|---|---|---|---|---|"]  # fmt: skip
        for stage in STAGES:
            for p in size["stages"][stage]["phases"]:
                if p["phase"] in ("start", "imports"):
                    continue
                lines.append(
                    f"| {stage} | {p['phase']} | {p['seconds']:.1f} s | {p['rss_begin'] / GB:.2f} GB | "
                    f"{p['rss_peak'] / GB:.2f} GB | {p['peak_over_weights']:.2f} |"
                )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24,48", type=layer_counts,
                        help="layer counts at the same width (default 12,24,48: 201M, 336M and 606M parameters, "
                        "the last one's ONNX over 2 GB)")  # fmt: skip
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--intermediate", type=int, default=2816, help="MLP size (default 2816)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--batch", type=int, default=2, help="batch of the recorded generate() (default 2)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--new-tokens", type=int, default=12,
                        help="new tokens of the recorded generate() (default 12: 12 recorded calls)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--workdir", help="where bundles and ONNX files go (default: a fresh dir under /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep each size's bundle and ONNX files")
    parser.add_argument("--out", help="directory for results_large.json and BENCHMARKS.md "
                        "(default: benchmarks/ and the repository root)")  # fmt: skip
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    parser.add_argument("--onnx", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_decoder_arguments(parser, args)
    args.layer_counts = args.layers
    if args.stage:
        if len(args.layer_counts) != 1 or not args.bundle or not args.onnx:
            parser.error("--stage takes one --layers count, --bundle and --onnx")
        args.layers = args.layer_counts[0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        return run_stage(args)
    return measure_and_write(
        args, name="large", measure=measure, render=render, config_keys=DECODER_SIZES, markers=(LARGE_BEGIN, LARGE_END)
    )


if __name__ == "__main__":
    sys.exit(main())
