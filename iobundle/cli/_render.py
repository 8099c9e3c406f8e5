"""Everything the ``iobundle`` command writes to the terminal: tables, trees, shapes, errors.

Formatting functions return strings (the tests read them); :func:`out` and :func:`err` are the
only places that write. Tables are drawn by rich (imported on first use, so ``--help`` never pays
for it): in colour on a terminal, plain on a pipe or a file or with ``NO_COLOR``; on a pipe
nothing is wrapped (``iobundle inspect B | less -S``).

Strings from a bundle are drawn as text: control characters and escape sequences become visible
escapes (:func:`iobundle._escape.terminal_text`) in every cell and line that carries one, and rich
never reads markup in them. Nothing here imports torch, nor the schema's pydantic models: trees
are read through their ``kind`` field and ``torch.export.Dim`` objects by their attributes.
"""

from __future__ import annotations

import io
import logging
import operator
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iobundle._escape import terminal_text
from iobundle._status import call_status, row_status, status_class
from iobundle._units import format_latency, format_size
from iobundle.cli._render_shapes import GROUPS_REASON, format_dynamic_shapes, format_group_shapes

if TYPE_CHECKING:
    from iobundle.replay import StoredModel
    from iobundle.schema import CallEntry, Manifest, Node, ObjectNode

__all__ = [
    "MAX_CALL_ROWS",
    "CallRun",
    "PlainLogFormatter",
    "call_runs",
    "color_enabled",
    "err",
    "format_inputs",
    "format_inspect",
    "format_latency",
    "format_node",
    "format_redaction",
    "format_storage",
    "format_stored_model",
    "format_table",
    "format_tensor",
    "format_verify",
    "out",
    "plain",
    "render",
]

MAX_ITEMS = 4
"""A container with more items shows the first ``MAX_ITEMS - 1`` and a count."""
MAX_DEPTH = 4
"""Containers nested deeper are shown as ``[...]``."""


# --------------------------------------------------------------------------- output


def out(text: str = "") -> None:
    """Write ``text`` and a newline to stdout, flushed: on a pipe too, each line shows when its step ends."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def color_enabled(stream: Any = None) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (https://no-color.org) or ``TERM=dumb``."""
    if os.environ.get("NO_COLOR", "") != "" or os.environ.get("TERM") == "dumb":
        return False
    return _isatty(sys.stdout if stream is None else stream)


def render(renderable: Any, *, stream: Any = None) -> str:
    """Text of a rich renderable for ``stream`` (default stdout): ANSI colours only when :func:`color_enabled`.

    On a terminal the text fits its width; elsewhere nothing is wrapped.
    """
    from rich.console import Console

    target = sys.stdout if stream is None else stream
    color = color_enabled(target)
    width = shutil.get_terminal_size().columns if _isatty(target) else 100_000
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=width, force_terminal=color, no_color=not color, color_system="standard" if color else None,
        highlight=False, emoji=False, markup=False, legacy_windows=False,
    )  # fmt: skip
    console.print(renderable, overflow="fold", crop=False)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").splitlines())


def err(text: str) -> None:
    """Write ``text`` and a newline to stderr (flushed), its control characters but line breaks shown as escapes.

    What goes there (errors, warnings) quotes bundle strings: none of them may drive the terminal.
    """
    sys.stderr.write(terminal_text(text, keep_newlines=True) + "\n")
    sys.stderr.flush()


