"""Turn the arguments of one call into a :class:`CallEntry` (the inputs half of a recorded call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from iobundle.calls._calls import RecordedCalls, positional_names
from iobundle.calls._tree import TensorCollector, record_value
from iobundle.schema import AutocastEntry, CallEntry, Node, NoneNode, SignatureEntry

__all__ = ["record_inputs", "split_kwargs"]

_SCALARS = (bool, int, float, str)


_FACTS: dict[int, tuple[SignatureEntry, dict[str, Any], dict[str, int]]] = {}


def _signature_facts(rc: RecordedCalls) -> tuple[dict[str, Any], dict[str, int]]:
    """The scalar defaults of ``rc``'s signature and each parameter's rank: made once per signature, not per call."""
    signature = rc.signature
    facts = _FACTS.get(id(signature))
    if facts is None or facts[0] is not signature:
        if len(_FACTS) >= 64:
            _FACTS.clear()
        facts = _FACTS[id(signature)] = (signature, rc.scalar_defaults, {n: i for i, n in enumerate(rc.names)})
    return facts[1], facts[2]


def split_kwargs(rc: RecordedCalls, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into constants and recorded inputs, in signature order.

    A scalar (bool, int, float, str) equal to its parameter's default is dropped; any other
    scalar is a constant of the call, even when the default is None (``use_cache=True``).
    ``None`` means absent and is dropped. Everything else is an input.
    """
    defaults, order = _signature_facts(rc)
    cst: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for k, v in kwargs.items():
        if v is None:
            continue
        if isinstance(v, _SCALARS):
            if k in defaults and type(defaults[k]) is type(v) and defaults[k] == v:
                continue
            cst[k] = v
        else:
            kept[k] = v
    rank = len(order)
    return (
        dict(sorted(cst.items(), key=lambda kv: order.get(kv[0], rank))),
        dict(sorted(kept.items(), key=lambda kv: order.get(kv[0], rank))),
    )


def record_inputs(
    rc: RecordedCalls,
    collector: TensorCollector,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    index: int,
    on_opaque: Callable[[str, str, str], None],
    autocast: list[AutocastEntry] | None = None,
) -> CallEntry:
    """Record the inputs of one call, filling absent arguments from ``rc.value_if_missing``.

    ``autocast`` is the ``torch.autocast`` state the call runs under (:func:`~iobundle.calls.autocast_state`).
    """
    cst, kept = split_kwargs(rc, kwargs)
    arg_nodes: list[Node] = [
        record_value(a, collector, path=f"args[{i}]", on_opaque=on_opaque) for i, a in enumerate(args)
    ]
    kw_nodes: dict[str, Node] = {k: record_value(v, collector, path=k, on_opaque=on_opaque) for k, v in kept.items()}
    filled: list[str | int] = []
    pos = list(positional_names(rc.signature)) if rc.value_if_missing else []
    for entry in rc.value_if_missing:
        key = entry.key
        if isinstance(key, str):
            i = pos.index(key) if key in pos else None
            passed_positionally = i is not None and i < len(arg_nodes) and not isinstance(arg_nodes[i], NoneNode)
            if key in kw_nodes or passed_positionally:
                continue
            if i is not None and i < len(arg_nodes):
                arg_nodes[i] = entry.value
            else:
                kw_nodes[key] = entry.value
        else:
            if key < len(arg_nodes) and not isinstance(arg_nodes[key], NoneNode):
                continue
            if key < len(pos) and pos[key] in kw_nodes:
                continue
            arg_nodes.extend(NoneNode() for _ in range(len(arg_nodes), key + 1))
            arg_nodes[key] = entry.value
        filled.append(key)
    if filled:
        order = {n: i for i, n in enumerate(rc.names)}
        kw_nodes = dict(sorted(kw_nodes.items(), key=lambda kv: order.get(kv[0], len(order))))
    return CallEntry(index=index, args=arg_nodes, kwargs=kw_nodes, cst_kwargs=cst, filled=filled, autocast=autocast)
