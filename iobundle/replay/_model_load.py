"""Rebuild the model stored in a self-contained bundle (``observer.save(path, include_model=...)``).

A bundle is untrusted input, so the class it names is looked up in a fixed allow-list of
transformers classes (:data:`ALLOWED_CLASSES`); any other name is refused before
anything is imported. The config is JSON read with size limits and handed to the
class's own config class; the weights are read with safetensors (never ``torch.load``,
never pickle). Both files are checked against the size and sha256 the manifest records.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from iobundle.errors import IobundleError, ModelLoadError, UnsafeBundleError
from iobundle.replay._bundle import Bundle
from iobundle.replay._tensorfile import Root, check_file, read_member
from iobundle.schema import ModelEntry

__all__ = ["ALLOWED_CLASSES", "MAX_CONFIG_BYTES", "load_bundle_model"]

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 16 * 1024**2

_WHISPER = "transformers.models.whisper.modeling_whisper"

#: Class names a bundle may ask for, and the module each is taken from (``getattr(module, name)``).
#: Nothing outside this table is ever resolved.
ALLOWED_CLASSES: dict[str, str] = {
    # decoder-only language models
    "LlamaForCausalLM": "transformers",
    "LlamaModel": "transformers",
    "MistralForCausalLM": "transformers",
    "MistralModel": "transformers",
    "Qwen2ForCausalLM": "transformers",
    "Qwen2Model": "transformers",
    "Qwen3ForCausalLM": "transformers",
    "Gemma2ForCausalLM": "transformers",
    "Gemma3ForCausalLM": "transformers",
    "Gemma3ForConditionalGeneration": "transformers",
    "Phi3ForCausalLM": "transformers",
    "GPT2LMHeadModel": "transformers",
    # encoder-decoder, and the halves of Whisper observed on their own
    "WhisperForConditionalGeneration": "transformers",
    "WhisperModel": "transformers",
    "WhisperEncoder": _WHISPER,
    "WhisperDecoder": _WHISPER,
    "T5ForConditionalGeneration": "transformers",
    "BartForConditionalGeneration": "transformers",
    # encoders
    "BertModel": "transformers",
    "BertForSequenceClassification": "transformers",
}


def _model_class(name: str) -> type:
    """Resolve an allow-listed class name in transformers; refuse any other name."""
    if name not in ALLOWED_CLASSES:
        raise UnsafeBundleError(
            f"The bundle's model is a {name!r}, which is not in iobundle's allow-list of transformers classes "
            f"({', '.join(sorted(ALLOWED_CLASSES))}); refusing to build it. Build the model yourself and pass "
            "it to export."
        )
    import importlib

    import transformers

    cls = getattr(importlib.import_module(ALLOWED_CLASSES[name]), name, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ModelLoadError(
            f"transformers {transformers.__version__} has no model class {name!r}; install the version that "
            "wrote the bundle (see its producer) or build the model yourself."
        )
    return cls


def _read_config(root: Root, entry: ModelEntry) -> dict[str, Any]:
    name = entry.config_file
    file = entry.files.get(name)
    if file is None:
        raise UnsafeBundleError(f"model.config_file: {name!r} is not listed in model.files.")
    if file.size > MAX_CONFIG_BYTES:
        raise UnsafeBundleError(
            f"model.files[{name!r}]: {file.size} bytes, over the limit of {MAX_CONFIG_BYTES} bytes for a config."
        )
    path = check_file(root, name, file, hash_check=True)
    try:
        config = json.loads(path.read_bytes() if isinstance(path, Path) else read_member(path, name, file.size))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: not a JSON config ({exc}).") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{name}: a config is a JSON object, got {type(config).__name__}.")
    return config


def _build(cls: type, config_dict: dict[str, Any], entry: ModelEntry) -> torch.nn.Module:
    config_class = cls.config_class
    model_type = config_dict.get("model_type")
    expected = getattr(config_class, "model_type", None)
    if expected and model_type != expected:
        raise ModelLoadError(
            f"{entry.config_file}: model_type {model_type!r} does not belong to {entry.class_name} "
            f"(expects {expected!r})."
        )
    config_dict = {k: v for k, v in config_dict.items() if k not in ("auto_map", "_attn_implementation_autoset")}
    try:
        config = config_class.from_dict(config_dict)
        kwargs = {"attn_implementation": entry.attn_implementation} if entry.attn_implementation else {}
        model = cls._from_config(config, **kwargs)
    except IobundleError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"Cannot build {entry.class_name} from {entry.config_file}: {type(exc).__name__}: {exc}"
        ) from exc
    return model  # type: ignore[no-any-return]


def _load_weights(root: Root, model: torch.nn.Module, entry: ModelEntry) -> None:
    name = entry.weights_file
    file = entry.files.get(name)
    if file is None:
        raise UnsafeBundleError(f"model.weights_file: {name!r} is not listed in model.files.")
    member = check_file(root, name, file, hash_check=True)
    if not isinstance(member, Path):  # packed or remote: safetensors reads from a path, so copy it out once
        import tempfile

        with tempfile.TemporaryDirectory(prefix="iobundle-weights-") as tmp:
            path = Path(tmp, "weights.safetensors")
            path.write_bytes(read_member(member, name, file.size))
            _load_weights_file(path, name, model, entry)
        return
    _load_weights_file(member, name, model, entry)


def _load_weights_file(path: Path, name: str, model: torch.nn.Module, entry: ModelEntry) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_model

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            dtypes = {f.get_slice(k).get_dtype() for k in keys}
        floating = [d for d in ("F64", "F32", "BF16", "F16") if d in dtypes]
        if floating:
            model.to(
                {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[floating[0]]
            )
        missing, unexpected = load_model(model, str(path), strict=True)
    except IobundleError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"Cannot load the weights {name} into {entry.class_name}: {exc}") from exc
    if missing or unexpected:  # strict=True raises first; kept for safetensors versions that do not
        raise ModelLoadError(f"{name}: missing weights {missing[:5]}, unexpected {unexpected[:5]}.")


def load_bundle_model(bundle: Bundle | str | os.PathLike[str]) -> torch.nn.Module:
    """Rebuild the model stored in ``bundle`` and return the observed module, in eval mode.

    The class must be in :data:`ALLOWED_CLASSES`; its config comes from the bundle's JSON and
    its weights from the bundle's safetensors file, both checked against the manifest first.
    When a submodule was observed (``manifest.model.submodule``), that submodule is returned.

    Raises:
        ModelLoadError: The bundle stores no model, or the model cannot be built or loaded.
        UnsafeBundleError: The class is not allow-listed, or a file name leaves the bundle.
        IntegrityError: A model file's size or sha256 differs from the manifest.

    Example:
        >>> bundle = load_bundle("run.iobundle")
        >>> model = load_bundle_model(bundle)
        >>> bundle.to_onnx(model, "model.onnx")
    """
    if not isinstance(bundle, Bundle):
        bundle = Bundle.load(bundle)
    entry = bundle.manifest.model
    if entry is None:
        raise ModelLoadError(
            f"The bundle '{bundle.path}' stores no model. Save it with observer.save(path, include_model=True), "
            "or build the model yourself."
        )
    cls = _model_class(entry.class_name)
    root = bundle._store.bundle_root
    model = _build(cls, _read_config(root, entry), entry)
    _load_weights(root, model, entry)
    model.eval()
    if not entry.submodule:
        return model
    try:
        return model.get_submodule(entry.submodule)
    except AttributeError as exc:
        raise ModelLoadError(f"model.submodule: {entry.class_name} has no submodule {entry.submodule!r}.") from exc
