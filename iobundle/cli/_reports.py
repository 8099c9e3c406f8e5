"""Write a :class:`~iobundle.replay.Report` as Markdown, HTML, JSON or CSV (chosen by the file's extension).

The reports of validate, run, diff and export (whose JSON is its own: :func:`iobundle.cli._programs.export_report_json`):
``.md`` to paste into a GitHub issue (verdict, command, bundle, environment, one row per call, the
worst outputs, the error histogram); ``.html`` the same in one self-contained file with inline SVG
charts (no script, nothing fetched); ``.json`` / ``.csv`` the per-call rows, every column
(non-finite numbers become null / empty).

Strings from the bundles go through :mod:`iobundle._escape` in every format (Markdown escaped and
code spans no backtick can close; HTML escaped; CSV cells a spreadsheet would take for a formula
prefixed with ``'``; JSON holds them as data). Nothing here imports torch: the report is plain data.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from iobundle._escape import csv_cell, html_text, markdown_code, markdown_code_block, markdown_text
from iobundle._status import call_status, status_class
from iobundle._units import format_latency
from iobundle.errors import CLIError

if TYPE_CHECKING:
    from iobundle.replay import Report

__all__ = ["REPORT_FORMATS", "render_report", "report_format", "write_report", "write_report_text"]

REPORT_FORMATS = {
    ".json": "json",
    ".csv": "csv",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
}

_HEADERS = {
    "index": "call",
    "status": "status",
    "abs": "max abs",
    "rel": "max rel",
    "mean_abs": "mean abs",
    "quantile_abs": "q abs",
    "worst_output": "worst output",
    "duration_torch": "torch (recorded)",
    "ort_duration": "onnxruntime",
    "duration_rerun": "re-run",
    "inputs_abs": "inputs max abs",
    "n_differences": "differences",
    "differences": "what differs",
    "reference": "compared with",
    "duration_program": "exported program",
}


def report_format(path: str) -> str:
    """The format of a report file from its extension.

    Raises:
        CLIError: The extension is not one of :data:`REPORT_FORMATS`.
    """
    fmt = REPORT_FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise CLIError(f"--report {path}: use a .md, .html, .json or .csv file name (the extension picks the format).")
    return fmt


def write_report(report: Report, path: str) -> str:
    """Write ``report`` to ``path`` in the format its extension names; return the format.

    Raises:
        CLIError: Unknown extension, or the file cannot be written.
    """
    fmt = report_format(path)
    write_report_text(render_report(report, fmt), path)
    return fmt


def write_report_text(text: str, path: str) -> None:
    """Write a rendered report to ``path``.

    Raises:
        CLIError: The file cannot be written.
    """
    try:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as exc:
        raise CLIError(f"--report {path}: cannot write it ({exc.strerror or exc}).") from exc


def render_report(report: Report, fmt: str) -> str:
    """The text of ``report`` as ``markdown``, ``html``, ``json`` or ``csv``."""
    if fmt == "json":
        return json.dumps([_clean_row(r) for r in report.rows], indent=1, allow_nan=False) + "\n"
    if fmt == "csv":
        return _csv(report.rows)
    if fmt == "html":
        return _html(report)
    return _markdown(report)


# --------------------------------------------------------------------------- cells


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _clean(v) for k, v in row.items()}


def _csv(rows: Sequence[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([csv_cell(c) for c in columns])
    for r in rows:
        clean = _clean_row(r)
        writer.writerow([csv_cell("" if clean.get(c) is None else clean[c]) for c in columns])
    return buffer.getvalue()


def _number(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if math.isinf(value):
            return "inf"
        return "0" if value == 0 else f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def _cell(column: str, row: dict[str, Any]) -> str:
    value = row.get(column)
    if column.startswith("duration") or column == "ort_duration":
        return format_latency(value, missing="")
    return _number(value) if not isinstance(value, str) else value


def _header(report: Report, column: str) -> str:
    if column == "quantile_abs":
        return f"q{report.error_quantile:g} abs"
    return _HEADERS.get(column, column)


# --------------------------------------------------------------------------- markdown


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """A GitHub table; ``headers`` are plain text, ``rows`` hold Markdown cells (escaped by the caller)."""
    lines = ["| " + " | ".join(markdown_text(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


_WORST_KINDS = ("number", "code", "text", "text", *["number"] * 5, "text")


def _worst_cells(report: Report) -> list[list[tuple[str, str]]]:
    """The worst-output rows as ``(kind, text)`` cells: ``"code"`` (the name), ``"text"`` or ``"number"`` (formatted here)."""
    rows = []
    for o in report.worst:
        name = f"{o['output']} ({o['onnx_name']})" if o["onnx_name"] else o["output"]
        status = call_status(o["SUCCESS"], o["error"] or None, None)
        cells = [str(o["call"]), name, o["shape"], o["dtype"], _number(o["max_abs"]), _number(o["mean_abs"])]
        cells += [_number(o["quantile_abs"]), _number(o["max_rel"]), f"{o['atol']:g} / {o['rtol']:g}", status]
        rows.append([(_WORST_KINDS[j], c) for j, c in enumerate(cells)])
    return rows


_TEXT_COLUMNS = ("status", "worst_output", "differences", "reference", "program")
"""The columns of text (left-aligned); the others hold numbers."""


def _md_cell(column: str, row: dict[str, Any]) -> str:
    """A cell of the calls table: text escaped, numbers (formatted here) as they are."""
    text = _cell(column, row)
    return markdown_text(text) if column in _TEXT_COLUMNS or isinstance(row.get(column), str) else text


def _md_piece(kind: str, text: str, *, table: bool = False) -> str:
    if kind == "number":
        return text
    return markdown_code(text, table=table) if kind == "code" else markdown_text(text)


_WORST_HEADERS = [
    "call",
    "output",
    "shape",
    "dtype",
    "max abs",
    "mean abs",
    "q abs",
    "max rel",
    "atol / rtol",
    "status",
]


def _markdown(report: Report) -> str:
    mark = "✅" if report.ok else "❌"
    lines = [
        f"## {markdown_text(report.title)}",
        "",
        f"{mark} **{markdown_text(report.verdict)}** ({report.seconds:.2f}s)",
        "",
    ]
    if report.command:
        lines += [markdown_code_block(report.command), ""]
    lines += ["**Bundle.** " + "".join(_md_piece(kind, text) for kind, text in p) for p in report.paragraphs]
    environment = ", ".join(f"{k} {v}" for k, v in report.environment.items())  # this process's: no bundle text
    lines += ["", f"**Environment.** {environment}.", ""]
    if report.differences:
        lines += ["### Differences between the bundles", ""]
        lines += [f"- {markdown_text(d)}" for d in report.differences] + [""]
    if report.notes:
        lines += ["### Notes", ""]
        lines += [f"- {markdown_text(n)}" for n in report.notes] + [""]
    lines += ["### Calls", ""]
    headers = [_header(report, c) for c in report.columns]
    rows = [[_md_cell(c, r) for c in report.columns] for r in report.rows]
    right = [i for i, c in enumerate(report.columns) if c not in _TEXT_COLUMNS]
    lines += _md_table(headers, rows, right)
    if report.worst:
        q = f"q = the {report.error_quantile:g} quantile"
        lines += ["", f"### Worst outputs (by max abs error; {markdown_text(q)})", ""]
        worst = [[_md_piece(kind, text, table=True) for kind, text in r] for r in _worst_cells(report)]
        lines += _md_table(_WORST_HEADERS, worst, right=(0, 4, 5, 6, 7))
    if any(count for _, count in report.histogram):
        total = sum(c for _, c in report.histogram)
        top = max(c for _, c in report.histogram)
        lines += ["", "### Absolute error histogram (every element of every output)", ""]
        hist_rows = [
            [
                label,
                str(count),
                f"{100.0 * count / total:.1f}%",
                "█" * (round(20 * count / top) if count else 0),
            ]
            for label, count in report.histogram
        ]
        lines += _md_table(["abs error", "elements", "share", ""], hist_rows, right=(1, 2))
    written = f"Criterion: {report.criterion}. Written by iobundle {report.environment.get('iobundle', '')}."
    lines += ["", f"<sub>{markdown_text(written)}</sub>"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- html


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#1f2328;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left}
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.verdict{font-size:1.2em;font-weight:bold;padding:.4em .8em;border-radius:6px;display:inline-block}
.pass{background:#dafbe1;color:#116329}.fail{background:#ffebe9;color:#a40e26}
tr.FAIL td{background:#fff5f5}code,pre{background:#f6f8fa;border-radius:4px;padding:2px 4px;font-size:.9em}
pre{padding:.6em;overflow-x:auto}svg{display:block;margin:.5em 0;max-width:100%;height:auto}
svg text{font:11px system-ui,sans-serif;fill:#1f2328}.muted{color:#57606a;font-size:.85em}
"""

