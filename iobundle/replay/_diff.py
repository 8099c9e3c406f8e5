"""Compare two bundles call by call: structure, shapes, dtypes, constants, and values within tolerances."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import NAME_TO_DTYPE, child_path, item_labels, positional_names, replay_autocast, tensor_paths
from iobundle.errors import NothingToCompareError
from iobundle.replay._bundle import Bundle, load_bundle
from iobundle.replay.check import (
    OutputCheck,
    Scratch,
    Tolerances,
    ValidationReport,
    check_error_stat_name,
    compare_call,
    recorded_output_names,
    refuse_unknown_outputs,
    refuse_unused,
)
from iobundle.schema import CallEntry, ConstNode, DictNode, Manifest, Node, ObjectNode, OpaqueNode, TensorNode

__all__ = ["DiffReport", "diff_bundles"]

logger = logging.getLogger(__name__)


@dataclass
class DiffReport(ValidationReport):
    """What :func:`diff_bundles` found: the rows and checks of a validation, plus the differences in words.

    Each row (one per call position) has ``SUCCESS``, ``abs``/``rel`` (largest output errors),
    ``inputs_abs`` (largest input difference), ``n_differences`` and ``differences`` (structure,
    shapes, dtypes, constants, status; ``"; "``-separated). ``differences`` also holds the
    differences of the bundles as a whole (number of calls, method).
    """

    differences: list[str] = field(default_factory=list)
    outputs_compared: bool = True
    """False when a bundle holds no recorded outputs (redacted): structure and inputs only were compared."""
    note: str = ""
    """Why the outputs were not compared, for the verdict."""

    @property
    def ok(self) -> bool:
        return self.n_failed == 0 and not self.differences

    def verdict(self) -> str:
        same = sum(1 for r in self.rows if r["SUCCESS"])
        what = f"within {self.criterion()}" if self.outputs_compared else "inputs within the default tolerances"
        text = f"{'PASS' if self.ok else 'FAIL'}: {same}/{len(self.rows)} calls alike (structure, shapes, dtypes) and {what}"
        text += f"; {self.note}" if self.note else ""
        return text + (f"; {'; '.join(self.differences)}" if self.differences else "")


@dataclass
class _Pair:
    path: str
    key_a: str
    key_b: str
    is_input: bool
    node_a: TensorNode | None = None
    index: int = -1
    """The tensor's position among A's flattened outputs (outputs only)."""


def _shape(m: Manifest, key: str) -> str:
    entry = m.tensors[key]
    dtype = NAME_TO_DTYPE.get(entry.dtype)
    return f"{'x'.join(map(str, entry.shape)) or 'scalar'} {str(dtype).replace('torch.', '') if dtype else entry.dtype}"


def _what_differs(diffs: list[str]) -> str:
    """A call's status: ``dtype float32 in A, bfloat16 in B`` when that is all that differs, else how many differ."""
    dtypes = {d.split(": dtype ", 1)[-1] for d in diffs}
    if len(dtypes) == 1 and all(": dtype " in d for d in diffs):
        return f"dtype {dtypes.pop()}"
    return f"{len(diffs)} difference{'s' if len(diffs) > 1 else ''}"


def _walk(a: Node | None, b: Node | None, path: str, ma: Manifest, mb: Manifest, out: list[str], pairs: list[_Pair], is_input: bool) -> None:  # fmt: skip
    """Compare two trees; structural differences go to ``out``, tensors of one shape and dtype to ``pairs``."""
    where = path or "output"  # a bare tensor returned
    if a is None or b is None:
        if (a is None) != (b is None):
            out.append(
                f"{where}: {'absent' if a is None else 'present'} in A, {'absent' if b is None else 'present'} in B"
            )
        return
    if a.kind != b.kind:
        out.append(f"{where}: {a.kind} in A, {b.kind} in B")
        return
    if isinstance(a, TensorNode) and isinstance(b, TensorNode):
        ea, eb = ma.tensors[a.key], mb.tensors[b.key]
        if list(ea.shape) != list(eb.shape):
            out.append(f"{where}: {_shape(ma, a.key)} in A, {_shape(mb, b.key)} in B")
        elif ea.dtype != eb.dtype:
            out.append(f"{where}: dtype {_shape(ma, a.key).split()[-1]} in A, {_shape(mb, b.key).split()[-1]} in B")
        else:
            pairs.append(_Pair(path, a.key, b.key, is_input, node_a=a))
        return
    if isinstance(a, ConstNode) and isinstance(b, ConstNode):
        if a.value != b.value or type(a.value) is not type(b.value):
            out.append(f"{where}: {a.value!r} in A, {b.value!r} in B")
        return
    if isinstance(a, OpaqueNode) and isinstance(b, OpaqueNode):
        if a.type != b.type:
            out.append(f"{where}: opaque {a.type} in A, {b.type} in B")
        return
    if isinstance(a, DictNode) and isinstance(b, DictNode):
        da, db = dict(zip(a.keys, a.items)), dict(zip(b.keys, b.items))
        for k in a.keys:
            at = child_path(path, k if isinstance(k, str) else None, k)
            if k in db:
                _walk(da[k], db[k], at, ma, mb, out, pairs, is_input)
            else:
                out.append(f"{at}: present in A, absent in B")
        out.extend(
            f"{child_path(path, k if isinstance(k, str) else None, k)}: absent in A, present in B"
            for k in b.keys
            if k not in da
        )
        return
    if isinstance(a, ObjectNode) and isinstance(b, ObjectNode) and a.type != b.type:
        out.append(f"{where}: {a.type} in A, {b.type} in B")
        return
    items_a, items_b = getattr(a, "items", []), getattr(b, "items", [])
    if len(items_a) != len(items_b):
        what = "layers/items" if isinstance(a, ObjectNode) else "items"
        out.append(f"{where}: {len(items_a)} {what} in A, {len(items_b)} in B")
    for i, (label, x, y) in enumerate(zip(item_labels(a), items_a, items_b)):  # paths as output_paths reads them
        _walk(x, y, child_path(path, label, i), ma, mb, out, pairs, is_input)


