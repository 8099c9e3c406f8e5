"""Store the observed model in a bundle: a transformers config (JSON) and its weights (safetensors).

A self-contained bundle replays without the model's code being importable by name: the
loader (``iobundle.replay.load_bundle_model``) rebuilds any class transformers registers
in its auto-model mappings, refuses configs that select code, and loads the weights with
safetensors. Only transformers models are stored, since only they can be rebuilt from a
config alone.

Layout::

    run.iobundle/
      model/config.json           config.to_dict(), as JSON (inf, -inf, nan as Infinity, -Infinity, NaN)
      model/weights.safetensors   the state dict, tied weights stored once

The manifest's ``model`` field (:class:`iobundle.schema.ModelEntry`) names the class,
the observed submodule and the two files with their size and hash.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from iobundle._paths import Tree
from iobundle.calls import WRITE_HASH, new_hasher
from iobundle.errors import BundleWriteError, IobundleError, ObserverArgumentError
from iobundle.schema import FileEntry, ModelEntry

__all__ = ["MODEL_CONFIG_FILE", "MODEL_DIR", "MODEL_WEIGHTS_FILE", "check_model", "find_submodule", "write_model"]

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
MODEL_CONFIG_FILE = f"{MODEL_DIR}/config.json"
MODEL_WEIGHTS_FILE = f"{MODEL_DIR}/weights.safetensors"


def _is_transformers_model(model: Any) -> bool:
    if not type(model).__module__.startswith("transformers."):
        return False
    import transformers

    return isinstance(model, transformers.PreTrainedModel)


def find_submodule(root: torch.nn.Module, target: Any) -> str | None:
    """The dotted path of ``target`` inside ``root`` ("" for ``root`` itself), or None if it is not in it."""
    if target is root:
        return ""
    for name, module in root.named_modules(remove_duplicate=False):
        if module is target:
            return name
    return None


def _file_entry(path: Path) -> FileEntry:
    digest = new_hasher(WRITE_HASH)
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(size=size, hash=WRITE_HASH, digest=digest.hexdigest())


def _unstorable(value: Any, path: str) -> tuple[str, Any] | None:
    """The path and value of the first part of ``value`` that JSON cannot hold, or None.

    Dicts (keys str, int, float, bool or None, which JSON writes as strings), lists, tuples
    (read back as lists), str, int, float (inf, -inf and nan included) and None are stored.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{path} (key {key!r})", key
            found = _unstorable(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _unstorable(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if value is None or isinstance(value, (str, int, float)):
        return None
    return path, value


def _config_json(model: Any) -> str:
    """``model.config.to_dict()`` as JSON; a non-finite float is written ``Infinity``, ``-Infinity`` or ``NaN``.

    Those three tokens are what transformers writes in its own config.json, and what the bundle's
    config reader (:func:`iobundle.calls.read_stored_config`) has parsed since format version 1
    (docs/format.md, "Stored model").
    """
    config = model.config.to_dict()
    # Settings the loader passes itself, and a remote-code hint that must never be followed.
    for key in ("_attn_implementation_autoset", "auto_map"):
        config.pop(key, None)
    found = _unstorable(config, "")
    if found is not None:
        field, value = found
        raise ObserverArgumentError(
            f"{type(model).__name__}.config.{field} is a {type(value).__module__}.{type(value).__qualname__} "
            f"({value!r}), which a bundle's JSON config cannot hold. Set it to a number, string, list or dict "
            "before saving, or save without include_model and rebuild the model yourself when replaying."
        )
    return json.dumps(config, indent=1, sort_keys=True, allow_nan=True)


def check_model(model: Any, observed: Any | None = None) -> tuple[str, str]:
    """Check that ``model`` can be stored, before anything of the bundle is written; return its path and config.

    Args:
        model: A transformers model (a ``PreTrainedModel`` subclass defined by transformers).
        observed: The object whose method was observed, when it is a submodule of ``model``
            (its path is recorded so that the loader hands it back); None for ``model`` itself.

    Raises:
        ObserverArgumentError: ``model`` is not a transformers model, ``observed`` is not inside it, or
            a config value is not a JSON value (the error names its field).
    """
    if not _is_transformers_model(model):
        raise ObserverArgumentError(
            f"include_model stores transformers models only (a config rebuilds them); got a "
            f"{type(model).__module__}.{type(model).__qualname__}. Pass the transformers model that holds the "
            "observed module (include_model=model), or save without include_model."
        )
    submodule = "" if observed is None else find_submodule(model, observed)
    if submodule is None:
        raise ObserverArgumentError(
            f"The observed {type(observed).__name__} is not a submodule of the {type(model).__name__} given "
            "as include_model. Pass the model that holds it."
        )
    return submodule, _config_json(model)


def write_model(bundle_dir: str | os.PathLike[str], model: torch.nn.Module, observed: Any | None = None) -> ModelEntry:
    """Write ``model``'s config and weights under ``bundle_dir/model/`` (removed on failure); return the manifest entry.

    Raises:
        ObserverArgumentError: See :func:`check_model`.
        BundleWriteError: The files cannot be written.
    """
    from safetensors.torch import save_model

    submodule, config_text = check_model(model, observed)
    root = Path(bundle_dir)
    directory = root / MODEL_DIR
    try:
        with Tree(
            root, error=BundleWriteError
        ) as tree:  # model/ and its files are never links: no write goes through one
            tree.folder((MODEL_DIR,), create=True)
            for name in (MODEL_CONFIG_FILE, MODEL_WEIGHTS_FILE):
                tree.unlink(name, missing_ok=True)
        (root / MODEL_CONFIG_FILE).write_text(config_text + "\n", encoding="utf-8")
        # save_model stores tied weights once (the loader ties them again) and copies
        # non-contiguous tensors; the metadata says what wrote the file.
        save_model(model, str(root / MODEL_WEIGHTS_FILE), metadata={"format": "pt", "producer": "iobundle"})
        files = {name: _file_entry(root / name) for name in (MODEL_CONFIG_FILE, MODEL_WEIGHTS_FILE)}
    except BaseException as exc:
        with contextlib.suppress(OSError, IobundleError), Tree(root, error=BundleWriteError) as tree:
            for name in (MODEL_CONFIG_FILE, MODEL_WEIGHTS_FILE):
                tree.unlink(name, missing_ok=True)
            tree.rmdir((MODEL_DIR,))
        if isinstance(exc, OSError) and not isinstance(exc, IobundleError):
            raise BundleWriteError(
                f"Cannot write the model into '{directory}': {exc.strerror or exc}. Check free space and permissions."
            ) from exc
        raise
    entry = ModelEntry(
        class_name=type(model).__name__,
        config_file=MODEL_CONFIG_FILE,
        weights_file=MODEL_WEIGHTS_FILE,
        submodule=submodule,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        files=files,
    )
    logger.info("stored %s (%s) in %s", entry.class_name, submodule or "observed itself", directory)
    return entry
