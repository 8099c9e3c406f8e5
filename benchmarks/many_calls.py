"""Figures 7 and 8: the bytes of a streamed generate() (delta storage), opening a bundle of many calls."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.capture_cost import tiny_llama
from benchmarks.common import Config, Figure, Row, Target, at_most, below, fill_ratios, remove, run_interleaved

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
        tensor_files = [p for p in files if p.suffix in (".safetensors", ".bin")]  # .bin: segments (format 4)
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
        remove(path)
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
    fig.targets.append(Target(f"size({2 * n}) / size({n})", growth, "≤ 2.10", at_most(growth, 2.1), f"n{2 * n}"))
    for tokens in (n, 2 * n):
        m = measured[tokens]
        r = m["total"] / m["distinct"]
        fig.targets.append(
            Target(f"bundle / distinct data, {tokens} tokens", r, "≤ 1.20", at_most(r, 1.2), f"n{tokens}")
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
    # the same calls as format version 2 wrote them (whole trees, indented; no segments: each call's file)
    _without_segments(saved, v2)

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
        samples = run_interleaved(
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
        remove(saved)
        remove(journal)
        remove(v2)
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
    fill_ratios(fig, "saved")
    # issue 26: open + infer under 50 ms, `iobundle inspect` (which renders the table too) under 100 ms
    for variant, limit in (("saved", 50.0), ("saved_cli", 100.0), ("journal", 50.0), ("journal_cli", 100.0)):
        med = statistics.median(fig.row(variant).samples or [float("nan")])
        what = "inspect" if variant.endswith("_cli") else "open+infer"
        fig.targets.append(
            Target(f"{what} {calls} calls, {variant} (ms)", med, f"< {limit:.0f} ms", below(med, limit), variant)
        )
    return fig


def _without_segments(bundle: Path, target: Path) -> None:
    """Copy ``bundle`` to ``target`` as format version 2 wrote it: each segment's ranges as their calls' own files."""
    import bisect
    import math

    import torch

    from iobundle.calls import NAME_TO_DTYPE, write_tensor_file
    from iobundle.schema import DTYPE_ITEMSIZES, load_manifest

    shutil.copytree(bundle, target)
    manifest = load_manifest(bundle)
    files = {n: e for n, e in manifest.files.items() if e.ranges is None}
    tensors, by_file = {}, {}
    for key, entry in manifest.tensors.items():
        if entry.offset is None:
            tensors[key] = entry
            continue
        ranges = manifest.files[entry.file].ranges
        call = ranges[max(0, bisect.bisect_right([r[1] for r in ranges], entry.offset) - 1)][0]
        shape = list(entry.shape)
        if entry.extends is not None:  # stored: the part past its base
            shape[entry.extends.dim] -= manifest.tensors[entry.extends.key].shape[entry.extends.dim]
        nbytes = math.prod(shape) * DTYPE_ITEMSIZES[entry.dtype]
        raw = bytearray((bundle / entry.file).read_bytes()[entry.offset : entry.offset + nbytes])
        stored = torch.frombuffer(raw, dtype=NAME_TO_DTYPE[entry.dtype]) if nbytes else torch.empty(0)
        file = f"calls/{call:06d}.safetensors"
        by_file.setdefault(file, {})[key] = stored.to(NAME_TO_DTYPE[entry.dtype]).reshape(shape)
        tensors[key] = entry.model_copy(update={"file": file, "offset": None})
    for file, stored in by_file.items():
        files[file] = write_tensor_file(target / file, stored)
    for name in set(manifest.files) - set(files):
        (target / name).unlink()
    update = {"format_version": 2, "files": files, "tensors": tensors}
    (target / "manifest.json").write_text(manifest.model_copy(update=update).model_dump_json(indent=1))


def _as_journal(bundle: Path) -> bytes:
    """The journal a stream of ``bundle``'s calls would have written (head, then one line per call)."""
    from iobundle.schema import journal_call_line, journal_head_line, load_manifest

    manifest = load_manifest(bundle)
    lines = [journal_head_line(manifest.model_copy(update={"calls": [], "tensors": {}, "files": {}}))]
    seen: set[str] = set()
    for call in manifest.calls:
        keys = {k for k in _call_tensor_keys(call) if k not in seen}  # the tensors this call wrote
        seen |= keys
        tensors = {k: e for k, e in manifest.tensors.items() if k in keys}
        files = {}
        for name in {e.file for e in tensors.values()}:
            entry = manifest.files[name]
            if entry.ranges is not None:  # a segment: the line names the range this call appended
                (mine,) = [r for r in entry.ranges if r[0] == call.index]
                entry = entry.model_copy(update={"size": mine[1] + mine[2], "ranges": [mine]})
            files[name] = entry
        lines.append(journal_call_line(call, tensors, files))
    return b"".join(lines)