def _has_outputs(bundle: Bundle) -> bool:
    ok = [c for c in bundle.calls if c.status == "ok"]
    return not ok or any(c.outputs is not None for c in ok)


def _call_pairs(a: Bundle, b: Bundle, ca: CallEntry, cb: CallEntry, out: list[str], *, outputs: bool = True) -> list[_Pair]:  # fmt: skip
    pairs: list[_Pair] = []
    names = list(positional_names(a.manifest.signature))
    if ca.status != cb.status:
        out.append(f"status: {ca.status} in A, {cb.status} in B")
    if len(ca.args) != len(cb.args):
        out.append(f"positional arguments: {len(ca.args)} in A, {len(cb.args)} in B")
    for i, (x, y) in enumerate(zip(ca.args, cb.args)):
        _walk(x, y, names[i] if i < len(names) else f"args[{i}]", a.manifest, b.manifest, out, pairs, True)
    for k in dict.fromkeys([*ca.kwargs, *cb.kwargs]):
        _walk(ca.kwargs.get(k), cb.kwargs.get(k), k, a.manifest, b.manifest, out, pairs, True)
    for k in dict.fromkeys([*ca.cst_kwargs, *cb.cst_kwargs]):
        va, vb = ca.cst_kwargs.get(k), cb.cst_kwargs.get(k)
        if va != vb or type(va) is not type(vb):
            out.append(f"constant {k}: {va!r} in A, {vb!r} in B")
    if ca.status == "ok" and cb.status == "ok" and outputs:
        outs: list[_Pair] = []
        _walk(ca.outputs, cb.outputs, "", a.manifest, b.manifest, out, outs, False)
        # Outputs are named as validate and run name them (output_paths), so one --atol NAME=... fits all three;
        # pairs are kept in the flattening order of A's outputs.
        leaves = tensor_paths(ca.outputs)
        index = {id(node): i for i, (_, node) in enumerate(leaves)}
        for p in outs:
            p.index = index.get(id(p.node_a), len(leaves))
            p.path = leaves[p.index][0] if p.index < len(leaves) else p.path
        pairs.extend(sorted(outs, key=lambda p: p.index))
    return pairs


def _autocast_side(ca: CallEntry, cb: CallEntry) -> CallEntry:
    """The call of a pair whose ``torch.autocast`` state decides its tolerances: A's, or B's when only B's had one."""
    return cb if replay_autocast(ca.autocast) is None and replay_autocast(cb.autocast) is not None else ca


def _open(value: Bundle | str | os.PathLike[str]) -> Bundle:
    return value if isinstance(value, Bundle) else load_bundle(value)


