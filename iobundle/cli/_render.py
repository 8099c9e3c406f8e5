"""Everything the ``iobundle`` command writes to the terminal: tables, trees, shapes, errors.

Formatting functions return strings (the tests read them); :func:`out` and :func:`err` are
the only places that write. Nothing here imports torch: shapes and dtypes come from the
manifest, and ``torch.export.Dim`` objects are recognised by their attributes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iobundle.schema import (
    CallEntry,
    ConstNode,
    DictNode,
    ListNode,
    Manifest,
    Node,
    NoneNode,
    ObjectNode,
    OpaqueNode,
    TensorNode,
    TupleNode,
)

__all__ = [
    "dynamic_shapes_to_json",
    "err",
    "format_dynamic_shapes",
    "format_dynamic_shapes_json",
    "format_inputs",
    "format_inspect",
    "format_latency",
    "format_node",
    "format_table",
    "format_tensor",
    "format_verify",
    "out",
]

MAX_ITEMS = 4
"""A container with more items shows the first ``MAX_ITEMS - 1`` and a count."""
MAX_DEPTH = 4
"""Containers nested deeper are shown as ``[...]``."""
WIDTH = 100
"""Dynamic shapes longer than this are spread over several lines."""

# Child labels of registered classes whose layout is known (see iobundle/calls/_transformers.py):
# a layer of a cache is a group of children, shown once with the number of layers.
_LAYER_LABELS = {
    "transformers.DynamicCache": ("k", "v"),
    "transformers.StaticCache": ("k", "v", "len"),
}
_CHILD_LABELS = {"transformers.EncoderDecoderCache": ("self", "cross")}


# --------------------------------------------------------------------------- output


def out(text: str = "") -> None:
    """Write ``text`` and a newline to stdout."""
    sys.stdout.write(text + "\n")


def err(text: str) -> None:
    """Write ``text`` and a newline to stderr."""
    sys.stderr.write(text + "\n")


# --------------------------------------------------------------------------- trees


def _dtype(name: str) -> str:
    return name.lower().replace("_", "")


def format_tensor(manifest: Manifest, key: str) -> str:
    """``2x3 f32`` for the tensor stored under ``key`` (from the manifest, no data read)."""
    entry = manifest.tensors.get(key)
    if entry is None:
        return f"<missing tensor {key}>"
    shape = "x".join(map(str, entry.shape)) if entry.shape else "scalar"
    return f"{shape} {_dtype(entry.dtype)}"


def _short_type(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _join(parts: Sequence[str], total: int, what: str = "items") -> str:
    if total > len(parts):
        return ", ".join([*parts, f"... ({total} {what})"])
    return ", ".join(parts)


def _items(manifest: Manifest, items: Sequence[Node], depth: int) -> str:
    shown = items if len(items) <= MAX_ITEMS else items[: MAX_ITEMS - 1]
    return _join([format_node(manifest, n, depth=depth + 1) for n in shown], len(items))


def _object(manifest: Manifest, node: ObjectNode, depth: int) -> str:
    name = _short_type(node.type)
    items = node.items
    layer = _LAYER_LABELS.get(node.type)
    if layer and items and len(items) % len(layer) == 0:  # a cache: its first layer and the number of layers
        parts = [f"{label}:{format_node(manifest, n, depth=depth + 1)}" for label, n in zip(layer, items)]
        n_layers = len(items) // len(layer)
        if n_layers > 1:
            parts.append(f"... ({n_layers} layers)")
        return f"{name}[{', '.join(parts)}]"
    labels = _CHILD_LABELS.get(node.type)
    if labels and len(labels) == len(items):
        parts = [f"{label}:{format_node(manifest, n, depth=depth + 1)}" for label, n in zip(labels, items)]
        return f"{name}[{', '.join(parts)}]"
    context = node.context
    if isinstance(context, list) and len(context) == len(items) and all(isinstance(k, str) for k in context):
        # a ModelOutput: the context holds the field names of the children
        fields = list(zip(context, items))
        shown = fields if len(fields) <= MAX_ITEMS else fields[: MAX_ITEMS - 1]
        parts = [f"{k}={format_node(manifest, n, depth=depth + 1)}" for k, n in shown]
        return f"{name}({_join(parts, len(fields))})"
    return f"{name}[{_items(manifest, items, depth)}]"


def format_node(manifest: Manifest, node: Node, *, depth: int = 0) -> str:
    """Summarise a recorded tree in one short line: ``[2x4 f32]``, ``{'w': 2x3 f32}``, ``DynamicCache[k:...]``.

    Tensors show shape and dtype; containers with many items show the first ones and a count;
    registered classes show their short name (caches one layer and the number of layers).
    """
    if isinstance(node, TensorNode):
        return format_tensor(manifest, node.key)
    if isinstance(node, NoneNode):
        return "None"
    if isinstance(node, ConstNode):
        return repr(node.value)
    if isinstance(node, OpaqueNode):
        return f"<opaque {node.type}>"
    if depth >= MAX_DEPTH:
        return "{...}" if isinstance(node, DictNode) else "[...]"
    if isinstance(node, ListNode):
        return f"[{_items(manifest, node.items, depth)}]"
    if isinstance(node, TupleNode):
        inner = _items(manifest, node.items, depth)
        return f"({inner},)" if len(node.items) == 1 else f"({inner})"
    if isinstance(node, DictNode):
        pairs = list(zip(node.keys, node.items))
        shown = pairs if len(pairs) <= MAX_ITEMS else pairs[: MAX_ITEMS - 1]
        parts = [f"{k!r}: {format_node(manifest, v, depth=depth + 1)}" for k, v in shown]
        return f"{{{_join(parts, len(pairs))}}}"
    if isinstance(node, ObjectNode):
        return _object(manifest, node, depth)
    return f"<{getattr(node, 'kind', type(node).__name__)}>"


def _positional_names(manifest: Manifest) -> tuple[list[str], str | None]:
    names, var = [], None
    for p in manifest.signature.parameters:
        if p.kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            names.append(p.name)
        elif p.kind == "VAR_POSITIONAL":
            var = p.name
    return names, var


def _arg_name(manifest: Manifest, position: int) -> str:
    names, var = _positional_names(manifest)
    if position < len(names):
        return names[position]
    return f"*{var or 'args'}[{position - len(names)}]"


def format_inputs(manifest: Manifest, call: CallEntry) -> str:
    """``x=2x3 f32, cache=[2x4 f32]``: each input of ``call`` by name, ``(filled)`` when from value_if_missing."""
    names, _ = _positional_names(manifest)
    parts = []
    for i, node in enumerate(call.args):
        name = _arg_name(manifest, i)
        filled = " (filled)" if i in call.filled or (i < len(names) and names[i] in call.filled) else ""
        parts.append(f"{name}={format_node(manifest, node)}{filled}")
    for name, node in call.kwargs.items():
        filled = " (filled)" if name in call.filled else ""
        parts.append(f"{name}={format_node(manifest, node)}{filled}")
    return ", ".join(parts) or "-"


def format_latency(seconds: float | None) -> str:
    """Milliseconds with three significant digits or so: ``0.179 ms``, ``12.3 ms``."""
    if seconds is None:
        return "-"
    ms = seconds * 1000.0
    digits = 3 if ms < 1 else 2 if ms < 10 else 1 if ms < 100 else 0
    return f"{ms:.{digits}f} ms"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> str:
    """A plain-text table: columns padded to their widest cell, two spaces apart, no trailing blanks."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def _signature(manifest: Manifest) -> str:
    parts = []
    for p in manifest.signature.parameters:
        prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind, "")
        default = f"={p.default!r}" if p.has_default else ""
        parts.append(f"{prefix}{p.name}{default}")
    qualname = manifest.signature.qualname or manifest.signature.method
    return f"{qualname}({', '.join(parts)})"


