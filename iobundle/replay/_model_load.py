"""Rebuild the model stored in a self-contained bundle (``observer.save(path, include_model=...)``).

A bundle is untrusted input. What it says about its model is checked before anything is
imported or built:

- the class must be one transformers itself registers for a ``model_type`` in its auto-model
  mappings (read as data); it is then resolved only as an attribute of the ``transformers``
  package, and the stored ``model_type`` must be its config's; a diffusers model (``model.library``)
  only as an attribute of the ``diffusers`` package that is a ``ModelMixin`` and ``ConfigMixin``,
  built with ``from_config`` from a config of public keys only;
- the config (and every sub-config) must hold no value that makes transformers fetch, import or
  run code (:data:`CODE_SELECTING_FIELDS`, attention and experts implementations outside the
  built-in ones, ``dtype`` strings that are not dtypes, model types whose construction loads code);
- ``trust_remote_code`` is never passed, and nothing is downloaded.

The config is JSON read with size limits, the weights are read with safetensors (never
``torch.load``, never pickle), and both are checked against the size and hash the manifest records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from iobundle._implementations import ATTN_IMPLEMENTATIONS, EXPERTS_IMPLEMENTATIONS, SAFE_ATTN_IMPLEMENTATION
from iobundle._store import LocalStore, Store
from iobundle.calls import check_file, read_member, read_stored_config
from iobundle.errors import IobundleError, MissingDependencyError, ModelLoadError, UnsafeBundleError
from iobundle.replay._bundle import Bundle
from iobundle.schema import ModelEntry

if TYPE_CHECKING:  # iobundle inspect describes a stored model without torch
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CODE_LOADING_MODEL_TYPES",
    "CODE_SELECTING_FIELDS",
    "COMPONENT_CLASSES",
    "DTYPES",
    "EXPERTS_IMPLEMENTATIONS",
    "MAX_CONFIG_DEPTH",
    "StoredModel",
    "describe_bundle_model",
    "load_bundle_model",
    "registered_model_classes",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_BUILD_IT_YOURSELF = (
    "Build the model yourself and pass it to export (iobundle export BUNDLE --model MODULE:FACTORY, "
    "or bundle.export(model) in Python)."
)

#: Classes transformers does not register for a model_type but that bundles stored before the
#: auto-model mappings were used may name (the halves of Whisper observed on their own):
#: class name -> (model_type, package under transformers.models, its module that defines the class).
COMPONENT_CLASSES: dict[str, tuple[str, str, str]] = {
    "WhisperEncoder": ("whisper", "whisper", "modeling_whisper"),
    "WhisperDecoder": ("whisper", "whisper", "modeling_whisper"),
}

#: The strings a config's ``dtype`` / ``torch_dtype`` may hold (transformers does ``getattr(torch, value)``).
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})

#: Config fields refused whenever they hold a value (not None, not empty, not False), and why.
CODE_SELECTING_FIELDS: dict[str, str] = {
    "auto_map": "names remote code (trust_remote_code) classes",
    "custom_pipelines": "names remote pipeline code",
    "trust_remote_code": "asks to run remote code",
    "quantization_config": "selects a quantization backend (bitsandbytes, gptq, awq, ...), imported at load",
    "use_kernels": "replaces layers with kernels fetched from the Hugging Face Hub",
    "kernel_config": "maps layers to kernels fetched from the Hugging Face Hub",
    "backbone": "names a backbone transformers looks up on the Hugging Face Hub or builds with timm",
    "use_pretrained_backbone": "downloads the backbone's pretrained weights",
    "backbone_kwargs": "arguments for a backbone built by name (timm or the Hub)",
}

#: Model types whose construction fetches or imports code beyond torch and transformers, and why.
CODE_LOADING_MODEL_TYPES: dict[str, str] = {
    "timm_wrapper": "builds a timm model by name (timm may fetch it from the Hub)",
    "timm_backbone": "builds a timm model by name (timm may fetch it from the Hub)",
    "gemma3n_vision": "builds a timm model by name (timm may fetch it from the Hub)",
    "rwkv": "fetches the kernels-community/rwkv kernel from the Hub at construction on CUDA",
    "yoso": "fetches the kernels-community/yoso kernel from the Hub at construction on CUDA",
    "mra": "fetches the kernels-community/mra kernel from the Hub at construction on CUDA",
    "layoutlmv2": "imports detectron2 for its visual backbone",
    "dinat": "imports natten",
}

# The attention / experts implementations a config may select (the built-in names, what messages call them),
# and the keys under which transformers reads them from a config dict (``attn_implementation`` is popped by
# __post_init__, ``_attn_implementation`` goes through its property setter, the ``*_internal`` ones are what
# to_dict used to write).
_IMPLEMENTATIONS = {
    "attn": (ATTN_IMPLEMENTATIONS, "attention implementation"),
    "experts": (EXPERTS_IMPLEMENTATIONS, "experts implementation"),
}
_IMPLEMENTATION_KEYS = {
    key: _IMPLEMENTATIONS[part]
    for part in _IMPLEMENTATIONS
    for key in (f"{part}_implementation", f"_{part}_implementation", f"_{part}_implementation_internal")
}
_DTYPE_KEYS = ("dtype", "torch_dtype")
# Settings the loader passes itself; dropped from the stored config.
_IGNORED_KEYS = ("_attn_implementation_autoset",)
# A config nested deeper than this is refused (transformers' composite models nest a few levels).
MAX_CONFIG_DEPTH = 16
# Sub-configs without a ``*_config`` name or a model_type of their own.
_SUB_CONFIG_KEYS = frozenset({"encoder", "decoder", "generator", "question_encoder"})


@functools.cache
def registered_model_classes() -> Mapping[str, frozenset[str]]:
    """Every model class name in transformers' auto-model mappings, with the model types it is registered for.

    The mappings are read as data (``transformers.models.auto.modeling_auto.*_MAPPING_NAMES``);
    no model module is imported.

    Raises:
        MissingDependencyError: transformers is not installed.
    """
    try:
        from transformers.models.auto import modeling_auto
    except ImportError as exc:
        raise MissingDependencyError(
            f"Rebuilding the model stored in a bundle needs transformers ({exc}): pip install transformers, "
            "or build the model yourself and pass --model MODULE:FACTORY."
        ) from exc

    classes: dict[str, set[str]] = {}
    for name in dir(modeling_auto):
        if not (name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")):
            continue
        for model_type, value in getattr(modeling_auto, name).items():
            for class_name in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(class_name, str):
                    classes.setdefault(class_name, set()).add(model_type)
    return MappingProxyType({name: frozenset(types) for name, types in classes.items()})


def _registered_types(name: str) -> frozenset[str] | None:
    if name in COMPONENT_CLASSES:
        return frozenset({COMPONENT_CLASSES[name][0]})
    return registered_model_classes().get(name)


def _check_class_name(name: str) -> frozenset[str]:
    """Refuse a class name transformers does not register; return the model types it is registered for."""
    types = _registered_types(name) if name.isidentifier() else None
    if not types:
        raise UnsafeBundleError(
            f"model.class_name: the bundle's model is a {name!r}, which is not a model class transformers "
            "registers for any model_type (its auto-model mappings); refusing to build it. " + _BUILD_IT_YOURSELF
        )
    loading = sorted(types & CODE_LOADING_MODEL_TYPES.keys())
    if loading:
        raise UnsafeBundleError(
            f"model.class_name: {name} (model_type {loading[0]!r}) "
            f"{CODE_LOADING_MODEL_TYPES[loading[0]]}; refusing to build it from a bundle. " + _BUILD_IT_YOURSELF
        )
    return types


def _model_class(name: str) -> type[PreTrainedModel]:
    """Resolve a registered class name as an attribute of transformers' own lazy modules."""
    import transformers

    if name in COMPONENT_CLASSES:
        _, package, module = COMPONENT_CLASSES[name]
        owner = getattr(getattr(transformers.models, package, None), module, None)
    else:
        owner = transformers
    cls = getattr(owner, name, None) if owner is not None else None
    if (
        not isinstance(cls, type)
        or not issubclass(cls, transformers.PreTrainedModel)
        or not cls.__module__.startswith("transformers.models.")
    ):
        raise ModelLoadError(
            f"transformers {transformers.__version__} has no model class {name!r}; install the version that "
            "wrote the bundle (see its producer) or build the model yourself."
        )
    return cls


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _refuse(file: str, field: str, value: Any, why: str) -> UnsafeBundleError:
    return UnsafeBundleError(
        f"{file}: {field} = {_short(value)} {why}; refusing to build the model from the bundle. " + _BUILD_IT_YOURSELF
    )


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != {} and value != [] and value != ""


