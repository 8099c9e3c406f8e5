"""Write standard safetensors files, hashing the bytes while they are written."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from iobundle._atomic import write_atomically
from iobundle.capture._dtypes import dtype_name
from iobundle.errors import UnsupportedInputError
from iobundle.schema import FileEntry

__all__ = ["tensor_bytes", "write_tensor_file"]

_ALIGN = 8


def _unsupported_kind(tensor: torch.Tensor) -> str | None:
    if tensor.is_nested:
        return "nested"
    if tensor.layout != torch.strided:
        return str(tensor.layout).removeprefix("torch.")
    if tensor.is_quantized:
        return "quantized"
    if tensor.device.type == "meta":
        return "meta"
    return None


def tensor_bytes(tensor: torch.Tensor, *, name: str = "tensor") -> memoryview:
    """The raw little-endian bytes of ``tensor`` (copied to CPU and made contiguous if needed).

    Lazy conjugate and negative views are materialised, so the bytes are the values the
    tensor shows, not those of the storage it views.

    Raises:
        UnsupportedInputError: The tensor has no plain dense CPU-copyable data (sparse, nested,
            quantized or meta tensors, tensor subclasses that refuse the copy).
    """
    kind = _unsupported_kind(tensor)
    if kind is not None:
        raise UnsupportedInputError(
            f"Tensor {name!r} is a {kind} tensor, which a bundle cannot store (it holds no plain dense data). "
            "Pass a dense tensor (e.g. .to_dense()) or remove the input with remove_inputs()."
        )
    try:
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
        if t.numel() == 0:
            return memoryview(b"")
        return t.view(torch.uint8).numpy().data.cast("B")
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        raise UnsupportedInputError(
            f"Tensor {name!r} ({type(tensor).__name__}, {tensor.dtype}) cannot be copied to plain CPU bytes: {exc}"
        ) from exc


def write_tensor_file(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    *,
    durable: bool = True,
    on_written: Callable[[str], None] | None = None,
) -> FileEntry:
    """Write ``tensors`` to ``path`` as a safetensors file and return its size and sha256.

    The file is written to a temporary name and renamed once complete, so a file with the final
    name is always complete. The sha256 is computed while the bytes are written (by a helper
    thread for large files, see :func:`iobundle._atomic.write_atomically`).

    Args:
        path: The file to write.
        tensors: The tensors, by name.
        durable: fsync the file and its directory (see :func:`iobundle._atomic.write_atomically`).
        on_written: Called with each tensor's name once its bytes are written and hashed: the
            memory it holds may be reused from then on, before the file is complete.

    Raises:
        UnsupportedInputError: A tensor has a dtype that safetensors cannot hold.
        BundleWriteError: The file cannot be written.
    """
    path = Path(path)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    payloads = []
    names = []
    offset = 0
    # Largest items first: every tensor then starts at a multiple of its item size, with no gaps.
    for name, tensor in sorted(tensors.items(), key=lambda kv: -kv[1].dtype.itemsize):
        dname = dtype_name(tensor.dtype)
        if dname is None:
            raise UnsupportedInputError(f"Tensor {name!r} has dtype {tensor.dtype}, which a bundle cannot store.")
        data = tensor_bytes(tensor, name=name)
        header[name] = {"dtype": dname, "shape": list(tensor.shape), "data_offsets": [offset, offset + data.nbytes]}
        payloads.append(data)
        names.append(name)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)
    digest = hashlib.sha256()

    def part_done(index: int) -> None:
        if index and on_written is not None:
            on_written(names[index - 1])  # part 0 is the header

    size = write_atomically(
        path,
        [struct.pack("<Q", len(text)) + text, *payloads],
        on_chunk=digest.update,
        on_part=part_done if on_written is not None else None,
        durable=durable,
    )
    return FileEntry(size=size, sha256=digest.hexdigest())