_COLORS = {"ok": "#2da44e", "FAIL": "#cf222e", "not checked": "#bf8700"}


_esc = html_text


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (), row_classes: Sequence[str] | None = None) -> str:  # fmt: skip
    parts = ["<table><thead><tr>", *(f"<th>{_esc(h)}</th>" for h in headers), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = f' class="{_esc(row_classes[i])}"' if row_classes else ""
        cells = "".join(
            f'<td class="n">{_esc(c)}</td>' if j in numeric else f"<td>{_esc(c)}</td>" for j, c in enumerate(row)
        )
        parts.append(f"<tr{cls}>{cells}</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def _log_scale(values: Sequence[float | None], extra: Sequence[float]) -> tuple[float, float]:
    """Decades ``(lo, hi)`` covering the positive values and the tolerance lines."""
    positive = [v for v in [*values, *extra] if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return -8.0, 0.0
    lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return float(lo - 1), float(max(hi, lo) + (1 if hi == lo else 0))


def _log_axis(lo: float, hi: float, start: float, length: float) -> Callable[[float | None], float]:
    """A log axis from 10**lo at ``start`` to 10**hi at ``start + length`` (clamped); 0 and None at its start, inf at its end."""

    def at(value: float | None) -> float:
        if value is None or value <= 0:
            return float(start)
        if not math.isfinite(value):
            return float(start + length)
        return start + length * min(max((math.log10(value) - lo) / (hi - lo), 0.0), 1.0)

    return at


def _decades(lo: float, hi: float, axis: Callable[[float | None], float]) -> list[tuple[int, float]]:
    """Each power of ten of a log axis, with where it stands: its gridline and label."""
    return [(d, axis(10.0**d)) for d in range(int(lo), int(hi) + 1)]


def _svg_open(width: int, height: int, title: str) -> list[str]:
    return [
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f"<title>{_esc(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]


def _svg_close(parts: list[str], x: float, y: int, caption: str) -> str:
    """The chart's text: ``parts``, then ``caption`` centred on ``x`` at ``y``, then the end of the svg."""
    parts.append(f'<text x="{x:.0f}" y="{y}" text-anchor="middle">{caption}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_per_call(report: Report) -> str:
    """Vertical bars, log scale: the largest absolute error of each call, coloured by status; atol dashed."""
    points = report.per_call
    atol = _default_atol(report)
    lo, hi = _log_scale([p["abs"] for p in points], [atol] if atol else [])
    width, height, left, bottom, top = max(360, 60 + 22 * len(points)), 260, 56, 40, 16
    plot_w, plot_h = width - left - 12, height - bottom - top
    bar = max(3.0, min(18.0, plot_w / max(len(points), 1) - 4))

    y = _log_axis(lo, hi, top + plot_h, -plot_h)  # upwards
    parts = _svg_open(width, height, "largest absolute error per call")
    for d, yy in _decades(lo, hi, y):
        parts.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{width - 12}" y2="{yy:.1f}" stroke="#eaeef2"/>')
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{d}</text>')
    for i, p in enumerate(points):
        x = left + (i + 0.5) * plot_w / max(len(points), 1) - bar / 2
        value = p["abs"]
        yy = y(value) if value is not None else float(top)
        color = _COLORS.get(p["status"], "#8c959f")
        label = "exact" if value == 0 else "failed to run" if value is None else f"{value:.3g}"
        if value == 0:
            parts.append(f'<circle cx="{x + bar / 2:.1f}" cy="{top + plot_h - 4:.1f}" r="3" fill="{color}"><title>call {p["index"]}: exact match</title></circle>')  # fmt: skip
        else:
            h = top + plot_h - yy
            parts.append(
                f'<rect class="bar" x="{x:.1f}" y="{yy:.1f}" width="{bar:.1f}" height="{max(h, 1.0):.1f}" fill="{color}">'
                f"<title>call {_esc(p['index'])}: {_esc(label)} ({_esc(p['status'])})</title></rect>"
            )
        if len(points) <= 40 or i % max(1, len(points) // 20) == 0:
            parts.append(
                f'<text x="{x + bar / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{_esc(p["index"])}</text>'
            )
    if atol:
        yy = y(atol)
        parts.append(
            f'<line x1="{left}" y1="{yy:.1f}" x2="{width - 12}" y2="{yy:.1f}" stroke="#cf222e" stroke-dasharray="5,4"/>'
        )
        parts.append(f'<text x="{width - 14}" y="{yy - 4:.1f}" text-anchor="end" fill="#cf222e">atol {atol:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 6}" text-anchor="middle">recorded call</text>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#57606a"/>')
    parts.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 12}" y2="{top + plot_h}" stroke="#57606a"/>')
    parts.append("</svg>")
    return "".join(parts)


def _default_atol(report: Report) -> float | None:
    atols = [o["atol"] for o in report.outputs]
    if atols:
        return max(set(atols), key=atols.count)
    return None


MAX_CHART_OUTPUTS = 40
"""The per-output chart shows at most this many outputs (the worst ones)."""


def _svg_per_output(report: Report) -> str:
    """Horizontal bars, log scale: the largest absolute error of each output over every call; its atol marked."""
    entries = sorted(report.per_output, key=lambda e: e["max_abs"], reverse=True)[:MAX_CHART_OUTPUTS]
    lo, hi = _log_scale([e["max_abs"] for e in entries], [e["atol"] for e in entries])
    label_w = min(260, 20 + 7 * max((len(e["output"]) for e in entries), default=6))
    width, row_h, top = 760, 20, 10
    height = top + row_h * len(entries) + 34
    plot_w = width - label_w - 96

    x = _log_axis(lo, hi, label_w, plot_w)
    parts = _svg_open(width, height, "largest absolute error per output")
    for d, xx in _decades(lo, hi, x):
        parts.append(f'<line x1="{xx:.1f}" y1="{top}" x2="{xx:.1f}" y2="{height - 30}" stroke="#eaeef2"/>')
        parts.append(f'<text x="{xx:.1f}" y="{height - 16}" text-anchor="middle">1e{d}</text>')
    for i, e in enumerate(entries):
        yy = top + i * row_h
        color = _COLORS["FAIL"] if e["failed"] else _COLORS["ok"]
        name = e["output"] if len(e["output"]) <= 36 else e["output"][:35] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{yy + 14}" text-anchor="end">{_esc(name)}</text>')
        end = x(e["max_abs"])
        parts.append(
            f'<rect class="bar" x="{label_w}" y="{yy + 3}" width="{max(end - label_w, 1.0):.1f}" height="{row_h - 6}" fill="{color}">'
            f"<title>{_esc(e['output'])}: max abs {e['max_abs']:.3g} over {e['calls']} calls, {e['failed']} out of tolerance</title></rect>"
        )
        xa = x(e["atol"])
        parts.append(
            f'<line x1="{xa:.1f}" y1="{yy + 1}" x2="{xa:.1f}" y2="{yy + row_h - 1}" stroke="#cf222e" stroke-width="2"/>'
        )
        parts.append(f'<text x="{label_w + plot_w + 14}" y="{yy + 14}">{_esc(_number(e["max_abs"]))}</text>')
    return _svg_close(parts, label_w + plot_w / 2, height - 2, "max abs error (red tick: atol)")


def _svg_histogram(report: Report) -> str:
    """Vertical bars: how many elements fall in each bin of absolute error (height on a log scale of counts)."""
    bins = report.histogram
    top_count = max((c for _, c in bins), default=0)
    width, height, left, bottom, top = 760, 220, 50, 46, 16
    plot_w, plot_h = width - left - 12, height - bottom - top
    slot = plot_w / max(len(bins), 1)
    parts = _svg_open(width, height, "histogram of absolute errors")
    for i, (label, count) in enumerate(bins):
        tick = "≤" + label.split(", ")[1].rstrip("]") if label.startswith("(") else label.replace("<=", "≤")
        h = plot_h * (math.log10(count + 1) / math.log10(top_count + 1)) if top_count else 0.0
        x = left + i * slot + 4
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{slot - 8:.1f}" height="{h:.1f}" fill="#0969da">'
            f"<title>{_esc(label)}: {count} elements</title></rect>"
        )
        parts.append(
            f'<text x="{x + (slot - 8) / 2:.1f}" y="{top + plot_h - h - 4:.1f}" text-anchor="middle">{count}</text>'
        )
        parts.append(
            f'<text x="{x + (slot - 8) / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{_esc(tick)}</text>'
        )
    parts.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 12}" y2="{top + plot_h}" stroke="#57606a"/>')
    return _svg_close(parts, left + plot_w / 2, height - 8, "absolute error (bar height: log of the count)")


def _html(report: Report) -> str:
    verdict_class = "pass" if report.ok else "fail"
    body = [
        f"<h1>{_esc(report.title)}</h1>",
        f'<p class="verdict {verdict_class}" id="verdict">{_esc(report.verdict)}</p>',
    ]
    body.append(f'<p class="muted">{report.seconds:.2f}s. Criterion: {_esc(report.criterion)}.</p>')
    if report.command:
        body.append(f"<pre>{_esc(report.command)}</pre>")
    body.append("<h2>Bundle</h2>")
    body += [
        "<p>" + "".join(f"<code>{_esc(t)}</code>" if k == "code" else _esc(t) for k, t in p) + "</p>"
        for p in report.paragraphs
    ]
    body.append("<h2>Environment</h2>")
    body.append(_html_table(["", "version"], [[k, v] for k, v in report.environment.items()]))
    if report.differences:
        body.append("<h2>Differences between the bundles</h2><ul>")
        body += [f"<li>{_esc(d)}</li>" for d in report.differences]
        body.append("</ul>")
    if report.notes:
        body.append("<h2>Notes</h2><ul>")
        body += [f"<li>{_esc(n)}</li>" for n in report.notes]
        body.append("</ul>")
    body.append("<h2>Error per call</h2>")
    body.append(_svg_per_call(report))
    if report.per_output:
        body.append("<h2>Error per output</h2>")
        body.append(_svg_per_output(report))
    body.append("<h2>Calls</h2>")
    headers = [_header(report, c) for c in report.columns]
    rows = [[_cell(c, r) for c in report.columns] for r in report.rows]
    numeric = [i for i, c in enumerate(report.columns) if c not in _TEXT_COLUMNS]
    body.append(
        _html_table(
            headers, rows, numeric, row_classes=[status_class(str(r["status"])).replace(" ", "-") for r in report.rows]
        )
    )
    if report.worst:
        body.append(
            f'<h2>Worst outputs</h2><p class="muted">By max abs error; q is the {report.error_quantile:g} quantile.</p>'
        )
        worst = [[text for _, text in r] for r in _worst_cells(report)]
        body.append(_html_table(_WORST_HEADERS, worst, numeric=(0, 4, 5, 6, 7)))
    if any(count for _, count in report.histogram):
        body.append("<h2>Absolute error histogram</h2>")
        body.append(_svg_histogram(report))
        body.append(
            _html_table(["abs error", "elements"], [[label, str(c)] for label, c in report.histogram], numeric=(1,))
        )
    body.append(f'<p class="muted">Written by iobundle {_esc(report.environment.get("iobundle", ""))}.</p>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(report.title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
