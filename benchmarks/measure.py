"""What the real-size and the per-layer benchmarks share: the decoder they record, how they measure it, their results.

``benchmarks/large.py`` (``make bench-large``) and ``benchmarks/layers.py`` (``make bench-layers``)
both build a Llama-shaped decoder with random weights from a config (:func:`llama_config`) at
several layer counts of one width, record its greedy ``generate()`` in a fresh process
(:func:`capture_decoder`), then time the steps that follow in fresh processes (:func:`child_argv`),
each phase marked by a :class:`PhaseSampler`. Between layer counts a figure's growth is the
exponent :func:`growth` (1 is linear, target :data:`GROWTH_TARGET`); :func:`measure_and_write`
runs a benchmark's measurement and writes its JSON and its block of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, loadavg, machine_info
from benchmarks.report import write_block

GB = 1000**3
GROWTH_TARGET = 1.1
"""The most a figure may grow with the number of layers: exponent 1 is linear, 0.1 of timing noise."""

DECODER_SIZES = ("hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "prompt", "new_tokens", "threads")
"""The options that size the decoder and its recorded ``generate()``, which every child process gets."""


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


def llama_config(args: argparse.Namespace, layers: int) -> Any:
    """The ``LlamaConfig`` of the options of :data:`DECODER_SIZES` at ``layers`` layers (untied embeddings)."""
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


def capture_decoder(args: argparse.Namespace, mark: Callable[[str], None] = lambda phase: None) -> dict[str, Any]:
    """Build the decoder (seeded random weights), record its greedy batch ``generate()``, save it to ``args.bundle``.

    The bundle is self-contained (``save(include_model=True)``). ``mark`` is called as each phase starts.
    Returns the parameter count, the weight bytes and the number of recorded calls.
    """
    import torch
    from transformers import LlamaForCausalLM

    from iobundle import InputObserver

    mark("build model (random weights)")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args, args.layers)).eval()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    observer = InputObserver()
    mark("generate(), recorded")
    with torch.no_grad(), observer(model, store_n_calls=args.new_tokens + 4):
        model.generate(
            prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
        )
    calls = observer.num_obs()
    mark("save(include_model=True)")
    observer.save(args.bundle, include_model=True)
    return {"params": params, "weight_bytes": weight_bytes, "calls": calls}


def child_argv(args: argparse.Namespace, script: str, role: tuple[str, str], layers: int, work: Path) -> list[str]:
    """The command line that runs ``script`` as the child ``role`` (its flag and value) at ``layers`` layers in ``work``."""
    argv = [sys.executable, str(Path(script).resolve()), *role, "--layers", str(layers)]
    for name in DECODER_SIZES:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return [*argv, "--bundle", str(work / "run.iobundle"), "--onnx", str(work / "onnx" / "model.onnx")]


def growth(a: float, b: float, layers_a: int, layers_b: int) -> float:
    """The exponent of a figure's growth from ``a`` at ``layers_a`` to ``b`` at ``layers_b`` (1 is linear)."""
    return math.log(b / a) / math.log(layers_b / layers_a) if a > 0 and b > 0 else float("nan")


def layer_counts(text: str) -> list[int]:
    """``--layers``: distinct positive layer counts, comma-separated, in increasing order."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer counts as integers, e.g. 12,24,48") from None
    if not counts or any(c < 1 for c in counts) or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct positive layer counts in increasing order")
    return counts


def check_decoder_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, *more: str) -> None:
    """Refuse (``parser.error``) a size of :data:`DECODER_SIZES` or of ``more`` under 1, or heads that do not divide."""
    for name in (*more, *DECODER_SIZES):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive integer")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(
            f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {args.kv_heads}: the hidden size must be a "
            "multiple of the heads, and the heads a multiple of the key/value heads"
        )


def met(ok: bool) -> str:
    """A table cell saying whether a target is met."""
    return "yes" if ok else "**no**"


@contextlib.contextmanager
def _workdir(path: str | None, name: str) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    root = Path(tempfile.mkdtemp(prefix=f"iobundle-bench-{name}-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


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

    With ``--out`` both files go there, else to benchmarks/ and the repository's BENCHMARKS.md.
    The work folder is ``--workdir``, else a fresh one under the temporary directory, removed after.
    """

    def log(message: str) -> None:
        print(f"[bench-{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    started, t0, load_start = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter(), loadavg()
    with _workdir(args.workdir, name) as workdir:
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
