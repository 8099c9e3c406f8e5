"""Store the observed model in a bundle: a transformers or diffusers config (JSON) and its weights (safetensors).

A self-contained bundle replays without the model's code being importable by name: the
loader (``iobundle.replay.load_bundle_model``) rebuilds any class transformers registers
in its auto-model mappings (or any ``diffusers.ModelMixin`` of the diffusers package), refuses configs
that select code, and loads the weights with safetensors. Only transformers and diffusers models are
stored, since only they can be rebuilt from a config alone; one wrapped by ``torch.compile`` or peft is stored as the model it runs (peft
adapters merged, on a copy of each layer), and quantized weights are refused.

Layout::

    run.iobundle/
      model/config.json           config.to_dict(), as JSON (inf, -inf, nan as Infinity, -Infinity, NaN)
      model/weights.safetensors   the state dict under the class's own names, tied weights stored once

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
from iobundle.schema import FileEntry, MergedAdapter, ModelEntry

__all__ = ["MODEL_CONFIG_FILE", "MODEL_DIR", "MODEL_WEIGHTS_FILE", "check_model", "write_model"]

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
MODEL_CONFIG_FILE = f"{MODEL_DIR}/config.json"
MODEL_WEIGHTS_FILE = f"{MODEL_DIR}/weights.safetensors"


def _library(model: Any) -> str | None:
    """The library whose config rebuilds ``model`` (``"transformers"``, ``"diffusers"``), or None."""
    library = type(model).__module__.partition(".")[0]
    if library == "transformers":
        import transformers

        return library if isinstance(model, transformers.PreTrainedModel) else None
    if library == "diffusers":
        import diffusers

        return library if isinstance(model, diffusers.ModelMixin) else None
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
    A diffusers config (a FrozenDict) is stored as its public keys; ``_class_name`` is the manifest's class.
    """
    if _library(model) == "diffusers":
        config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    else:
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


def _inner(module: Any, *, runs: bool) -> Any:
    """The module inside torch.compile's and peft's wrappers, whose weights a bundle stores under its own names.

    ``runs``: the wrapper's own method is the observed one; a prompt-learning PeftModel then adds
    virtual tokens that its base model alone does not, and is refused.
    """
    while True:
        origin = type(module).__module__
        if origin.startswith("torch._dynamo") and isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
            module = module._orig_mod  # torch.compile's OptimizedModule
        elif origin.startswith("peft.") and callable(getattr(module, "get_base_model", None)):  # a PeftModel
            config: Any = getattr(module, "active_peft_config", None)
            if runs and getattr(config, "is_prompt_learning", False):
                raise ObserverArgumentError(
                    f"include_model cannot store a {type(module).__name__} of {config.peft_type}: its virtual "
                    "tokens are not weights of the model it wraps. Observe the base model "
                    "(model.get_base_model()), whose calls receive them, or save without include_model."
                )
            module = module.get_base_model()
        elif origin.startswith("peft.") and isinstance(getattr(module, "model", None), torch.nn.Module):
            module = module.model  # a peft tuner (LoraModel)
        else:
            return module


def _adapter_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The outermost peft modules of ``model`` (LoRA layers, trained copies of modules), by path."""
    found: dict[str, torch.nn.Module] = {}
    for path, module in model.named_modules():
        if type(module).__module__.startswith("peft.") and not any(path.startswith(f"{p}.") for p in found):
            found[path] = module
    return found


def _quantized(model: torch.nn.Module) -> str | None:
    """What makes ``model``'s weights quantized (a config, a module, a tensor), or None."""
    config = getattr(model, "config", None)
    if getattr(config, "quantization_config", None) is not None or getattr(model, "is_quantized", False):
        return f"{type(model).__name__}.config.quantization_config"
    for path, module in model.named_modules():
        if type(module).__module__.startswith(("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic")):
            return f"{path} ({type(module).__module__}.{type(module).__qualname__})"
    for path, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_quantized or type(tensor.data) is not torch.Tensor:
            return f"{path} ({type(tensor.data).__qualname__} of {tensor.dtype})"
    return None


