"""torch dtypes and their safetensors names, shared by the writer and the reader."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_TO_NAME", "NAME_TO_DTYPE", "dtype_name"]

DTYPE_TO_NAME: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
    torch.complex128: "C128",
}
NAME_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype``, or None if bundles cannot store it."""
    return DTYPE_TO_NAME.get(dtype)