class PlainLogFormatter(logging.Formatter):
    """A log formatter whose messages (which may quote bundle strings) show control characters as escapes."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        # a copy: other handlers (pytest's, the user's) see the record as logged
        escaped = logging.makeLogRecord({**record.__dict__, "message": terminal_text(record.message)})
        return super().formatMessage(escaped)


def plain(text: Any) -> str:
    """``str(text)`` with control characters and escape sequences shown as visible escapes (for a bundle string)."""
    return terminal_text(text)


# --------------------------------------------------------------------------- trees


def _dtype(name: str) -> str:
    return name.lower().replace("_", "")


def format_tensor(manifest: Manifest, key: str) -> str:
    """``2x3 f32`` for the tensor stored under ``key`` (from the manifest, no data read)."""
    from iobundle.schema import tensor_rows  # the manifest is loaded, so schema already is

    entry = tensor_rows(manifest).get(key)  # the rows opening kept: no tensor entry built
    if entry is None:
        return f"<missing tensor {key}>"
    shape = "x".join(map(str, entry.shape)) if entry.shape else "scalar"
    return f"{shape} {_dtype(entry.dtype)}"


def _join(parts: Sequence[str], total: int, what: str = "items") -> str:
    if total > len(parts):
        return ", ".join([*parts, f"... ({total} {what})"])
    return ", ".join(parts)


TensorText = Callable[[str], str]
"""The text of the tensor stored under a key (:func:`format_tensor` of the manifest, or a run's merged shapes)."""


def _items(tensor: TensorText, items: Sequence[Node], depth: int) -> str:
    shown = items if len(items) <= MAX_ITEMS else items[: MAX_ITEMS - 1]
    return _join([_node(tensor, n, depth + 1) for n in shown], len(items))


def _object(tensor: TensorText, node: ObjectNode, depth: int) -> str:
    from iobundle.calls import cache_child_labels  # torch-free; imported once a tree is shown (not for --help)

    name = node.type.rsplit(".", 1)[-1]
    items = node.items
    layers = cache_child_labels(node.type, node.context)  # a cache: its first layer and the number of layers
    if layers and sum(map(len, layers)) == len(items):
        parts = [f"{label}:{_node(tensor, n, depth + 1)}" for label, n in zip(layers[0], items)]
        if len(layers) > 1:
            parts.append(f"... ({len(layers)} layers)")
        return f"{name}[{', '.join(parts)}]"
    context = node.context
    if isinstance(context, list) and len(context) == len(items) and all(isinstance(k, str) for k in context):
        # a ModelOutput: the context holds the field names of the children
        fields = list(zip(context, items))
        shown = fields if len(fields) <= MAX_ITEMS else fields[: MAX_ITEMS - 1]
        parts = [f"{k}={_node(tensor, n, depth + 1)}" for k, n in shown]
        return f"{name}({_join(parts, len(fields))})"
    return f"{name}[{_items(tensor, items, depth)}]"


def format_node(manifest: Manifest, node: Node, *, depth: int = 0) -> str:
    """Summarise a recorded tree in one short line: ``[2x4 f32]``, ``{'w': 2x3 f32}``, ``DynamicCache[k:...]``.

    Tensors show shape and dtype; containers with many items show the first ones and a count;
    registered classes show their short name (caches one layer and the number of layers).
    """
    return plain(_node(lambda key: format_tensor(manifest, key), node, depth))


def _node(tensor: TensorText, node: Node, depth: int) -> str:
    kind = getattr(node, "kind", None)
    if kind == "tensor":
        return tensor(node.key)  # type: ignore[union-attr]
    if kind == "none":
        return "None"
    if kind == "const":
        return repr(node.value)  # type: ignore[union-attr]
    if kind == "opaque":
        return f"<opaque {node.type}>"  # type: ignore[union-attr]
    if depth >= MAX_DEPTH:
        return "{...}" if kind == "dict" else "[...]"
    if kind == "list":
        return f"[{_items(tensor, node.items, depth)}]"  # type: ignore[union-attr]
    if kind == "tuple":
        inner = _items(tensor, node.items, depth)  # type: ignore[union-attr]
        return f"({inner},)" if len(node.items) == 1 else f"({inner})"  # type: ignore[union-attr]
    if kind == "dict":
        pairs = list(zip(node.keys, node.items))  # type: ignore[union-attr]
        shown = pairs if len(pairs) <= MAX_ITEMS else pairs[: MAX_ITEMS - 1]
        parts = [f"{k!r}: {_node(tensor, v, depth + 1)}" for k, v in shown]
        return f"{{{_join(parts, len(pairs))}}}"
    if kind == "node":
        return _object(tensor, node, depth)  # type: ignore[arg-type]
    return f"<{kind or type(node).__name__}>"


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


def format_inputs(manifest: Manifest, call: CallEntry, tensor: TensorText | None = None) -> str:
    """``x=2x3 f32, cache=[2x4 f32]``: each input of ``call`` by name, ``(filled)`` when from value_if_missing.

    ``tensor`` gives the text of each tensor (by default its shape and dtype, :func:`format_tensor`).
    """
    if tensor is None:
        tensor = lambda key: format_tensor(manifest, key)  # noqa: E731
    names, _ = _positional_names(manifest)
    parts = []
    for i, node in enumerate(call.args):
        name = _arg_name(manifest, i)
        filled = " (filled)" if i in call.filled or (i < len(names) and names[i] in call.filled) else ""
        parts.append(f"{name}={_node(tensor, node, 0)}{filled}")
    for name, node in call.kwargs.items():
        filled = " (filled)" if name in call.filled else ""
        parts.append(f"{name}={_node(tensor, node, 0)}{filled}")
    return plain(", ".join(parts) or "-")


# --------------------------------------------------------------------------- runs of calls

MAX_CALL_ROWS = 20
"""``iobundle inspect`` lists up to this many calls one per row; more are summarised by runs (``--calls``)."""


class CallRun:
    """Consecutive calls that show the same row but for their tensors' sizes (and latencies).

    Attributes:
        calls: The calls, in manifest order.
        keys: Per call, its input tensors' keys in flattening order (every call has as many, of one
            rank and dtype position by position, and no key twice).
    """

    def __init__(self, calls: list[CallEntry], keys: list[list[str]]) -> None:
        self.calls = calls
        self.keys = keys

    def shape_text(self, manifest: Manifest) -> TensorText:
        """The text of each tensor of the first call, with the sizes of every call: ``1x2x5..1003x8 f32``."""
        from iobundle.schema import tensor_rows

        tensors = tensor_rows(manifest)
        texts = {}
        for column in zip(*self.keys):  # one tensor position, its key in every call
            entries = list(map(tensors.__getitem__, column))
            dims = [str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in map(_span, zip(*map(_SHAPE, entries)))]
            texts[column[0]] = f"{'x'.join(dims) if dims else 'scalar'} {_dtype(entries[0].dtype)}"
        return texts.__getitem__

    def _split(self, manifest: Manifest) -> list[CallRun]:
        """This run cut where a tensor position changes dtype or rank, or names a tensor the manifest lacks."""
        from iobundle.schema import tensor_rows

        tensors = tensor_rows(manifest)
        if len(self.calls) == 1 or all(_uniform(tensors, column) for column in zip(*self.keys)):
            return [self]
        runs: list[CallRun] = []
        last: Any = None
        for call, keys in zip(self.calls, self.keys):
            kinds = [None if (e := tensors.get(k)) is None else (e.dtype, len(e.shape)) for k in keys]
            if runs and last == kinds and None not in kinds:
                runs[-1].calls.append(call)
                runs[-1].keys.append(keys)
            else:
                runs.append(CallRun([call], [keys]))
            last = kinds
        return runs


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def _span(sizes: Sequence[int]) -> tuple[int, int]:
    return min(sizes), max(sizes)


def _uniform(tensors: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether the tensors under ``keys`` are all listed, of one dtype and one rank."""
    if not all(map(tensors.__contains__, keys)):
        return False
    entries = list(map(tensors.__getitem__, keys))
    return len(set(map(_DTYPE, entries))) == 1 and len(set(map(len, map(_SHAPE, entries)))) == 1


def call_runs(manifest: Manifest) -> list[CallRun]:
    """The calls of ``manifest`` grouped into runs of consecutive calls that differ only in tensor sizes.

    Two calls fall in one run when they have the same status, the same input structure
    (``iobundle.schema.call_key``: names, containers, classes and their contexts, scalars,
    constants, placeholders) and, tensor by tensor, the same dtype and rank. A call that passes one tensor twice is a run of its own.
    """
    from iobundle.schema import call_key, deferred_calls, deferred_shape  # the manifest is loaded: schema is

    runs: list[CallRun] = []
    last: Any = None
    for call in deferred_calls(manifest):
        deferred = deferred_shape(call)  # a call opened from format version 3: known per structure, trees unbuilt
        if deferred is None:
            keys: list[str] = []
            skeleton = (call.status, call_key(call, keys))
        else:
            skeleton, keys = (call.status, deferred[0]), deferred[1]
        unique = len(set(keys)) == len(keys)
        if unique and runs and last == skeleton:
            runs[-1].calls.append(call)
            runs[-1].keys.append(keys)
            continue
        runs.append(CallRun([call], [keys]))
        last = skeleton if unique else None
    return [part for run in runs for part in run._split(manifest)]


def _latency_range(calls: Sequence[CallEntry]) -> str:
    known = [c.latency for c in calls if c.latency is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    if low == high or len(calls) == 1:
        return format_latency(low)
    return f"{format_latency(low).removesuffix(' ms')}-{format_latency(high)}"


def _runs_table(manifest: Manifest, runs: Sequence[CallRun]) -> str:
    rows = []
    for run in runs:
        first, last = run.calls[0], run.calls[-1]
        rows.append(
            [
                str(first.index) if len(run.calls) == 1 else f"{first.index}-{last.index}",
                first.status,
                _latency_range(run.calls),
                format_inputs(manifest, first, run.shape_text(manifest) if len(run.calls) > 1 else None),
                ", ".join(f"{k}={v!r}" for k, v in first.cst_kwargs.items()) or "-",
            ]
        )
    return format_table(["#", "status", "latency", "inputs", "constants"], rows, right=(0, 2))


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    styles: Sequence[Sequence[str | None]] | None = None,
) -> str:
    """A table drawn by rich: a rule under the header, columns two spaces apart, no outer border.

    ``styles[i][j]`` is an optional rich style of cell ``(i, j)`` (``"red"``, ``"bold green"``),
    shown only when colour is on.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for i, header in enumerate(headers):
        table.add_column(plain(header), justify="right" if i in right else "left", no_wrap=i in right)
    for i, row in enumerate(rows):
        cells = []
        for j, cell in enumerate(row):
            style = styles[i][j] if styles is not None and j < len(styles[i]) else None
            cells.append(Text(plain(cell), style=style or ""))
        table.add_row(*cells)
    return render(table)


def _signature(manifest: Manifest) -> str:
    parts = []
    for p in manifest.signature.parameters:
        prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(p.kind, "")
        default = f"={p.default!r}" if p.has_default else ""
        parts.append(f"{prefix}{p.name}{default}")
    qualname = manifest.signature.qualname or manifest.signature.method
    return plain(f"{qualname}({', '.join(parts)})")


def format_stored_model(model: StoredModel) -> list[str]:
    """The ``model`` lines of ``iobundle inspect``: class, model_type, attention, sizes, --from-bundle verdict."""
    attention = model.attn_implementation or "default"
    kind = f"model_type {model.model_type or '?'}" if model.library == "transformers" else model.library
    lines = [
        f"model      {model.class_name} ({kind}, attention {attention}), "
        f"weights {format_size(model.weights_bytes)}, config {format_size(model.config_bytes)}"
    ]
    if model.submodule:
        lines.append(f"           observed submodule {model.submodule}")
    if model.refused is None:
        lines.append(
            "           accepted by --from-bundle (a registered class, a config that selects no code)"
            if model.class_checked
            else "           its config selects no code (--from-bundle also checks the class)"
        )
    else:
        lines.append(f"           refused by --from-bundle: {model.refused}")
    return [plain(line) for line in lines]


def format_storage(*, packed: bool, remote: bool) -> str:
    """How a bundle is stored, in a few words: a directory, or one packed file; local or at a URL."""
    kind = "packed: one file (iobundle pack), read in place" if packed else "a directory"
    return f"{kind}, at a URL (fsspec)" if remote else kind


def format_redaction(manifest: Manifest) -> str:
    """Whether the bundle was written by ``iobundle redact``, and what it kept."""
    marker = manifest.redacted
    if marker is None:
        return "no (the recorded inputs are the real ones)"
    outputs = "kept (computed on the real inputs)" if marker.outputs_kept else "dropped"
    model = "kept" if marker.model_kept else "not kept"
    return f"yes: inputs synthetic (seed {marker.seed}), outputs {outputs}, model {model}"


def format_inspect(
    path: str | Path,
    manifest: Manifest,
    *,
    dynamic_shapes: Any = None,
    dynamic_shapes_error: str | None = None,
    group_shapes: Sequence[Any] = (),
    model: StoredModel | None = None,
    packed: bool | None = None,
    remote: bool = False,
    calls_shown: str = "auto",
) -> str:
    """The report of ``iobundle inspect``: summary, stored model, the calls, producer, dynamic shapes.

    ``packed`` (None: unknown, no line) and ``remote`` say how the bundle is stored. ``calls_shown``
    is ``"all"`` (one row per call), ``"runs"`` (one row per run of consecutive calls that differ
    only in tensor sizes, each size shown as the range it spans: ``1x2x5..1003x8 f32``, see
    :func:`call_runs`), ``"auto"`` (every call up to :data:`MAX_CALL_ROWS` calls, runs beyond) or ``"none"``.
    ``group_shapes`` (:class:`~iobundle.replay.infer.GroupShapes`) stand for the dynamic shapes of
    calls that align only group by group, each group's shown under the calls and keywords it has.
    """
    from iobundle.schema import deferred_calls, tensor_rows

    calls = deferred_calls(manifest)  # format version 3: the calls' trees are built for the rows shown only
    status_text = ", ".join(f"{n} {s}" for s, n in Counter(call.status for call in calls).items())
    total = sum(f.size for f in manifest.files.values())
    lines = [
        plain(f"bundle     {path}"),
        f"format     {manifest.format}, format_version {manifest.format_version}",
    ]
    if packed is not None:
        lines.append("stored     " + format_storage(packed=packed, remote=remote))
    lines.append("redacted   " + format_redaction(manifest))
    lines += [
        f"method     {_signature(manifest)}",
        f"calls      {len(calls)}" + (f" ({status_text})" if calls else ""),
        f"tensors    {len(tensor_rows(manifest))} in {len(manifest.files)} file{'s' * (len(manifest.files) != 1)}, "
        + format_size(total),
    ]
    for entry in manifest.value_if_missing:
        key = entry.key if isinstance(entry.key, str) else _arg_name(manifest, entry.key)
        lines.append(plain(f"if missing {key}={format_node(manifest, entry.value)}"))
    if model is not None:
        lines.extend(format_stored_model(model))
    lines.append("")
    if calls_shown == "none":  # inspect -q: the summary without its calls
        lines.pop()
    elif calls and (calls_shown == "all" or (calls_shown == "auto" and len(calls) <= MAX_CALL_ROWS)):
        lines.append(_runs_table(manifest, [CallRun([c], []) for c in calls]))  # one row per call
        lines.extend(plain(f"call {c.index} {c.status}: {c.error}") for c in calls if c.error)
    elif calls:
        runs = call_runs(manifest)
        lines.append(
            f"{len(calls)} calls in {len(runs)} run{'s' if len(runs) > 1 else ''} of consecutive calls that differ "
            "only in tensor sizes "
            "(a..b: the sizes a run spans; --calls all lists every call)"
        )
        lines.append(_runs_table(manifest, runs))
        lines.extend(plain(f"call {c.index} {c.status}: {c.error}") for c in calls if c.error)
    else:
        lines.append("no calls recorded")
    producer = manifest.producer
    versions = [f"iobundle {producer.iobundle}", f"torch {producer.torch}", f"python {producer.python}"]
    if producer.transformers:
        versions.append(f"transformers {producer.transformers}")
    lines += ["", plain("producer   " + ", ".join(versions))]
    if producer.devices:
        lines.append(plain("devices    " + ", ".join(producer.devices)))
    autocast = _autocast_line(calls)
    if autocast:
        lines.append(plain("autocast   " + autocast))
    if group_shapes:
        lines += ["", f"dynamic shapes per keyword group ({GROUPS_REASON}; Dim.DYNAMIC where sizes differ)"]
        lines.extend("  " + line for line in format_group_shapes(group_shapes, header=False).splitlines())
        return "\n".join(lines)
    lines += ["", "dynamic shapes (inferred from the calls; Dim.DYNAMIC where sizes differ)"]
    if dynamic_shapes_error is not None:
        lines.append(plain(f"  error: {dynamic_shapes_error}"))
    else:
        lines.extend(plain("  " + line) for line in format_dynamic_shapes(dynamic_shapes).splitlines())
    return "\n".join(lines)


# --------------------------------------------------------------------------- verify


def format_verify(manifest: Manifest, problems: Sequence[str], *, quiet: bool = False) -> str:
    """``OK: ...`` when every file matches the manifest, else one line per bad file and ``DAMAGED: ...``."""
    if problems:
        verdict = f"DAMAGED: {len(problems)} of {len(manifest.files)} files differ from the manifest"
        return verdict if quiet else "\n".join([*map(plain, problems), verdict])
    total = sum(f.size for f in manifest.files.values())
    n = len(manifest.files)
    return f"OK: {n} file{'s' if n != 1 else ''}, {format_size(total)}, sizes and hashes match the manifest"


# --------------------------------------------------------------------------- export and validate


def _error_cell(value: Any) -> str:
    return "" if value is None or value != value else f"{value:.2e}"  # NaN (a failed run) shows empty


def _status_style(status: str) -> str:
    return {"ok": "green", "not checked": "yellow"}.get(status_class(status), "bold red")


def _styled(rows: Sequence[Sequence[str]], status_column: int = 1) -> list[list[str | None]]:
    return [[_status_style(r[status_column]) if j == status_column else None for j in range(len(r))] for r in rows]


def format_verdict(text: str, ok: bool) -> str:
    """The verdict line, bold green or bold red on a terminal."""
    from rich.text import Text

    return render(Text(plain(text), style="bold green" if ok else "bold red"))


def _autocast_line(calls: Any) -> str:
    """``cuda bfloat16 on 4 of 4 calls (replayed under it)``: the torch.autocast the calls were recorded under."""
    states = Counter(f"{e.device_type} {e.dtype}" for call in calls for e in call.autocast or () if e.enabled)
    if not states:
        return ""
    parts = [f"{key} on {count} of {len(calls)} calls" for key, count in states.items()]
    return "torch.autocast " + "; ".join(parts) + " (replay runs the model under it)"


def format_export(report: Any, onnx_path: str | None) -> str:
    """The per-call check of an exported program, options, patches and timings."""
    rows = [
        [
            str(c.index),
            call_status(c.success, c.error, ",".join(map(str, c.absent_inputs))),
            _error_cell(c.abs),
            _error_cell(c.rel),
        ]
        for c in report.calls
    ]
    lines = [f"torch.export: traced from call {report.traced_call} in {report.export_seconds:.2f}s"]
    lines += [f"  option: {o}" for o in report.options]
    lines += [f"  patch: {p}" for p in report.patches]
    lines.append(f"exported program checked on {len(report.calls)} recorded calls in {report.check_seconds:.2f}s:")
    lines.append(format_table(["call", "status", "max abs", "max rel"], rows, right=(0, 2, 3), styles=_styled(rows)))
    if onnx_path:
        seconds = f" in {report.onnx_seconds:.2f}s" if report.onnx_seconds is not None else ""
        lines.append(f"torch.onnx.export: ONNX model written to {onnx_path}{seconds}")
    return "\n".join(lines)


_EXTRA_COLUMNS: dict[str, list[tuple[str, str, Callable[[Any], str]]]] = {
    # diff: what differs goes below the table, one line per call, so the table stays narrow
    "diff": [("inputs abs", "inputs_abs", _error_cell)],
    "run": [("recorded", "duration_torch", format_latency), ("re-run", "duration_rerun", format_latency)],
    "validate": [("torch", "duration_torch", format_latency), ("onnxruntime", "ort_duration", format_latency)],
}
"""The columns after ``max rel`` of each kind of report: header, row field, how a cell shows it."""


def format_validation(report: Any, *, quiet: bool = False) -> str:
    """One row per call (status, max abs/rel error, durations), the worst outputs, and the verdict.

    Works for the reports of ``validate_onnx`` (onnxruntime), ``rerun_model`` and ``diff_bundles``.
    """
    verdict = format_verdict(f"{report.verdict()} ({report.seconds:.2f}s)", report.ok)
    if quiet:
        return verdict
    extra = _EXTRA_COLUMNS.get(getattr(report, "kind", "validate"), _EXTRA_COLUMNS["validate"])
    headers = ["call", "status", "max abs", "max rel", *(header for header, _, _ in extra)]
    rows = [
        [str(r["index"]), row_status(r), _error_cell(r["abs"]), _error_cell(r["rel"])]
        + [show(r.get(field)) for _, field, show in extra]
        for r in report.rows
    ]
    status_column = 1
    if any("program" in r for r in report.rows):  # validated through a program index
        headers.insert(1, "program")
        for row, r in zip(rows, report.rows):
            row.insert(1, str(r.get("program") or "-"))
        status_column = 2
    right = tuple(i for i, h in enumerate(headers) if h not in ("status", "program"))
    lines = [format_table(headers, rows, right=right, styles=_styled(rows, status_column))]
    lines += [f"call {r['index']}: {plain(r['differences'])}" for r in report.rows if r.get("differences")]
    if any(r.get("SUCCESS") and (r.get("rel") or 0) > 1 for r in report.rows):  # an expected value near 0
        lines.append("max rel is |actual - expected| / |expected|, large where an expected value is near 0; "
                     "an output passes when its error is within atol or within rtol")  # fmt: skip
    worst = sorted(
        (c for c in getattr(report, "outputs", []) if c.success is False),
        key=lambda c: c.stats.max_abs if c.stats is not None else float("inf"),
        reverse=True,
    )[:5]
    if worst:
        out_rows = [
            [
                str(c.call),
                c.name + (f" ({c.other_name})" if c.other_name else ""),
                "x".join(map(str, c.shape)) or "scalar",
                c.dtype,
                _error_cell(c.stats.max_abs) if c.stats else c.error or "",
                f"{c.atol:g}",
            ]
            for c in worst
        ]
        lines.append("outputs out of tolerance (worst first):")
        lines.append(format_table(["call", "output", "shape", "dtype", "max abs", "atol"], out_rows, right=(0, 4, 5)))
    lines.append(verdict)
    return "\n".join(lines)