def _check_implementation(file: str, field: str, value: Any, allowed: frozenset[str], what: str) -> None:
    """An attention / experts implementation: None, a built-in name, or a dict of them per sub-config."""
    if value is None or (isinstance(value, str) and value in allowed):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_implementation(file, f"{field}[{key!r}]", item, allowed, what)
        return
    why = f"is not a built-in {what} (allowed: {', '.join(sorted(allowed))}); others fetch or import code"
    if what == "attention implementation":
        why += (
            " (a model that ran with another one: call "
            f"model.set_attn_implementation({SAFE_ATTN_IMPLEMENTATION!r}) before saving)"
        )
    raise _refuse(file, field, value, why)


def _check_dtype(file: str, field: str, value: Any) -> None:
    if value is None or (isinstance(value, str) and value in DTYPES):
        return
    raise _refuse(file, field, value, f"is not a dtype name ({', '.join(sorted(DTYPES))})")


def _sub_config_class(config_class: type | None, key: str, value: dict[str, Any]) -> type | None:
    """The config class transformers builds ``config[key]`` with, when it can be told without importing code.

    A fixed class comes from ``config_class.sub_configs_defaults``; an ``AutoConfig`` one from the
    nested (or the default) model_type through transformers' CONFIG_MAPPING, never for a model
    type in :data:`CODE_LOADING_MODEL_TYPES` (their config modules import timm).
    """
    if config_class is None:
        return None
    spec = (getattr(config_class, "sub_configs_defaults", None) or {}).get(key)
    if spec is None:
        return None
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(spec.config_class, type) and issubclass(spec.config_class, PreTrainedConfig):
        return spec.config_class
    model_type = value.get("model_type", spec.model_type)
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING and model_type not in CODE_LOADING_MODEL_TYPES:
        return CONFIG_MAPPING[model_type]
    return None


