"""Convert a bundle's recorded calls to other tools' formats: ONNX test data, numpy ``.npz`` files.

**ONNX test data** (``convert_to_onnx_testdata``) is the layout of the ONNX backend tests, which
``onnx_test_runner`` (onnxruntime) and ONNX backends read: one ``test_data_set_N`` directory per
recorded call, holding ``input_K.pb`` per graph input and ``output_K.pb`` per graph output, each a
serialized ``TensorProto`` named after the graph's input or output. Recorded tensors are mapped to
graph inputs exactly as ``iobundle validate`` maps them (through the metadata ``iobundle export``
writes, else by position), absent inputs are given the same stand-ins, and outputs are the recorded
ones in the graph's output order.

**npz** (``convert_to_npz``): one ``call_NNNNNN.npz`` per recorded call (the call's index), whose keys
are the paths of the tensors in the call: ``args.0``, ``kwargs.input_ids``,
``kwargs.past_key_values.3``, ``outputs.logits`` (containers by index or key, registered classes by
field name when they have names, else by index). dtypes numpy lacks (bfloat16, float8) are widened
to float32. A target ending in ``.npz`` gets every call in one file, keys prefixed ``call_NNNNNN/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from iobundle.calls import RecordedCalls, tensor_keys
from iobundle.errors import BundleExistsError, BundleWriteError, ModelLoadError, ReplayError
from iobundle.replay._inference import align_calls, aligned_tensors
from iobundle.replay._validate import input_mapping, model_label, read_metadata
from iobundle.schema import DictNode, ListNode, Node, ObjectNode, TensorNode, TupleNode

__all__ = ["ConvertResult", "convert_to_npz", "convert_to_onnx_testdata", "tensor_paths", "tensor_proto"]

_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.int16: onnx.TensorProto.INT16,
    torch.int32: onnx.TensorProto.INT32,
    torch.int64: onnx.TensorProto.INT64,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.uint16: onnx.TensorProto.UINT16,
    torch.uint32: onnx.TensorProto.UINT32,
    torch.uint64: onnx.TensorProto.UINT64,
    torch.bool: onnx.TensorProto.BOOL,
    torch.complex64: onnx.TensorProto.COMPLEX64,
    torch.complex128: onnx.TensorProto.COMPLEX128,
    torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN,
    torch.float8_e5m2: onnx.TensorProto.FLOAT8E5M2,
    torch.float8_e4m3fnuz: onnx.TensorProto.FLOAT8E4M3FNUZ,
    torch.float8_e5m2fnuz: onnx.TensorProto.FLOAT8E5M2FNUZ,
}


@dataclass
class ConvertResult:
    """What a conversion wrote: the files, and the number of calls."""

    paths: list[Path]
    calls: int


def tensor_proto(tensor: torch.Tensor, name: str) -> onnx.TensorProto:
    """``tensor`` as an ONNX ``TensorProto`` named ``name`` (raw little-endian data, every dtype ONNX has).

    Raises:
        ReplayError: ONNX has no element type for the tensor's dtype.
    """
    elem = _ONNX_TYPES.get(tensor.dtype)
    if elem is None:
        raise ReplayError(f"Tensor {name!r} has dtype {tensor.dtype}, which ONNX test data cannot hold.")
    t = tensor.detach().cpu().contiguous()
    proto = onnx.TensorProto()
    proto.name = name
    proto.data_type = elem
    proto.dims.extend(t.shape)
    proto.raw_data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return proto


def _load_graph(model: str | os.PathLike[str]) -> tuple[list[str], list[str], dict[str, str]]:
    path = Path(model)
    if not path.is_file():
        raise ModelLoadError(f"ONNX model '{path}' does not exist.")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelLoadError(f"onnx cannot load the model '{path}': {type(exc).__name__}: {exc}") from exc
    initializers = {i.name for i in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    outputs = [o.name for o in proto.graph.output]
    return inputs, outputs, {p.key: p.value for p in proto.metadata_props}


def _prepare(target: Path, *, overwrite: bool) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise BundleExistsError(f"'{target}' already exists and is not empty. Pass --overwrite or choose another path.")


def convert_to_onnx_testdata(
    rc: RecordedCalls, model: str | os.PathLike[str], output: str | os.PathLike[str], *, overwrite: bool = False
) -> ConvertResult:
    """Write the recorded calls as ONNX test data for the model ``model`` into the directory ``output``.

    Calls without recorded outputs (a redacted bundle) get inputs only.

    Raises:
        ModelLoadError: ``model`` cannot be loaded by onnx.
        ReplayError: The model's inputs do not match the recorded calls, or its outputs the recorded outputs.
        BundleExistsError: ``output`` is not empty and ``overwrite`` is False.

    Example:
        >>> convert_to_onnx_testdata(bundle._recorded(), "model.onnx", "testdata").paths[0]
        PosixPath('testdata/test_data_set_0/input_0.pb')
    """
    inputs, outputs, meta = _load_graph(model)
    alignment = align_calls(rc)
    metadata = read_metadata(meta, model_label(model), len(alignment.owners))
    if metadata.output_names is not None and metadata.output_names != outputs:
        raise ReplayError(f"{model}: the outputs recorded in its metadata differ from the graph's outputs {outputs}.")
    mapping = input_mapping(inputs, metadata, len(alignment.owners))
    target = Path(output)
    _prepare(target, overwrite=overwrite)
    written: list[Path] = []
    try:
        for i, call in enumerate(alignment.calls):
            directory = target / f"test_data_set_{i}"
            directory.mkdir(parents=True, exist_ok=True)
            tensors = aligned_tensors(rc, alignment, alignment.slots[i])
            for k, (name, slot) in enumerate(mapping):
                written.append(_write_proto(directory / f"input_{k}.pb", tensor_proto(tensors[slot], name)))
            if call.outputs is None:
                continue
            expected = [rc.store.get(key) for key in tensor_keys(call.outputs)]
            if len(expected) != len(outputs):
                raise ReplayError(
                    f"Recorded call {call.index} has {len(expected)} output tensors but {model} has "
                    f"{len(outputs)} outputs ({', '.join(outputs)}). Convert with the model exported from this bundle."
                )
            for k, (name, t) in enumerate(zip(outputs, expected)):
                written.append(_write_proto(directory / f"output_{k}.pb", tensor_proto(t, name)))
    except OSError as exc:
        raise BundleWriteError(f"Cannot write into {target}: {exc.strerror or exc}.") from exc
    return ConvertResult(paths=written, calls=len(alignment.calls))


def _write_proto(path: Path, proto: onnx.TensorProto) -> Path:
    path.write_bytes(proto.SerializeToString())
    return path


def tensor_paths(node: Node | None, prefix: str) -> Iterator[tuple[str, str]]:
    """``(path, key)`` of every tensor of ``node``, in flattening order; see the module docstring."""
    if node is None:
        return
    if isinstance(node, TensorNode):
        yield prefix, node.key
    elif isinstance(node, (ListNode, TupleNode)):
        for i, item in enumerate(node.items):
            yield from tensor_paths(item, f"{prefix}.{i}")
    elif isinstance(node, DictNode):
        for key, item in zip(node.keys, node.items):
            yield from tensor_paths(item, f"{prefix}.{key}")
    elif isinstance(node, ObjectNode):
        context: Any = node.context
        names = (
            context
            if isinstance(context, list)
            and len(context) == len(node.items)
            and all(isinstance(c, str) for c in context)
            else range(len(node.items))
        )
        for name, item in zip(names, node.items):
            yield from tensor_paths(item, f"{prefix}.{name}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    ):
        t = t.float()
    return t.contiguous().numpy()


def _call_arrays(rc: RecordedCalls, index: int) -> dict[str, np.ndarray]:
    call = rc.calls[index]
    arrays: dict[str, np.ndarray] = {}
    pairs = [p for j, a in enumerate(call.args) for p in tensor_paths(a, f"args.{j}")]
    pairs += [p for k, v in call.kwargs.items() for p in tensor_paths(v, f"kwargs.{k}")]
    pairs += list(tensor_paths(call.outputs, "outputs"))
    for path, key in pairs:
        arrays[path] = _numpy(rc.store.get(key))
    return arrays


def convert_to_npz(rc: RecordedCalls, output: str | os.PathLike[str], *, overwrite: bool = False) -> ConvertResult:
    """Write the tensors of every ok recorded call as numpy ``.npz`` files; see the module docstring.

    Raises:
        BundleExistsError: ``output`` exists (a non-empty directory, or the file) and ``overwrite`` is False.
        BundleWriteError: ``output`` cannot be written.

    Example:
        >>> convert_to_npz(bundle._recorded(), "arrays").paths[0]
        PosixPath('arrays/call_000000.npz')
        >>> sorted(numpy.load("arrays/call_000000.npz"))
        ['args.0', 'outputs']
    """
    target = Path(output)
    ok = [i for i, c in enumerate(rc.calls) if c.status == "ok"]
    try:
        if target.suffix == ".npz":
            if target.exists() and not overwrite:
                raise BundleExistsError(f"'{target}' already exists. Pass --overwrite or choose another path.")
            arrays = {f"call_{rc.calls[i].index:06d}/{path}": a for i in ok for path, a in _call_arrays(rc, i).items()}
            target.parent.mkdir(parents=True, exist_ok=True)
            np.savez(target, **arrays)  # type: ignore[arg-type]
            return ConvertResult(paths=[target], calls=len(ok))
        _prepare(target, overwrite=overwrite)
        target.mkdir(parents=True, exist_ok=True)
        paths = []
        for i in ok:
            path = target / f"call_{rc.calls[i].index:06d}.npz"
            np.savez(path, **_call_arrays(rc, i))  # type: ignore[arg-type]
            paths.append(path)
    except OSError as exc:
        raise BundleWriteError(f"Cannot write {target}: {exc.strerror or exc}.") from exc
    return ConvertResult(paths=paths, calls=len(ok))
