"""Bundles leaving the machine: pack into one file and unpack, convert to other formats, redact. On top of replay's public face.

The names below are imported when first used: packing and unpacking read and write files only,
and load neither torch nor onnx; converting and redacting do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iobundle._lazy import lazy_names

__all__ = [
    # Convert
    "ConvertResult",
    "convert_to_npz",
    "convert_to_onnx_testdata",
    # Pack and unpack
    "PackResult",
    "pack_bundle",
    "unpack_bundle",
    # Redact
    "copy_model_files",
    "redact_calls",
]

if TYPE_CHECKING:
    from iobundle.travel._convert import ConvertResult, convert_to_npz, convert_to_onnx_testdata
    from iobundle.travel._pack import PackResult, pack_bundle, unpack_bundle
    from iobundle.travel._redact import copy_model_files, redact_calls

__getattr__ = lazy_names(__name__)