def _is_sub_config(key: str, value: Any, config_class: type | None) -> bool:
    if not isinstance(value, dict):
        return False
    known = getattr(config_class, "sub_configs", None) or {}
    return key.endswith("_config") or key in _SUB_CONFIG_KEYS or key in known or "model_type" in value


def _check_config_dict(
    file: str, config: dict[str, Any], path: str = "", config_class: type | None = None, depth: int = 0
) -> None:
    """Refuse any value of ``config`` or its sub-configs that selects code; ``path`` names the sub-config.

    Sub-configs are found by their key (``*_config``, ``encoder``, ``decoder``, the keys of
    ``config_class.sub_configs``) or by a ``model_type`` of their own, and checked recursively.
    """
    if depth > MAX_CONFIG_DEPTH:
        raise UnsafeBundleError(f"{file}: {path}: sub-configs nested deeper than {MAX_CONFIG_DEPTH} levels.")
    for key, value in config.items():
        field = f"{path}.{key}" if path else str(key)
        if key in CODE_SELECTING_FIELDS and _is_set(value):
            raise _refuse(file, field, value, CODE_SELECTING_FIELDS[key])
        if key in _IMPLEMENTATION_KEYS:
            _check_implementation(file, field, value, *_IMPLEMENTATION_KEYS[key])
        elif key in _DTYPE_KEYS:
            _check_dtype(file, field, value)
        elif key == "model_type" and isinstance(value, str) and value in CODE_LOADING_MODEL_TYPES:
            raise _refuse(file, field, value, CODE_LOADING_MODEL_TYPES[value])
        elif key == "per_layer_config" and isinstance(value, dict):
            for layer, overrides in value.items():
                if isinstance(overrides, dict):
                    _check_config_dict(file, overrides, f"{field}[{layer!r}]", config_class, depth + 1)
        elif _is_sub_config(key, value, config_class):
            _check_config_dict(file, value, field, _sub_config_class(config_class, key, value), depth + 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict) and "model_type" in item:
                    _check_config_dict(file, item, f"{field}[{i}]", None, depth + 1)