def format_inspect(
    path: str | Path,
    manifest: Manifest,
    *,
    dynamic_shapes: Any = None,
    dynamic_shapes_error: str | None = None,
) -> str:
    """The report of ``iobundle inspect``: summary, one row per call, producer, inferred dynamic shapes."""
    calls = manifest.calls
    statuses: dict[str, int] = {}
    for call in calls:
        statuses[call.status] = statuses.get(call.status, 0) + 1
    status_text = ", ".join(f"{n} {s}" for s, n in statuses.items())
    total = sum(f.size for f in manifest.files.values())
    lines = [
        f"bundle     {path}",
        f"format     {manifest.format} v{manifest.format_version}",
        f"method     {_signature(manifest)}",
        f"calls      {len(calls)}" + (f" ({status_text})" if calls else ""),
        f"tensors    {len(manifest.tensors)} in {len(manifest.files)} files, {_size(total)}",
    ]
    for entry in manifest.value_if_missing:
        key = entry.key if isinstance(entry.key, str) else _arg_name(manifest, entry.key)
        lines.append(f"if missing {key}={format_node(manifest, entry.value)}")
    lines.append("")
    if calls:
        rows = [
            [
                str(c.index),
                c.status,
                format_latency(c.latency),
                format_inputs(manifest, c),
                ", ".join(f"{k}={v!r}" for k, v in c.cst_kwargs.items()) or "-",
            ]
            for c in calls
        ]
        lines.append(format_table(["#", "status", "latency", "inputs", "constants"], rows, right=(0, 2)))
        lines.extend(f"call {c.index} {c.status}: {c.error}" for c in calls if c.error)
    else:
        lines.append("no calls recorded")
    producer = manifest.producer
    versions = [f"iobundle {producer.iobundle}", f"torch {producer.torch}", f"python {producer.python}"]
    if producer.transformers:
        versions.append(f"transformers {producer.transformers}")
    lines += ["", "producer   " + ", ".join(versions)]
    if producer.devices:
        lines.append("devices    " + ", ".join(producer.devices))
    lines += ["", "dynamic shapes (inferred from the calls; Dim.DYNAMIC where sizes differ)"]
    if dynamic_shapes_error is not None:
        lines.append(f"  error: {dynamic_shapes_error}")
    else:
        lines.extend("  " + line for line in format_dynamic_shapes(dynamic_shapes).splitlines())
    return "\n".join(lines)