def diff_bundles(
    a: Bundle | str | os.PathLike[str],
    b: Bundle | str | os.PathLike[str],
    *,
    on_progress: ProgressCallback | None = None,
    atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
    output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
    tolerances: Tolerances | None = None,
) -> DiffReport:  # fmt: skip
    """Compare bundle ``a`` (the reference) with bundle ``b``, call by call.

    Calls are paired by position. For each pair: the status, the structure of the inputs and
    outputs (containers, keys, registered classes, number of cache layers), the constants, each
    tensor's shape and dtype, then the values of the tensors that agree in shape and dtype: the
    outputs output by output as in :func:`iobundle.replay.validate_onnx` (per-output tolerances,
    ``check_error_stat``), the inputs with the default tolerances. A pair recorded under
    ``torch.autocast`` (A's call, or B's when only B's was) is compared as validate compares such
    a call (:meth:`~iobundle.replay.check.Tolerances.for_call`): its float32 outputs and inputs take
    the autocast dtype's row of the dtype table, call by call. A call differs when anything
    structural differs or a value is out of tolerance. Typical uses: a capture on a GPU vs one on
    a CPU, a capture before vs after a library upgrade.

    When a bundle holds no recorded outputs (``iobundle redact`` without ``--keep-outputs``), the
    structure and the inputs are compared, not the outputs: the report says so
    (``outputs_compared`` is False, the verdict names the bundle), and per-output tolerances are
    not checked against output names. ``tolerances`` gives the comparison as one value (the
    tolerance and statistic options are then ignored).

    Raises:
        BundleError: A bundle cannot be read.
        NothingToCompareError: A bundle holds no calls: there is nothing to compare.
        ToleranceError: A statistic is unknown, or a per-output tolerance names no output.
    """
    tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile)
    check_error_stat_name(tolerances.check_error_stat, tolerances.error_quantile)
    begin = time.perf_counter()
    ba, bb = _open(a), _open(b)
    overall: list[str] = []
    sa, sb = ba.manifest.signature, bb.manifest.signature
    if (sa.qualname or sa.method) != (sb.qualname or sb.method):
        overall.append(f"method: {sa.qualname or sa.method} in A, {sb.qualname or sb.method} in B")
    if [p.name for p in sa.parameters] != [p.name for p in sb.parameters]:
        overall.append("signature: the parameters differ")
    if len(ba.calls) != len(bb.calls):
        overall.append(
            f"calls: {len(ba.calls)} in A, {len(bb.calls)} in B (the first {min(len(ba.calls), len(bb.calls))} compared)"
        )
    if not ba.calls or not bb.calls:
        empty = ba.path if not ba.calls else bb.path
        raise NothingToCompareError(f"The bundle '{empty}' holds no calls: there is nothing to compare.")
    redacted = [name for name, bundle in (("A", ba), ("B", bb)) if not _has_outputs(bundle)]
    note = ""
    if redacted:
        note = f"outputs not compared: {' and '.join(redacted)} {'hold' if len(redacted) > 1 else 'holds'} no recorded outputs (redacted)"
    if not redacted:  # before the comparison, not after it
        paired = [ca for ca, cb in zip(ba.calls, bb.calls) if ca.status == cb.status == "ok"]
        refuse_unknown_outputs(tolerances, recorded_output_names(paired))
    rows: list[dict[str, Any]] = []
    checks: list[OutputCheck] = []
    scratch = Scratch()
    n = min(len(ba.calls), len(bb.calls))
    tolerances = tolerances.for_calls(_autocast_side(ca, cb) for ca, cb in zip(ba.calls, bb.calls))
    notify(on_progress, "diff", 0, n)
    for i, (ca, cb) in enumerate(zip(ba.calls, bb.calls)):
        diffs: list[str] = []
        pairs = _call_pairs(ba, bb, ca, cb, diffs, outputs=not redacted)
        own = tolerances.for_call(_autocast_side(ca, cb))  # under torch.autocast: float32 takes its dtype's row
        outs = [p for p in pairs if not p.is_input]
        ins = [p for p in pairs if p.is_input]
        row, call_checks = compare_call(
            [ba.tensor(p.key_a) for p in outs], [bb.tensor(p.key_b) for p in outs], call_index=ca.index,
            names=[p.path or "output" for p in outs], tolerances=own, scratch=scratch,
        )  # fmt: skip
        in_row, in_checks = compare_call(
            [ba.tensor(p.key_a) for p in ins], [bb.tensor(p.key_b) for p in ins], call_index=ca.index,
            names=[p.path for p in ins], tolerances=replace(own, per_output_atol={}, per_output_rtol={}, check_error_stat="max"),
            scratch=scratch,
        )  # fmt: skip
        diffs += [
            f"input {c.name}: max abs difference {c.stats.max_abs:.3g}"
            for c in in_checks
            if c.success is False and c.stats
        ]
        checks.extend(call_checks)
        if diffs:  # the status names what differs: values may be alike (max abs 0) where a dtype is not
            row["error"] = _what_differs(diffs)
        row.update(
            SUCCESS=bool(row["SUCCESS"]) and bool(in_row["SUCCESS"]) and not diffs,
            index=ca.index,
            inputs_abs=in_row["abs"],
            n_differences=len(diffs),
            differences="; ".join(diffs),
            duration_torch=ca.latency,
            duration_other=cb.latency,
        )
        rows.append(row)
        logger.debug("call %d: %d differences", ca.index, len(diffs))
        notify(on_progress, "diff", i + 1, n, f"call {ca.index}")
    if not redacted:
        refuse_unused(tolerances, checks)
    report = DiffReport(
        rows=rows, seconds=time.perf_counter() - begin, outputs=checks, tolerances=tolerances, subject=str(bb.path),
        kind="diff",
        differences=overall, outputs_compared=not redacted, note=note,
    )  # fmt: skip
    return report