def _sub_configs(config: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``config`` and every config nested in it, with their dotted paths."""
    from transformers import PreTrainedConfig

    yield path, config
    for key, value in vars(config).items():
        if isinstance(value, PreTrainedConfig) and value is not config:
            yield from _sub_configs(value, f"{path}.{key}" if path else key)


def _check_config_object(file: str, config: Any) -> None:
    """The same checks on the built config, defaults included (a sub-config the JSON left out)."""
    import torch

    for path, sub in _sub_configs(config):
        prefix = f"{path}." if path else ""
        model_type = getattr(type(sub), "model_type", "")
        if model_type in CODE_LOADING_MODEL_TYPES:
            raise _refuse(file, f"{prefix}model_type", model_type, CODE_LOADING_MODEL_TYPES[model_type])
        for key, why in CODE_SELECTING_FIELDS.items():
            value = vars(sub).get(key)
            if _is_set(value):
                raise _refuse(file, prefix + key, value, why)
        for part, (allowed, what) in _IMPLEMENTATIONS.items():
            value = vars(sub).get(f"_{part}_implementation_internal")
            _check_implementation(file, f"{prefix}{part}_implementation", value, allowed, what)
        dtype = vars(sub).get("dtype")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise _refuse(file, f"{prefix}dtype", dtype, "is not a torch dtype")


def _check_model_type(
    cls: type[PreTrainedModel], config_dict: dict[str, Any], entry: ModelEntry, types: frozenset[str]
) -> None:
    """The stored model_type must be the one of the class's config (or one it is registered for)."""
    model_type = config_dict.get("model_type")
    expected = getattr(cls.config_class, "model_type", "")
    if model_type != expected if expected else model_type not in types:
        raise ModelLoadError(
            f"{entry.config_file}: model_type {model_type!r} does not belong to {entry.class_name} "
            f"(expects {expected or sorted(types)[0]!r}): the manifest's model.class_name and the config disagree. "
            "Rebuild the bundle with observer.save(path, include_model=True), or build the model yourself."
        )


def _built(entry: ModelEntry, what: str, build: Callable[[], _T]) -> _T:
    """``build()``, its failure a ModelLoadError naming ``what`` and the config file."""
    try:
        return build()
    except IobundleError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"Cannot build {what} from {entry.config_file}: {type(exc).__name__}: {exc}") from exc


def _build(cls: type[PreTrainedModel], config_dict: dict[str, Any], entry: ModelEntry) -> torch.nn.Module:
    config_class = cls.config_class
    if config_class is None:
        raise ModelLoadError(f"{entry.class_name} has no config class to build it from; build the model yourself.")
    _check_config_dict(entry.config_file, config_dict, config_class=config_class)  # now knowing its sub-configs
    config_dict = {k: v for k, v in config_dict.items() if k not in _IGNORED_KEYS}
    config = _built(entry, f"the config of {entry.class_name}", lambda: config_class.from_dict(config_dict))
    _check_config_object(entry.config_file, config)
    kwargs = {"attn_implementation": entry.attn_implementation} if entry.attn_implementation else {}
    return _built(entry, entry.class_name, lambda: cls._from_config(config, **kwargs))


def _diffusers_class(name: str) -> type[torch.nn.Module]:
    """Resolve ``name`` only as an attribute of the ``diffusers`` package, a ``ModelMixin`` built from its config."""
    try:
        import diffusers
    except ImportError as exc:
        raise MissingDependencyError(
            f"Rebuilding the diffusers model stored in a bundle needs diffusers ({exc}): pip install diffusers, "
            "or build the model yourself and pass --model MODULE:FACTORY."
        ) from exc
    cls: Any = None
    if name.isidentifier() and not name.startswith("_"):
        with contextlib.suppress(Exception):  # a name diffusers does not export, or one whose backend is missing
            cls = getattr(diffusers, name, None)
    mixins = (diffusers.ModelMixin, diffusers.ConfigMixin)
    if not (
        isinstance(cls, type) and all(issubclass(cls, m) for m in mixins) and cls.__module__.startswith("diffusers.")
    ):
        raise UnsafeBundleError(
            f"model.class_name: the bundle's model is a {_short(name)}, which is not a model class the diffusers "
            "package exports (a diffusers.ModelMixin and ConfigMixin); refusing to build it. " + _BUILD_IT_YOURSELF
        )
    return cls


