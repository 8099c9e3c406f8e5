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
import contextlib
import itertools
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: sys.path[0] is benchmarks/, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import LARGE_BEGIN, LARGE_END, write_block

ROOT = Path(__file__).resolve().parents[1]
GB = 1000**3
STAGES = ("capture", "export", "validate")
PEAK_TARGET = 3.0  # peak RSS / weight bytes
GROWTH_TARGET = 1.1  # growth exponent with the number of layers (1 = linear; 0.1 of timing noise)

# -- the stages (each in its own process) ---------------------------------------------------------


class PhaseSampler:
    """Each phase's peak RSS, exact: the kernel's high-water mark (``VmHWM``), reset when a phase starts.

    ``mark(name)`` ends the current phase (its peak is the ``VmHWM`` reached since it began) and resets
    the mark to the current RSS (``/proc/self/clear_refs``), so that a peak reached inside C code that
    holds the interpreter lock (a protobuf serialisation) is counted too. Where the reset is refused,
    each phase's peak is the process's peak so far (``reset`` is False).
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._t0 = time.perf_counter()
        self.phases: list[dict[str, Any]] = []
        self.reset = True
        self.mark("start")

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def mark(self, name: str) -> None:
        if self.phases and self.phases[-1]["phase"] == name:
            return
        now = time.perf_counter() - self._t0
        if self.phases:
            last = self.phases[-1]
            last["seconds"] = now - last["begin"]
            last["rss_peak"] = max(self._hwm(), last["rss_begin"])
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.reset = False
        self.phases.append({"phase": name, "begin": now, "rss_begin": self.rss()})

    def stop(self) -> list[dict[str, Any]]:
        self.mark("end")
        return self.phases[:-1]


def _llama_config(args: argparse.Namespace, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(256, args.prompt + args.new_tokens),
        tie_word_embeddings=False,
    )


def _stage_capture(args: argparse.Namespace, sampler: PhaseSampler) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from iobundle import InputObserver

    sampler.mark("build model (random weights)")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args, args.layers)).eval()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    observer = InputObserver()
    sampler.mark("generate(), recorded")
    with torch.no_grad(), observer(model, store_n_calls=args.new_tokens + 4):
        model.generate(
            prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
        )
    calls = observer.num_obs()
    sampler.mark("save(include_model=True)")
    observer.save(args.bundle, include_model=True)
    return {"params": params, "weight_bytes": weight_bytes, "calls": calls}


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


def _stage_argv(args: argparse.Namespace, stage: str, layers: int, work: Path) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--layers", str(layers),
        "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--heads", str(args.heads),
        "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab), "--batch", str(args.batch),
        "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
        "--bundle", str(work / "run.iobundle"), "--onnx", str(work / "onnx" / "model.onnx"),
    ]  # fmt: skip


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


def _growth(a: float, b: float, layers_a: int, layers_b: int) -> float:
    return math.log(b / a) / math.log(layers_b / layers_a) if a > 0 and b > 0 else float("nan")


def measure(args: argparse.Namespace, workdir: Path, log: Any) -> dict[str, Any]:
    sizes = []
    for layers in args.layer_counts:
        work = workdir / f"layers-{layers}"
        shutil.rmtree(work, ignore_errors=True)
        (work / "onnx").mkdir(parents=True)
        log(f"{layers} layers ...")
        stages = {stage: _run_child(_stage_argv(args, stage, layers, work), log) for stage in STAGES}
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
    growth = []
    for small, large in itertools.pairwise(sizes):
        for stage in STAGES:
            a, b = small["stages"][stage], large["stages"][stage]
            growth.append({
                "stage": stage, "layers": [small["layers"], large["layers"]],
                "time_ratio": b["seconds"] / a["seconds"], "peak_ratio": b["rss_peak"] / a["rss_peak"],
                "time_exponent": _growth(a["seconds"], b["seconds"], small["layers"], large["layers"]),
                "peak_exponent": _growth(a["rss_peak"], b["rss_peak"], small["layers"], large["layers"]),
            })  # fmt: skip
    return {"sizes": sizes, "growth": growth}


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


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
                f"{_met(out['peak_over_weights'] <= PEAK_TARGET)} |"
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
                f"{g['time_exponent']:.2f} | {g['peak_ratio']:.2f} | {g['peak_exponent']:.2f} | {_met(ok)} |"
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


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    root = Path(tempfile.mkdtemp(prefix="iobundle-bench-large-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _layer_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer counts as integers, e.g. 12,24,48") from None
    if not counts or any(c < 1 for c in counts) or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct positive layer counts in increasing order")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24,48", type=_layer_counts,
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
    for name in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "prompt", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive integer")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(
            f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: the hidden size must be a "
            "multiple of the heads, and the heads a multiple of the key/value heads"
        )
    args.layer_counts = args.layers
    if args.stage:
        if len(args.layer_counts) != 1 or not args.bundle or not args.onnx:
            parser.error("--stage takes one --layers count, --bundle and --onnx")
        args.layers = args.layer_counts[0]
    return args


def measure_and_write(
    args: argparse.Namespace,
    *,
    name: str,
    measure: Callable[[argparse.Namespace, Path, Any], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    config_keys: tuple[str, ...],
    markers: tuple[str, str],
) -> int:
    """Run ``measure`` in the work folder, write ``results_<name>.json`` and the ``markers`` block of BENCHMARKS.md.

    Shared by ``make bench-large`` and ``make bench-layers``: with ``--out`` both files go there,
    else to benchmarks/ and the repository's BENCHMARKS.md.
    """
    from benchmarks.common import loadavg, machine_info

    def log(message: str) -> None:
        print(f"[bench-{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    started, t0, load_start = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter(), loadavg()
    with _workdir(args.workdir) as workdir:
        m = machine_info(workdir)
        measured = measure(args, workdir, log)
    config = {k: getattr(args, k) for k in config_keys}
    config["layers"] = args.layer_counts
    results = {
        "started": started, "config": config, "loadavg_start": load_start, "loadavg_end": loadavg(),
        "machine": f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM", **measured,
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    json_path = (out or ROOT / "benchmarks") / f"results_{name}.json"
    md_path = (out or ROOT) / "BENCHMARKS.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n", "utf-8")
    table = render(results)
    write_block(md_path, table, *markers)
    print(table)
    log(f"wrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        return run_stage(args)
    keys = ("hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "prompt", "new_tokens", "threads")
    return measure_and_write(
        args, name="large", measure=measure, render=render, config_keys=keys, markers=(LARGE_BEGIN, LARGE_END)
    )


if __name__ == "__main__":
    sys.exit(main())