def check_model(model: Any, observed: Any | None = None) -> tuple[str, str]:
    """Check that ``model`` can be stored, before anything of the bundle is written; return its path and config.

    Args:
        model: A transformers model (a ``PreTrainedModel`` subclass defined by transformers), or one
            wrapped by ``torch.compile`` or peft (its weights are stored without the wrapper, adapters merged).
        observed: The object whose method was observed, when it is a submodule of ``model``
            (its path is recorded so that the loader hands it back); None for ``model`` itself.

    Raises:
        ObserverArgumentError: ``model`` is not a transformers model, ``observed`` is not inside it, its
            weights are quantized, it holds peft modules that cannot be merged, or a config value is not
            a JSON value (the error names its field).
    """
    model = _inner(model, runs=observed is None or observed is model)
    observed = None if observed is None else _inner(observed, runs=True)
    if _library(model) is None:
        raise ObserverArgumentError(
            f"include_model stores transformers and diffusers models only (a config rebuilds them); got a "
            f"{type(model).__module__}.{type(model).__qualname__}. Pass the transformers model that holds the "
            "observed module (include_model=model), or save without include_model."
        )
    paths = [".".join(p for p in n.split(".") if p != "_orig_mod") for n, m in model.named_modules() if m is observed]
    submodule = "" if observed is None else next(iter(paths), None)  # a compiled one named without _orig_mod
    if submodule is None:
        raise ObserverArgumentError(
            f"The observed {type(observed).__name__} is not a submodule of the {type(model).__name__} given "
            "as include_model. Pass the model that holds it."
        )
    quantized = _quantized(model)
    if quantized is not None:
        raise ObserverArgumentError(
            f"include_model cannot store the quantized weights of {type(model).__name__} ({quantized}): its "
            "class rebuilt from the config would not run them. Save a dequantized model (or one never "
            "quantized) with include_model, or save without include_model and rebuild the model yourself."
        )
    adapters = _adapter_layers(model)
    for path, layer in adapters.items():
        inside = submodule == path or submodule.startswith(f"{path}.")
        if inside or not (hasattr(layer, "unload_and_optionally_merge_module") or hasattr(layer, "base_layer")):
            raise _unmergeable(layer, path, model, " (the observed module is part of it)" if inside else "")
    differs = None if adapters or _library(model) != "transformers" else _rebuilt_differs(model)
    if differs is not None:
        raise ObserverArgumentError(
            f"include_model cannot store this {type(model).__name__}: the one its config builds differs ({differs}). "
            "It was built with arguments its config does not hold (such as add_pooling_layer=False), so the loader "
            "could not rebuild it. Save without include_model and rebuild the model yourself (--model MODULE:FACTORY)."
        )
    return submodule, _config_json(model)