def _load_weights(store: Store, model: torch.nn.Module, entry: ModelEntry) -> None:
    name = entry.weights_file
    file = entry.files.get(name)
    if file is None:
        raise UnsafeBundleError(f"model.weights_file: {name!r} is not listed in model.files.")
    if isinstance(store, LocalStore):
        check_file(store, name, file, hash_check=True)
        _load_weights_file(store.file(name), name, model, entry)
        return
    import tempfile  # packed or remote: safetensors reads from a path, so copy it out once

    with tempfile.TemporaryDirectory(prefix="iobundle-weights-") as tmp:
        path = Path(tmp, "weights.safetensors")
        path.write_bytes(read_member(store, name, file))
        _load_weights_file(path, name, model, entry)


def _load_weights_file(path: Path, name: str, model: torch.nn.Module, entry: ModelEntry) -> None:
    import torch
    from safetensors import safe_open

    # One tensor at a time into the model's own parameters: loading the whole file first (as
    # safetensors.torch.load_model does) holds the weights twice, plus the file's mapped pages.
    try:
        try:
            handle = safe_open(str(path), framework="pt", backend="pread")  # read(), no mapping
        except TypeError:  # safetensors before 0.8 maps the file
            handle = safe_open(str(path), framework="pt")
        with handle as f:
            keys = list(f.keys())
            dtypes = {f.get_slice(k).get_dtype() for k in keys}
            floating = [d for d in ("F64", "F32", "BF16", "F16") if d in dtypes]
            if floating:
                model.to(
                    {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[
                        floating[0]
                    ]
                )
            targets, stored = model.state_dict(), set(keys)
            unexpected = [k for k in keys if k not in targets]
            # a tied weight is stored once: the names sharing its storage are loaded with it
            loaded = {targets[k].untyped_storage().data_ptr() for k in keys if k in targets}
            missing = [k for k in targets if k not in stored and targets[k].untyped_storage().data_ptr() not in loaded]
            if missing or unexpected:
                raise ModelLoadError(
                    f"{name}: missing weights {missing[:5]}, unexpected {unexpected[:5]}: they do not match the "
                    f"{entry.class_name} that {entry.config_file} builds. Save the bundle again with "
                    "observer.save(path, include_model=True), or build the model yourself."
                )
            with torch.no_grad():
                for key in keys:
                    tensor, target = f.get_tensor(key), targets[key]
                    if tensor.shape != target.shape:
                        raise ModelLoadError(
                            f"{name}: weight {key} has shape {list(tensor.shape)}, the model's "
                            f"{entry.class_name} built from {entry.config_file} expects {list(target.shape)}. Save "
                            "the bundle again with observer.save(path, include_model=True), or build the model yourself."
                        )
                    target.copy_(tensor)
                    del tensor
    except IobundleError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"Cannot load the weights {name} into {entry.class_name}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class StoredModel:
    """What a self-contained bundle says about its model, and whether ``load_bundle_model`` would refuse it.

    Attributes:
        class_name: The model class (``"LlamaForCausalLM"``, ``"UNet2DConditionModel"``).
        model_type: The config's ``model_type``; None when the config cannot be read, or has none (a diffusers config).
        submodule: The observed submodule's dotted path; empty for the model itself.
        attn_implementation: The attention implementation recorded at capture.
        weights_bytes: Size of the weights file.
        config_bytes: Size of the config file.
        refused: Why the model would not be rebuilt (the error's message), or None when it passes
            every check made before the class's module is imported.
        class_checked: Whether the class name was checked against transformers' registry.
        library: The library that defines the class (``"transformers"`` or ``"diffusers"``).
    """

    class_name: str
    model_type: str | None
    submodule: str
    attn_implementation: str | None
    weights_bytes: int
    config_bytes: int
    refused: str | None
    class_checked: bool = True
    library: str = "transformers"


def _check_config(entry: ModelEntry, config_dict: dict[str, Any]) -> None:
    """Refuse a stored config that selects code; a diffusers one holds public settings only (``_class_name``)."""
    if entry.library != "diffusers":
        return _check_config_dict(entry.config_file, config_dict)
    for key, value in config_dict.items():
        if key.startswith("_") or (key in CODE_SELECTING_FIELDS and _is_set(value)):
            raise _refuse(entry.config_file, key, value, CODE_SELECTING_FIELDS.get(key, "is not a public setting"))


def _stored_config(
    bundle: Bundle, entry: ModelEntry, *, registry: bool = True
) -> tuple[frozenset[str], dict[str, Any]]:
    """The model types ``entry``'s class is registered for (none without ``registry``), and its stored config."""
    types = frozenset[str]()
    if registry and entry.library == "diffusers":
        _diffusers_class(entry.class_name)
    elif registry:
        types = _check_class_name(entry.class_name)
    _check_implementation(
        "manifest.json", "model.attn_implementation", entry.attn_implementation, *_IMPLEMENTATIONS["attn"]
    )
    return types, read_stored_config(bundle._store.bundle_root, entry)


def describe_bundle_model(bundle: Bundle | str | os.PathLike[str], *, registry: bool = True) -> StoredModel | None:
    """Describe the model stored in ``bundle`` (None when it stores none), without building it.

    The config is read (size and hash checked) and given the checks of
    :func:`load_bundle_model` that run before anything is imported: the class name, the
    attention setting and every config value. A failed check is reported in ``refused``,
    not raised, so that ``iobundle inspect`` can show it. ``registry=False`` leaves out the one
    check that imports transformers (is the class one it registers?): ``iobundle inspect`` imports
    nothing heavy, and ``class_checked`` is then False.

    Example:
        >>> info = describe_bundle_model("run.iobundle")
        >>> info.class_name, info.model_type, info.refused
        ('LlamaForCausalLM', 'llama', None)
    """
    if not isinstance(bundle, Bundle):
        bundle = Bundle.load(bundle)
    entry = bundle.manifest.model
    if entry is None:
        return None
    model_type: str | None = None
    refused: str | None = None
    try:
        _, config_dict = _stored_config(bundle, entry, registry=registry)
        value = config_dict.get("model_type")
        model_type = value if isinstance(value, str) else None
        _check_config(entry, config_dict)
    except IobundleError as exc:  # MissingDependencyError included: nothing can be rebuilt here
        refused = str(exc)
    file = entry.files.get(entry.weights_file)
    config_file = entry.files.get(entry.config_file)
    return StoredModel(
        class_name=entry.class_name,
        model_type=model_type,
        submodule=entry.submodule,
        attn_implementation=entry.attn_implementation,
        weights_bytes=file.size if file is not None else 0,
        config_bytes=config_file.size if config_file is not None else 0,
        refused=refused,
        class_checked=registry,
        library=entry.library,
    )


def load_bundle_model(bundle: Bundle | str | os.PathLike[str]) -> torch.nn.Module:
    """Rebuild the model stored in ``bundle`` and return the observed module, in eval mode.

    The class must be one transformers registers for a model type (its auto-model mappings,
    see :func:`registered_model_classes`), and its config must select no code (remote code,
    hub kernels, quantization backends, ...). Everything is checked before the class is
    resolved; its config comes from the bundle's JSON and its weights from the bundle's
    safetensors file, both checked against the manifest first. When a submodule was observed
    (``manifest.model.submodule``), that submodule is returned.

    Raises:
        MissingDependencyError: transformers (or diffusers, for a diffusers model) is not installed.
        ModelLoadError: The bundle stores no model, or the model cannot be built or loaded.
        UnsafeBundleError: The class is not registered by transformers, a config value or the
            attention setting would fetch, import or run code, or a file name leaves the bundle.
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
        redacted = bundle.manifest.redacted is not None
        raise ModelLoadError(
            f"The bundle '{bundle.path}' stores no model: "
            + ("`iobundle redact` dropped it (--keep-model keeps it)" if redacted else "it was saved without it")
            + ". Build the model yourself, or store it (observer.save(path, include_model=True)).",
            hint="redact the original bundle again with --keep-model, or pass --model MODULE:FACTORY"
            if redacted
            else "save the bundle with observer.save(path, include_model=True), or pass --model MODULE:FACTORY",
        )
    types, config_dict = _stored_config(bundle, entry)
    _check_config(entry, config_dict)  # before the class's module is imported
    if entry.library == "diffusers":
        diffusers_cls: Any = _diffusers_class(entry.class_name)
        model = _built(entry, entry.class_name, lambda: diffusers_cls.from_config(config_dict))
    else:
        cls = _model_class(entry.class_name)
        _check_model_type(cls, config_dict, entry, types)
        model = _build(cls, config_dict, entry)
    _load_weights(bundle._store.bundle_root, model, entry)
    model.eval()
    if not entry.submodule:
        return model
    try:
        return model.get_submodule(entry.submodule)
    except AttributeError as exc:
        raise ModelLoadError(f"model.submodule: {entry.class_name} has no submodule {entry.submodule!r}.") from exc
