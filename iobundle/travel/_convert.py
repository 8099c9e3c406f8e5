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
field name when they have names, else by index). Each part of a path is escaped (``%XX`` for every
character but letters, digits, ``_`` and ``-``; a dict key ``"a.b"`` is ``a%2Eb``, ``"../x"`` is
``%2E%2E%2Fx``), since dict keys come from the recording: a key never leaves the file or makes one
path out of two. dtypes numpy lacks (bfloat16, float8) are widened to float32. A target ending in ``.npz`` gets every call in one file, keys prefixed ``call_NNNNNN/``.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from iobundle._progress import ProgressCallback, notify
from iobundle._remote import resolve_output
from iobundle.calls import RecordedCalls, call_paths, tensor_keys
from iobundle.errors import BundleExistsError, BundleWriteError, ModelLoadError, ReplayError
from iobundle.replay import RecordedCallsAPI, recorded_calls
from iobundle.replay.check import (
    input_mapping,
    model_label,
    onnx_model_file,
    output_mapping,
    output_paths,
    read_metadata,
)
from iobundle.replay.infer import align_calls, aligned_tensors

__all__ = [
    "ConvertResult",
    "convert_to_npz",
    "convert_to_onnx_testdata",
    "tensor_proto",
]

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


def _refuse_repeated_indices(rc: RecordedCalls) -> None:
    """Files are named after the calls' indices: two calls with one index would write one file twice."""
    seen: set[int] = set()
    for call in rc.calls:
        if call.index in seen:
            raise ReplayError(
                f"Two recorded calls have the index {call.index}; their converted files would collide. "
                "Each call needs its own index (a bundle loaded by iobundle always has that)."
            )
        seen.add(call.index)