def _rebuilt_differs(model: Any) -> str | None:
    """How the weights of ``model``'s class built from its config (on the meta device: nothing allocated) differ
    from ``model``'s own, names and shapes; None when they agree, or when it cannot be built so (the loader says)."""
    import copy

    try:
        with torch.device("meta"):
            rebuilt = type(model)._from_config(copy.deepcopy(model.config))
    except Exception:
        return None
    # stored as the weights are: without the _orig_mod. of a compiled submodule
    own = {".".join(p for p in k.split(".") if p != "_orig_mod"): tuple(v.shape) for k, v in model.state_dict().items()}
    built = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    missing, extra = sorted(built.keys() - own.keys()), sorted(own.keys() - built.keys())
    shaped = sorted(k for k in own.keys() & built.keys() if own[k] != built[k])

    def listed(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = [
        template.format(listed(names))
        for template, names in (
            ("it has {} that this one lacks", missing),
            ("it lacks {} that this one has", extra),
            ("{} differ in shape", shaped),
        )
        if names
    ]
    return "; ".join(parts) or None


def _unmergeable(layer: Any, path: str, model: Any, why: str) -> ObserverArgumentError:
    return ObserverArgumentError(
        f"include_model cannot merge the peft {type(layer).__name__} at {path or 'the top'} into "
        f"{type(model).__name__}'s weights{why}. Call merge_and_unload() on the model first, or save without "
        "include_model."
    )


def _merged_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[MergedAdapter]]:
    """``model``'s weights under its class's own names: peft adapters merged (on a copy of each layer), no
    ``_orig_mod.`` of torch.compile; and the adapters merged. ``model`` itself is left as it is."""
    import copy

    state = model.state_dict()
    adapters: dict[tuple[str, str], set[int]] = {}
    for path, layer in _adapter_layers(model).items():
        copied: Any = copy.deepcopy(layer)  # one layer at a time; the merged weights replace its own below
        active = [] if getattr(copied, "disable_adapters", False) else list(getattr(copied, "active_adapters", []))
        try:
            with torch.no_grad():
                if hasattr(copied, "unload_and_optionally_merge_module"):
                    merged = copied.unload_and_optionally_merge_module(
                        merge=bool(active), safe_merge=False, adapter_names=None
                    )
                else:
                    if active:
                        copied.merge()
                    elif getattr(copied, "merged", False):
                        copied.unmerge()  # what a layer with disabled adapters runs
                    merged = copied.get_base_layer()
        except Exception as exc:  # a peft method that cannot merge
            raise _unmergeable(layer, path, model, f": {type(exc).__name__}: {exc}") from exc
        prefix = f"{path}."
        replaced = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
        shared = {t.untyped_storage().data_ptr() for t in replaced.values() if t.numel()}
        tied = [k for k, t in state.items() if t.numel() and t.untyped_storage().data_ptr() in shared]
        if tied:
            raise _unmergeable(
                layer, path, model, f": its weight is tied to {tied[0]}, which the adapter does not change"
            )
        state.update({prefix + k: v for k, v in merged.state_dict().items()})
        origin = type(layer).__module__.split(".")
        method = origin[2] if origin[1] == "tuners" else type(layer).__name__  # peft.tuners.lora.layer: lora
        ranks = getattr(layer, "r", None)  # LoRA's, per adapter
        for name in active:
            rank = ranks.get(name) if isinstance(ranks, dict) else None
            adapters.setdefault((name, method), set()).update([rank] if isinstance(rank, int) else [])
    weights = {".".join(p for p in k.split(".") if p != "_orig_mod"): v for k, v in state.items()}
    merged_adapters = [MergedAdapter(name=n, method=m, ranks=sorted(r)) for (n, m), r in sorted(adapters.items())]
    return weights, merged_adapters


def _save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``weights`` as safetensors; a tied weight is stored once, under its first name (as safetensors'
    ``save_model`` does; the loader ties them again), and the metadata says what wrote the file."""
    from safetensors.torch import save_file

    metadata, kept = {"format": "pt", "producer": "iobundle"}, dict[int, str]()
    for key in sorted(weights):
        tensor = weights[key]
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage is not None and storage in kept:
            metadata[key] = kept[storage]
            del weights[key]
        elif storage is not None:
            kept[storage] = key
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata=metadata)


def write_model(bundle_dir: str | os.PathLike[str], model: torch.nn.Module, observed: Any | None = None) -> ModelEntry:
    """Write ``model``'s config and weights under ``bundle_dir/model/`` (removed on failure); return the manifest entry.

    Raises:
        ObserverArgumentError: See :func:`check_model`.
        BundleWriteError: The files cannot be written.
    """
    submodule, config_text = check_model(model, observed)
    model = _inner(model, runs=False)
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
        weights, adapters = _merged_weights(model)
        _save_weights(weights, root / MODEL_WEIGHTS_FILE)
        del weights
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
        library="diffusers" if _library(model) == "diffusers" else "transformers",
        class_name=type(model).__name__,
        config_file=MODEL_CONFIG_FILE,
        weights_file=MODEL_WEIGHTS_FILE,
        submodule=submodule,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        files=files,
        merged_adapters=adapters or None,
    )
    logger.info("stored %s (%s) in %s", entry.class_name, submodule or "observed itself", directory)
    return entry
