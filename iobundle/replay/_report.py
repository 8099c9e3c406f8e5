"""The content of a report (validate, run, diff, export) as plain data; the CLI renders it as Markdown, HTML, JSON or CSV.

A :class:`Report` holds only JSON-able values (strings, numbers, lists, dicts): the environment and
versions, one paragraph about the bundle, the verdict, the per-call rows, the per-output checks,
the worst outputs, the error histogram, the series the charts plot and notes (what an export
traced and patched). Rendering is not done here.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from iobundle._status import row_status, status_class
from iobundle._units import format_size
from iobundle._version import __version__
from iobundle.replay._bundle import Bundle
from iobundle.replay.check import Tolerances, ValidationReport

if TYPE_CHECKING:
    from iobundle.replay.export import ProgramSet

__all__ = ["CALL_COLUMNS", "Report", "build_export_report", "build_report", "environment"]

_CHECK_COLUMNS = ["index", "status", "abs", "rel", "mean_abs", "quantile_abs", "worst_output", "duration_torch"]
"""The columns a validation and a re-run share; each adds the duration of its own run."""

CALL_COLUMNS = {
    "validate": [*_CHECK_COLUMNS, "ort_duration"],
    "run": [*_CHECK_COLUMNS, "duration_rerun"],
    "diff": ["index", "status", "abs", "rel", "inputs_abs", "worst_output", "n_differences", "differences"],
    "export": ["index", "status", "abs", "rel", "reference", "duration_program"],
}
"""The per-call columns a human-readable report shows, per kind (JSON and CSV carry every column)."""

WORST = 10
"""How many outputs the "worst outputs" table lists."""

_PACKAGES = ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "numpy")


def environment() -> dict[str, str]:
    """Versions and machine of this process: python, platform, iobundle and the libraries that matter (installed ones)."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "machine": platform.machine() or "unknown",
        "iobundle": __version__,
    }
    for name in _PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        env["cuda"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return env


def _bundle_facts(bundle: Bundle) -> dict[str, Any]:
    m = bundle.manifest
    statuses = dict(Counter(c.status for c in m.calls))
    p = m.producer
    producer = {"iobundle": p.iobundle, "torch": p.torch, "python": p.python}
    if p.transformers:
        producer["transformers"] = p.transformers
    return {
        "path": str(bundle.path),
        "format": f"{m.format} v{m.format_version}",
        "method": m.signature.qualname or m.signature.method,
        "calls": len(m.calls),
        "statuses": statuses,
        "tensors": len(m.tensors),
        "files": len(m.files),
        "bytes": sum(f.size for f in m.files.values()),
        "producer": producer,
        "devices": list(p.devices),
        "model": m.model.class_name if m.model is not None else None,
    }


def _paragraph(facts: dict[str, Any]) -> list[list[str]]:
    """The paragraph about one bundle, as pieces ``[kind, text]``: ``"code"`` (a path, a name) or ``"text"``.

    The pieces hold the bundle's strings as they are: each renderer escapes them for its format.
    """
    status = ", ".join(f"{n} {s}" for s, n in facts["statuses"].items()) or "none"
    producer = ", ".join(f"{k} {v}" for k, v in facts["producer"].items())
    text = (
        f" ({status}): {facts['tensors']} tensors in {facts['files']} files, {format_size(facts['bytes'])}. "
        f"Recorded with {producer}"
    )
    text += f" on {', '.join(facts['devices'])}." if facts["devices"] else "."
    if facts["model"]:
        text += f" It carries its model ({facts['model']} config and weights)."
    return [
        ["code", facts["path"]],
        ["text", f" ({facts['format']}) holds {facts['calls']} recorded calls of "],
        ["code", facts["method"]],
        ["text", text],
    ]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass
class Report:
    """Everything a report shows, as JSON-able data (see :func:`build_report`).

    Strings from the bundles (names, paths, producer versions, error messages) are kept as they
    are; the renderers escape them. ``paragraphs`` holds one paragraph per bundle as pieces
    ``[kind, text]``, ``kind`` ``"code"`` (a path or a name, shown as code) or ``"text"``.
    """

    kind: str
    title: str
    ok: bool
    verdict: str
    criterion: str
    check_error_stat: str
    error_quantile: float
    seconds: float
    subject: str
    command: str
    environment: dict[str, str]
    bundles: list[dict[str, Any]]
    paragraphs: list[list[list[str]]]
    columns: list[str]
    rows: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    worst: list[dict[str, Any]]
    histogram: list[tuple[str, int]]
    per_call: list[dict[str, Any]]
    per_output: list[dict[str, Any]]
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Facts beside the rows, one sentence each (an export: the programs, traced calls, patches, the batch check)."""

    def as_dict(self) -> dict[str, Any]:
        """The whole report as one JSON-able dict."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def build_report(
    result: ValidationReport,
    bundles: Sequence[Bundle],
    *,
    command: str = "",
    worst: int = WORST,
) -> Report:
    """Gather what a report shows about ``result`` (from ``validate_onnx``, ``rerun_model`` or ``diff_bundles``).

    Args:
        result: The per-call rows and per-output checks.
        bundles: The bundle the result is about (two for a diff: the reference first).
        command: The command line that produced it, shown as is.
        worst: How many outputs the table of the worst outputs lists.
    """
    kind = result.kind
    rows = [dict(r, status=row_status(r)) for r in result.rows]  # one status, drawn as is by every renderer
    outputs = [c.as_row() for c in result.outputs]

    def badness(o: dict[str, Any]) -> tuple[int, float]:
        return (1 if o["SUCCESS"] is False else 0, o["max_abs"] if math.isfinite(o["max_abs"]) else math.inf)

    compared = [o for o in outputs if o["n"] or o["error"]]
    worst_rows = sorted(compared, key=badness, reverse=True)[:worst]
    per_output: dict[str, dict[str, Any]] = {}
    for o in outputs:
        entry = per_output.setdefault(
            o["output"], {"output": o["output"], "max_abs": 0.0, "atol": o["atol"], "failed": 0, "calls": 0}
        )
        entry["max_abs"] = max(entry["max_abs"], o["max_abs"])
        entry["calls"] += 1
        entry["failed"] += 1 if o["SUCCESS"] is False else 0
    per_call = [
        {
            "index": r["index"],
            "abs": _finite(r.get("abs")),
            "status": status_class(r["status"]),
            "error": r.get("error") or "",
        }
        for r in rows
    ]
    subject = result.subject
    facts = [_bundle_facts(b) for b in bundles]
    paragraphs = [_paragraph(f) for f in facts]
    what = {"validate": "validate", "run": "run (eager re-run)", "diff": "diff"}.get(kind, kind)
    title = f"iobundle {what}: {subject}" if kind != "diff" else f"iobundle diff: {facts[0]['path']} vs {subject}"
    return Report(
        kind=kind,
        title=title,
        ok=result.ok,
        verdict=result.verdict(),
        criterion=result.criterion(),
        check_error_stat=result.check_error_stat,
        error_quantile=result.error_quantile,
        seconds=result.seconds,
        subject=subject,
        command=command,
        environment=environment(),
        bundles=facts,
        paragraphs=paragraphs,
        columns=CALL_COLUMNS.get(kind, CALL_COLUMNS["validate"]),
        rows=rows,
        outputs=outputs,
        worst=worst_rows,
        histogram=result.histogram(),
        per_call=per_call,
        per_output=list(per_output.values()),
        differences=list(getattr(result, "differences", [])),
    )


