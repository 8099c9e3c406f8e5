"""The reader of the model config a self-contained bundle stores: one size limit, one recursion guard.

The config is untrusted bytes like every member: it is read only when listed with a size under
:data:`MAX_CONFIG_BYTES`, checked against its recorded size and hash, and parsed as JSON with a
too-deep nesting refused. JSON has no token for a non-finite float, so the config writes them as
transformers writes its own config.json: ``Infinity``, ``-Infinity`` and ``NaN``, read back as the
Python floats (this reader has parsed them since format version 1). What the loader then does with it (class names, attention settings) is
the model loader's business; redaction reads the same config for its vocabulary size.
"""

from __future__ import annotations

import json
from typing import Any

from iobundle._store import Store
from iobundle.calls._tensorfile_read import read_member
from iobundle.errors import ModelLoadError, UnsafeBundleError
from iobundle.schema import ModelEntry

__all__ = ["MAX_CONFIG_BYTES", "read_stored_config"]

MAX_CONFIG_BYTES = 16 * 1024**2

# The only bare tokens beyond strict JSON, and the floats they stand for (what json.loads does by default, said here).
_NON_FINITE = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def read_stored_config(store: Store, entry: ModelEntry) -> dict[str, Any]:
    """The JSON object of ``entry.config_file``, read from the bundle member of ``store``.

    ``Infinity``, ``-Infinity`` and ``NaN`` read as ``float("inf")``, ``float("-inf")`` and ``float("nan")``.

    Raises:
        UnsafeBundleError: The config is not listed, is over :data:`MAX_CONFIG_BYTES`, leads outside
            the bundle, or nests too deeply to parse.
        IntegrityError: Its size or hash differs from the manifest.
        ModelLoadError: It is not JSON, or not a JSON object.
    """
    name = entry.config_file
    file = entry.files.get(name)
    if file is None:
        raise UnsafeBundleError(f"model.config_file: {name!r} is not listed in model.files.")
    if file.size > MAX_CONFIG_BYTES:
        raise UnsafeBundleError(
            f"model.files[{name!r}]: {file.size} bytes, over the limit of {MAX_CONFIG_BYTES} bytes for a config."
        )
    data = read_member(store, name, file)
    try:
        config = json.loads(data, parse_constant=_NON_FINITE.__getitem__)
    except RecursionError as exc:
        raise UnsafeBundleError(f"{name}: JSON nested too deeply to read.") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: not a JSON config ({exc}).") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{name}: a config is a JSON object, got {type(config).__name__}.")
    return config