# --------------------------------------------------------------------------- dynamic shapes


def _dim_text(dim: Any) -> str:
    hint = getattr(dim, "type", None)  # torch.export.Dim.DYNAMIC / AUTO / STATIC (a _DimHint)
    if hint is not None and hasattr(hint, "name"):
        return f"Dim.{hint.name}"
    return repr(dim)


def _dim_json(dim: Any) -> str:
    hint = getattr(dim, "type", None)
    if hint is not None and hasattr(hint, "name"):
        return str(hint.name)
    return str(getattr(dim, "__name__", dim))


def _one_line(value: Any) -> str:
    if isinstance(value, dict):
        if value and all(isinstance(k, int) for k in value):
            return "{" + ", ".join(f"{k}: {_dim_text(v)}" for k, v in value.items()) + "}"
        return "{" + ", ".join(f"{k!r}: {_one_line(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        inner = ", ".join(_one_line(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_one_line(v) for v in value) + "]"
    return repr(value)


def _pretty(value: Any, indent: int) -> list[str]:
    line = _one_line(value)
    if len(line) + indent <= WIDTH or not isinstance(value, (dict, list, tuple)) or not value:
        return [line]
    if isinstance(value, dict) and all(isinstance(k, int) for k in value):
        return [line]  # a tensor's dims: never split
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        opening, closing = "{", "}"
        entries = [(f"{k!r}: ", v) for k, v in value.items()]
    else:
        opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        entries = [("", v) for v in value]
    lines = [opening]
    for prefix, item in entries:
        sub = _pretty(item, indent + 4 + len(prefix))
        lines.append(pad + prefix + sub[0])
        lines.extend(sub[1:])
        lines[-1] += ","
    lines.append(" " * indent + closing)
    return lines


