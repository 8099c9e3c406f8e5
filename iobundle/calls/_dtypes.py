"""torch dtypes and their safetensors names, shared by the writer and the reader.

The names are plain data, and their sizes are schema's (:data:`iobundle.schema.DTYPE_ITEMSIZES`:
reading a manifest or checking a file's size needs no torch); the tables of torch dtypes are
built, importing torch, the first time one is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import LazyMapping

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_TO_NAME", "FLOATING_NAMES", "NAME_TO_DTYPE", "dtype_name"]

_DTYPES = (  # the torch dtype's name, its safetensors name (one of schema's DTYPE_ITEMSIZES)
    ("bool", "BOOL"),
    ("uint8", "U8"),
    ("int8", "I8"),
    ("int16", "I16"),
    ("uint16", "U16"),
    ("int32", "I32"),
    ("uint32", "U32"),
    ("int64", "I64"),
    ("uint64", "U64"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("float32", "F32"),
    ("float64", "F64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("complex64", "C64"),
    ("complex128", "C128"),
)

FLOATING_NAMES: frozenset[str] = frozenset(name for attr, name in _DTYPES if "float" in attr)
"""The safetensors names of the dtypes torch calls floating point (``dtype.is_floating_point``)."""


def _dtype_to_name() -> dict[torch.dtype, str]:
    import torch

    return {getattr(torch, attr): name for attr, name in _DTYPES}


DTYPE_TO_NAME: LazyMapping[torch.dtype, str] = LazyMapping(_dtype_to_name)
NAME_TO_DTYPE: LazyMapping[str, torch.dtype] = LazyMapping(lambda: {v: k for k, v in DTYPE_TO_NAME.items()})


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype``, or None if bundles cannot store it."""
    return DTYPE_TO_NAME.get(dtype)