def _export_notes(result: ProgramSet) -> list[str]:
    notes = []
    for program in result.programs:
        report = program.report
        phase = program.phase
        prefix = f"program {phase.name} (calls {', '.join(map(str, phase.calls))}, {phase.describe()}): "
        prefix = prefix if len(result.programs) > 1 else ""
        onnx = f", ONNX {report.onnx_seconds:.2f}s" if report.onnx_seconds is not None else ""
        patches = f"; patches: {', '.join(report.patches)}" if report.patches else ""
        options = f"; options: {', '.join(report.options)}" if report.options else ""
        notes.append(
            f"{prefix}traced call {report.traced_call}; torch.export {report.export_seconds:.2f}s, "
            f"checks {report.check_seconds:.2f}s{onnx}{patches}{options}."
        )
        if report.batch_check is not None:
            notes.append(f"{prefix}beyond the recorded calls: {report.batch_check.summary()}.")
    if result.reason:
        notes.append(f"{len(result.programs)} programs, one per phase of the calls: {result.reason}.")
    return notes


def build_export_report(
    result: ProgramSet,
    bundle: Bundle,
    *,
    subject: str,
    ok: bool,
    verdict: str,
    tolerances: Tolerances | None = None,
    command: str = "",
) -> Report:
    """Gather what a report shows about an export (``Bundle.export_programs``): one row per recorded call.

    Each row is the exported program's check on that call (max abs and rel error, what it was
    compared with, the program's run time); the notes say, per program, the traced call, the
    timings, the patches and the check beyond the recorded calls.

    Args:
        result: The exported programs.
        bundle: The bundle they were exported from.
        subject: What was written (the ONNX file or the program index).
        ok: The export's verdict (its checks and the batch check).
        verdict: That verdict in words, as the command printed it.
        tolerances: The tolerances the checks used.
        command: The command line that produced it, shown as is.
    """
    several = len(result.programs) > 1
    rows = []
    for program in result.programs:
        for c in program.report.calls:
            row: dict[str, Any] = {"program": program.phase.name} if several else {}
            row.update(
                index=c.index,
                SUCCESS=c.success,
                abs=c.abs,
                rel=c.rel,
                error=c.error or "",
                absent_inputs=", ".join(map(str, c.absent_inputs)),
                reference=c.reference,
                duration_program=c.seconds,
            )
            rows.append(row)
    rows.sort(key=lambda r: r["index"])
    seconds = sum(
        p.report.export_seconds + p.report.check_seconds + (p.report.onnx_seconds or 0.0) for p in result.programs
    )
    checked = ValidationReport(
        rows=rows, seconds=seconds, tolerances=tolerances or Tolerances(), subject=subject, kind="export"
    )
    report = build_report(checked, [bundle], command=command)
    columns = ["program", *report.columns] if several else report.columns
    return replace(report, ok=ok, verdict=verdict, columns=columns, notes=_export_notes(result))