def _load_graph(model: str | os.PathLike[str]) -> tuple[list[str], list[str], dict[str, str]]:
    path = onnx_model_file(model)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelLoadError(f"onnx cannot load the model '{path}': {type(exc).__name__}: {exc}") from exc
    initializers = {i.name for i in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    outputs = [o.name for o in proto.graph.output]
    return inputs, outputs, {p.key: p.value for p in proto.metadata_props}


_TESTDATA_DIR = re.compile(r"test_data_set_[0-9]+")
_NPZ_FILE = re.compile(r"call_[0-9]+\.npz")


def _prepare(target: Path, *, overwrite: bool, written: re.Pattern[str]) -> None:
    """Refuse a non-empty ``target`` without ``overwrite``; with it, remove what a previous conversion wrote.

    Only the entries whose names match ``written`` (``test_data_set_N`` folders, ``call_N.npz``
    files) are removed, so a later, smaller conversion leaves no stale call behind; anything else
    (the model beside its test data, notes) stays.
    """
    if not target.exists():
        return
    if not target.is_dir():
        raise BundleExistsError(f"'{target}' exists and is not a directory. Choose another path.")
    if not any(target.iterdir()):
        return
    if not overwrite:
        raise BundleExistsError(f"'{target}' already exists and is not empty. Pass --overwrite or choose another path.")
    try:
        for entry in target.iterdir():
            if written.fullmatch(entry.name):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    except OSError as exc:
        raise BundleWriteError(
            f"Cannot remove the earlier conversion's {exc.filename or target}: {exc.strerror or exc}."
        ) from exc


CONVERT_TASK = "convert"


def convert_to_onnx_testdata(
    calls: RecordedCallsAPI | RecordedCalls,
    model: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> ConvertResult:
    """Write the recorded calls of ``calls`` as ONNX test data for the model ``model`` into the directory ``output``.

    ``calls`` is a ``Bundle`` (``load_bundle(...)``) or an ``InputObserver``. Calls without
    recorded outputs (a redacted bundle) get inputs only. ``on_progress`` is called with a
    :class:`~iobundle.replay.ProgressEvent` (task ``"convert"``) before the first call and after each one.

    Raises:
        ModelLoadError: ``model`` cannot be loaded by onnx.
        ReplayError: The model's inputs do not match the recorded calls, or its outputs the recorded outputs.
        BundleExistsError: ``output`` is not empty and ``overwrite`` is False (with it, the
            ``test_data_set_N`` folders there are removed first; nothing else is).

    Example:
        >>> convert_to_onnx_testdata(load_bundle("run.iobundle"), "model.onnx", "testdata").paths[0]
        PosixPath('testdata/test_data_set_0/input_0.pb')
    """
    rc = recorded_calls(calls, replayed=True)  # module state: inputs and outputs of the graph
    inputs, outputs, meta = _load_graph(model)
    alignment = align_calls(rc)
    metadata = read_metadata(meta, model_label(model), len(alignment.owners))
    if metadata.output_names is not None and metadata.output_names != outputs:
        raise ReplayError(f"{model}: the outputs recorded in its metadata differ from the graph's outputs {outputs}.")
    mapping = input_mapping(inputs, metadata, len(alignment.owners))
    by_name = output_mapping(outputs, metadata, model_label(model))
    target = resolve_output(output, remote=False, what="convert")
    assert isinstance(target, Path)
    _prepare(target, overwrite=overwrite, written=_TESTDATA_DIR)
    written: list[Path] = []
    total = len(alignment.calls)
    notify(on_progress, CONVERT_TASK, 0, total)
    try:
        for i, call in enumerate(alignment.calls):
            directory = target / f"test_data_set_{i}"
            directory.mkdir(parents=True, exist_ok=True)
            tensors = aligned_tensors(rc, alignment, alignment.slots[i])
            for k, (name, slot) in enumerate(mapping):
                written.append(_write_proto(directory / f"input_{k}.pb", tensor_proto(tensors[slot], name)))
            if call.outputs is not None:
                expected = [rc.store.get(key) for key in tensor_keys(call.outputs)]
                if by_name is not None:
                    expected = _by_graph_output(
                        call.index, dict(zip(output_paths(call.outputs), expected)), by_name, outputs, model
                    )
                if len(expected) != len(outputs):
                    raise ReplayError(
                        f"Recorded call {call.index} has {len(expected)} output tensors but {model} has "
                        f"{len(outputs)} outputs ({', '.join(outputs)}). "
                        "Convert with the model exported from this bundle."
                    )
                for k, (name, t) in enumerate(zip(outputs, expected)):
                    written.append(_write_proto(directory / f"output_{k}.pb", tensor_proto(t, name)))
            notify(on_progress, CONVERT_TASK, i + 1, total, f"call {call.index}")
    except OSError as exc:
        raise BundleWriteError(f"Cannot write into {target}: {exc.strerror or exc}.") from exc
    return ConvertResult(paths=written, calls=len(alignment.calls))


def _by_graph_output(
    index: int, recorded: dict[str, Any], by_name: dict[str, str], outputs: list[str], model: object
) -> list[Any]:
    """The recorded outputs of call ``index`` (by name) in the order of the graph ``outputs`` they are mapped to."""
    graph_to_recorded = {graph: name for name, graph in by_name.items()}
    missing = [o for o in outputs if graph_to_recorded.get(o) not in recorded]
    if missing:
        raise ReplayError(
            f"Recorded call {index} has no output for the outputs {', '.join(missing)} of {model} (its recorded "
            f"outputs: {', '.join(recorded)}). Convert with the model exported from this bundle."
        )
    return [recorded[graph_to_recorded[o]] for o in outputs]


def _write_proto(path: Path, proto: onnx.TensorProto) -> Path:
    path.write_bytes(proto.SerializeToString())
    return path


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
    for path, key in call_paths(call):
        if path in arrays:  # escaping makes paths unique; a recording that still repeats one is refused
            raise ReplayError(
                f"Recorded call {call.index}: two tensors have the npz key {path!r}; refusing to keep only one. "
                "Convert to onnx-testdata, or record the call with distinct keys."
            )
        arrays[path] = _numpy(rc.store.get(key))
    return arrays


def _write_npz(archive: zipfile.ZipFile, prefix: str, arrays: dict[str, np.ndarray]) -> None:
    """Add ``arrays`` to an open ``.npz`` file as ``np.savez`` does (one stored ``KEY.npy`` member each).

    ``np.savez`` takes every array at once; this writes one call at a time into the one file.
    """
    for key, array in arrays.items():
        with archive.open(f"{prefix}{key}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)


def convert_to_npz(
    calls: RecordedCallsAPI | RecordedCalls,
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> ConvertResult:
    """Write the tensors of every ok recorded call of ``calls`` (a ``Bundle``, an ``InputObserver``) as ``.npz`` files.

    See the module docstring for the keys.

    One call is read and written at a time, into one file per call or, for a target ending in
    ``.npz``, into that one file. ``on_progress`` is called with a
    :class:`~iobundle.replay.ProgressEvent` (task ``"convert"``) before the first call and after
    each one.

    Raises:
        ReplayError: Two calls have the same index (their files, or members, would collide).
        BundleExistsError: ``output`` exists (a non-empty directory, or the file) and ``overwrite`` is
            False (with it, the ``call_N.npz`` files of a directory are removed first; nothing else is).
        BundleWriteError: ``output`` cannot be written.

    Example:
        >>> convert_to_npz(load_bundle("run.iobundle"), "arrays").paths[0]
        PosixPath('arrays/call_000000.npz')
        >>> sorted(numpy.load("arrays/call_000000.npz"))
        ['args.0', 'outputs']
    """
    rc = recorded_calls(calls)
    _refuse_repeated_indices(rc)
    target = resolve_output(output, remote=False, what="convert")
    assert isinstance(target, Path)
    ok = [i for i, c in enumerate(rc.calls) if c.status == "ok"]
    notify(on_progress, CONVERT_TASK, 0, len(ok))
    try:
        if target.suffix == ".npz":
            if target.is_symlink():  # replacing it would write through the link, wherever it points
                raise BundleExistsError(f"'{target}' is a symbolic link; iobundle never writes through one. Remove it.")
            if target.exists() and not overwrite:
                raise BundleExistsError(f"'{target}' already exists. Pass --overwrite or choose another path.")
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                for done, i in enumerate(ok, start=1):
                    index = rc.calls[i].index
                    _write_npz(archive, f"call_{index:06d}/", _call_arrays(rc, i))
                    notify(on_progress, CONVERT_TASK, done, len(ok), f"call {index}")
            return ConvertResult(paths=[target], calls=len(ok))
        _prepare(target, overwrite=overwrite, written=_NPZ_FILE)
        target.mkdir(parents=True, exist_ok=True)
        paths = []
        for done, i in enumerate(ok, start=1):
            index = rc.calls[i].index
            path = target / f"call_{index:06d}.npz"
            np.savez(path, **_call_arrays(rc, i))  # type: ignore[arg-type]
            paths.append(path)
            notify(on_progress, CONVERT_TASK, done, len(ok), f"call {index}")
    except BundleExistsError:
        raise  # an OSError too, whose message says what to do already
    except OSError as exc:
        raise BundleWriteError(f"Cannot write {target}: {exc.strerror or exc}.") from exc
    return ConvertResult(paths=paths, calls=len(ok))