def format_dynamic_shapes(dynamic_shapes: Any) -> str:
    """Python-like text of a ``dynamic_shapes`` structure: ``{'x': {0: Dim.DYNAMIC}}``, split when long."""
    return "\n".join(_pretty(dynamic_shapes, 0))


def dynamic_shapes_to_json(dynamic_shapes: Any) -> Any:
    """The structure as JSON values: tuples become lists, dims ``"DYNAMIC"`` (a hint) or the ``Dim``'s name."""
    value = dynamic_shapes
    if isinstance(value, dict):
        if value and all(isinstance(k, int) for k in value):
            return {str(k): _dim_json(v) for k, v in value.items()}
        return {str(k): dynamic_shapes_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [dynamic_shapes_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _dim_json(value)


def format_dynamic_shapes_json(dynamic_shapes: Any) -> str:
    """``dynamic_shapes_to_json`` as indented JSON text."""
    return json.dumps(dynamic_shapes_to_json(dynamic_shapes), indent=2)


# --------------------------------------------------------------------------- verify


def format_verify(manifest: Manifest, problems: Sequence[str]) -> str:
    """``OK: ...`` when every file matches the manifest, else one line per bad file."""
    if problems:
        return "\n".join(problems)
    total = sum(f.size for f in manifest.files.values())
    return f"OK: {len(manifest.files)} files, {_size(total)}, sizes and hashes match the manifest"


# --------------------------------------------------------------------------- export and validate


def _error_cell(value: Any) -> str:
    return "" if value is None or value != value else f"{value:.2e}"  # NaN (a failed run) shows empty


def _status(success: Any, error: Any, absent: Any) -> str:
    if success is True:
        return "ok"
    if success is None:
        return f"not checked (absent at capture: {absent})"
    return f"FAIL: {error}" if error else "FAIL: mismatch"


def format_export(report: Any, onnx_path: str | None) -> str:
    """The per-call check of an exported program, options, patches and timings."""
    rows = [
        [
            str(c.index),
            _status(c.success, c.error, ",".join(map(str, c.absent_inputs))),
            _error_cell(c.abs),
            _error_cell(c.rel),
        ]
        for c in report.calls
    ]
    lines = [f"torch.export: traced from call {report.traced_call} in {report.export_seconds:.2f}s"]
    lines += [f"  option: {o}" for o in report.options]
    lines += [f"  patch: {p}" for p in report.patches]
    lines.append(f"exported program checked on {len(report.calls)} recorded calls in {report.check_seconds:.2f}s:")
    lines.append(format_table(["call", "status", "max abs", "max rel"], rows, right=(0, 2, 3)))
    if onnx_path:
        seconds = f" in {report.onnx_seconds:.2f}s" if report.onnx_seconds is not None else ""
        lines.append(f"torch.onnx.export: ONNX model written to {onnx_path}{seconds}")
    return "\n".join(lines)


def format_validation(report: Any) -> str:
    """One row per call (status, max abs/rel error, durations) and the verdict."""
    rows = [
        [
            str(r["index"]),
            _status(r["SUCCESS"], r.get("error"), r.get("absent_inputs")),
            _error_cell(r["abs"]),
            _error_cell(r["rel"]),
            format_latency(r["duration_torch"]),
            format_latency(r["ort_duration"]),
        ]
        for r in report.rows
    ]
    table = format_table(["call", "status", "max abs", "max rel", "torch", "onnxruntime"], rows, right=(0, 2, 3, 4, 5))
    return f"{table}\n{report.verdict()} ({report.seconds:.2f}s)"


REPORT_FORMATS = {".json": "json", ".csv": "csv", ".md": "markdown", ".markdown": "markdown"}


def format_report_file(rows: Sequence[dict[str, Any]], fmt: str) -> str:
    """The rows of a validation as JSON, CSV or a Markdown table."""
    if fmt == "json":
        return json.dumps(list(rows), indent=1, default=str) + "\n"
    columns = list(dict.fromkeys(k for r in rows for k in r))
    if fmt == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def cell(value: Any) -> str:
        return (f"{value:.3g}" if isinstance(value, float) else str(value)).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"
