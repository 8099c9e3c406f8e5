"""Figures 3, 3r, 4 and 6: bundle write and read throughput, open time vs size, file hashes."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MB,
    MIB,
    Config,
    Figure,
    Row,
    Target,
    at_least,
    at_most,
    below,
    defer_remove,
    fill_ratios,
    remove,
    run_interleaved,
)

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
    # A new file name per repetition; the files are deleted once the figure is done (see defer_remove).
    last: dict[str, Path] = {}

    def target(kind: str, rep: int) -> Path:
        path = workdir / f"write-{rep}.{kind}"
        remove(path)
        defer_remove(path)
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
    samples = run_interleaved(cfg.reps, variants, warmup=False)
    labels = {
        "raw": "raw sequential write of the same bytes + fsync",
        "iobundle": "iobundle observer.save() (safetensors + sha256 + fsync + rename + manifest)",
        "safetensors": "safetensors.torch.save_file + fsync afterwards",
        "torch.save": "torch.save to a file + fsync",
    }
    for name, label in labels.items():
        mbps = [nbytes / MB / s for s in samples[name]["t"]]
        fig.rows.append(Row(name, label, mbps))
    fill_ratios(fig, "raw")
    r = fig.row("iobundle").ratio
    fig.targets.append(Target("iobundle write / raw write", r, "≥ 0.90", at_least(r, 0.9), "iobundle"))
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
    samples = run_interleaved(cfg.reps, variants, warmup=cfg.warmup)
    labels = {
        "raw": "raw sequential read into a reused buffer",
        "iobundle": "load_bundle + every tensor (memory-mapped), sha256 verified on first use",
        "iobundle_noverify": "same, load_bundle(verify=False)",
        "safetensors": "safetensors.torch.load_file",
        "torch.load": "torch.load(weights_only=True)",
    }
    for name, label in labels.items():
        fig.rows.append(Row(name, label, [nbytes / MB / s for s in samples[name]["t"]]))
    fill_ratios(fig, "raw")
    fig.notes.append(
        "Informational (no target). The files were just written, so they are read from the page cache: "
        "this measures copies, hashing and parsing, not the disk. Every variant touches one byte per page of "
        "every tensor it returns, so lazily memory-mapped tensors (iobundle, recent safetensors) are really read."
    )


def read_figure() -> Figure:
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

        samples = run_interleaved(cfg.reps_cheap, {str(mb): opener(mb) for mb in sizes}, warmup=cfg.warmup)
        manifest_sizes = {mb: (paths[mb] / "manifest.json").stat().st_size for mb in sizes}
    finally:
        for path in paths.values():
            remove(path)
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
    fill_ratios(fig, str(sizes[0]))
    for mb in sizes:
        med = statistics.median(fig.row(str(mb)).samples or [float("nan")])
        fig.targets.append(Target(f"open+inspect {mb} MB (ms)", med, "< 50 ms", below(med, 50.0), str(mb)))
    largest = fig.row(str(sizes[-1]))
    fig.targets.append(
        Target(
            f"{sizes[-1]} MB / {sizes[0]} MB (not growing with tensor bytes)",
            largest.ratio,
            "≤ 1.50",
            at_most(largest.ratio, 1.5),
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
        samples = run_interleaved(cfg.reps, variants, warmup=cfg.warmup)
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
    fill_ratios(fig, "write")
    r = fig.row("xxh3").ratio
    fig.targets.append(
        Target("XXH3-128 / write (integrity check vs disk write)", r, "≥ 4.00", at_least(r, 4.0), "xxh3")
    )
    fig.notes.append(
        "Hashing runs in the writer's helper thread while the file is written; below the write speed it "
        "holds the writer back. sha256 and BLAKE3 (one thread) do, XXH3-128 does not: it is the one written."
    )
    return fig
