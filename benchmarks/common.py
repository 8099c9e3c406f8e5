"""What every figure shares: sizes per run, result records, the machine and versions, helpers."""

from __future__ import annotations

import gc
import inspect
import os
import platform
import shutil
import statistics
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2
MB = 1000**2


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
    decode_steps: int = 48  # figure 1e
    depth_layers: tuple[int, ...] = (2, 8, 32, 64, 80)  # figure 1f
    depth_tokens: int = 24
    depth_reps: int = 11  # the added time is a difference of two noisy times: more rounds, paired
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
    decode_steps=4,
    depth_layers=(2, 4),
    depth_tokens=3,
    depth_reps=1,
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

FIGURES = ("1a", "1b", "1c", "1d", "1e", "1f", "2", "3", "3r", "4", "5", "6", "7", "8")


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


def at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def at_least(value: float | None, limit: float) -> bool | None:
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


def loadavg() -> list[float] | None:
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


def quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("torch._export").setLevel(logging.ERROR)


def collect() -> None:
    gc.collect()


def rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def observer_call(observer: Any, model: Any, store_n_calls: int, stream_to: Path | None) -> Any:
    if stream_to is None:
        return observer(model, store_n_calls=store_n_calls)
    return observer(model, store_n_calls=store_n_calls, stream_to=str(stream_to))


_TRASH: list[Path] = []


def defer_remove(path: Path) -> None:
    """Delete ``path`` at the end of the figure: deleting GBs between repetitions makes the file
    system discard blocks in the background while the next variant is timed."""
    _TRASH.append(path)


def empty_trash() -> None:
    while _TRASH:
        remove(_TRASH.pop())


def remove(path: Path) -> None:
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


def run_interleaved(
    reps: int, variants: dict[str, Callable[[int], dict[str, float]]], warmup: bool = True
) -> dict[str, dict[str, list[float]]]:
    """Run every variant once per repetition, in an order rotated by repetition; one warm-up round first."""
    names = list(variants)
    if warmup:
        for name in names:
            collect()
            variants[name](-1)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for rep in range(reps):
        for name in rotate(names, rep):
            collect()
            for key, value in variants[name](rep).items():
                samples[name].setdefault(key, []).append(value)
    return samples


def fill_ratios(fig: Figure, baseline: str) -> None:
    base = fig.row(baseline).samples
    for row in fig.rows:
        if row.samples is not None and base is not None:
            row.ratio = paired_ratio(row.samples, base)
