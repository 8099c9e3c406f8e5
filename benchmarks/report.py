"""The Markdown of a run: the targets table, one section per figure, the block of BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESULTS_BEGIN = "<!-- results:begin (written by benchmarks/run.py; edit outside these markers) -->"
RESULTS_END = "<!-- results:end -->"
LARGE_BEGIN = "<!-- large:begin (written by benchmarks/large.py; edit outside these markers) -->"
LARGE_END = "<!-- large:end -->"
LAYERS_BEGIN = "<!-- layers:begin (written by benchmarks/layers.py; edit outside these markers) -->"
LAYERS_END = "<!-- layers:end -->"
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
`make bench-large` (`benchmarks/large.py`, not in `make bench` nor CI) writes the real-size block at
the end: a Llama-shaped decoder captured, exported and validated from its bundle at 201M–606M parameters.
`make bench-layers` (`benchmarks/layers.py`, neither) writes the per-layer block: each export step's time
at 6 to 48 layers of a narrow decoder and its growth exponent (1 is linear).

"""


def write_markdown(path: Path, table: str) -> None:
    write_block(path, table, RESULTS_BEGIN, RESULTS_END)


def write_block(path: Path, table: str, begin: str, end: str) -> None:
    """Put ``table`` between the markers ``begin`` and ``end`` of ``path``, keeping the text around them.

    A file without these markers gains the block at its end; a missing file is created with the header.
    """
    block = f"{begin}\n{table}{end}\n"
    if path.exists():
        text = path.read_text("utf-8")
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            path.write_text(head + block + tail.lstrip("\n"), "utf-8")
            return
        if begin != RESULTS_BEGIN:
            path.write_text(text.rstrip("\n") + "\n\n" + block, "utf-8")
            return
    path.write_text(BENCHMARKS_HEADER + block, "utf-8")
