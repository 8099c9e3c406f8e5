"""What a call's entry says of its tensors: their keys, the entry once some could not be written, and
tensor entries as plain rows (what the writer process answers)."""

from __future__ import annotations

import pickle
from collections.abc import Callable

from iobundle.calls import replace_tensors, tensor_keys
from iobundle.schema import CallEntry, Extension, FileEntry, Node, OpaqueNode, TensorEntry, TensorNode

__all__ = ["TensorRow", "call_keys", "entry_row", "mark_incomplete", "pack_answer", "row_entry", "unpack_answer"]


TensorRow = tuple[str, str, str, str, tuple[int, ...], str, "tuple[str, int] | None", "int | None"]
"""A :class:`TensorEntry` as plain values: ``(key, file, name, dtype, shape, device, (base, dim) or None, offset)``.

What a writer process answers for each tensor it wrote: a tuple crosses a pipe in microseconds,
where a pydantic model takes a hundred times longer to unpickle."""


def entry_row(key: str, entry: TensorEntry) -> TensorRow:
    ext = entry.extends
    return (
        key,
        entry.file,
        entry.name,
        entry.dtype,
        tuple(entry.shape),
        entry.device,
        None if ext is None else (ext.key, ext.dim),
        entry.offset,
    )


def pack_answer(rows: list[TensorRow], files: dict[str, FileEntry]) -> bytes:
    """What a writer process wrote for a call (its rows, the files they name) as one string of bytes.

    The recording process keeps it as it came (bytes: nothing for the cyclic collector) and unpickles it
    when first asked where those tensors are (:func:`unpack_answer`), off the path of the next calls.
    """
    return pickle.dumps((rows, files), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_answer(packed: bytes) -> tuple[list[TensorRow], dict[str, FileEntry]]:
    """The rows and files :func:`pack_answer` packed (from this process's own writer process: trusted)."""
    rows, files = pickle.loads(packed)
    return rows, files


def row_entry(row: TensorRow) -> TensorEntry:
    _, file, name, dtype, shape, device, ext, offset = row
    # values a writer of this bundle made from checked tensors: no validation needed
    return TensorEntry.model_construct(
        file=file,
        name=name,
        dtype=dtype,
        shape=list(shape),
        device=device,
        extends=None if ext is None else Extension.model_construct(key=ext[0], dim=ext[1]),
        offset=offset,
    )


def call_keys(call: CallEntry) -> list[str]:
    """Every tensor key a call refers to: inputs, then outputs and module state."""
    keys = [k for a in call.args for k in tensor_keys(a)]
    keys += [k for v in call.kwargs.values() for k in tensor_keys(v)]
    return keys + [k for tree in (call.outputs, call.state) if tree is not None for k in tensor_keys(tree)]


def mark_incomplete(call: CallEntry, written: Callable[[str], bool], reason: str) -> CallEntry:
    """``call`` with its unwritten tensors replaced by opaque nodes and its status ``incomplete``.

    A failed call (its forward raised) keeps the status ``failed``; the reason is added to its error.
    """

    def strip(node: Node) -> Node:
        return replace_tensors(
            node,
            (
                TensorNode(key=k) if written(k) else OpaqueNode(type="torch.Tensor", reason=f"not written: {reason}")
                for k in tensor_keys(node)
            ),
        )

    return call.model_copy(
        update={
            "status": "failed" if call.status == "failed" else "incomplete",
            "error": f"{call.error}; {reason}" if call.error else reason,
            "args": [strip(a) for a in call.args],
            "kwargs": {k: strip(v) for k, v in call.kwargs.items()},
            "outputs": None if call.outputs is None else strip(call.outputs),
            "state": None if call.state is None else strip(call.state),
        }
    )
