"""Node types for transformers 5.x objects: KV caches and ``ModelOutput`` classes.

Imported only once a transformers object has been met, so it imports transformers at the top.
Importing it registers nothing: :func:`register_all` fills the iobundle registry, and
:func:`iobundle.calls._torch_pytree.torch_pytree_nodes` lends the same layouts to
``torch.utils._pytree`` for a ``with`` block. The layouts' plain facts live in
:mod:`iobundle.calls._layouts` (read without importing this module); the caches' layouts (all
version 1) are described in :mod:`iobundle.calls._caches` and :mod:`iobundle.calls._quantized_cache`.

``ModelOutput`` subclasses
    Children: the values that are not None, in field order. Context: their keys. Classes defined
    outside ``transformers.models`` are named ``"transformers." + class name``
    (``transformers.CausalLMOutputWithPast``); model-specific ones
    ``"transformers.models.<model>." + class name``, since a few class names are defined by several
    models and a name must not depend on which models happen to be imported.

Caches are rebuilt by assigning tensors to new layers, never through ``update()`` (which would cut
sliding caches again and make tensor constants that break ``torch.onnx.export``), and no layer is
built by a constructor that calls ``torch.tensor``. Cache subclasses (``MtpCache``, ``DFlashCache``)
are not registered; layers holding state besides tensors and plain settings (HQQ, FP8) are refused
with ``UnsupportedInputError`` (one warning at capture). Contexts read from a bundle are checked
before use: nothing named in them is imported or called, only the classes above are built.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import transformers
import transformers.generation.utils
import transformers.modeling_outputs
from transformers.cache_utils import (
    DFlashCache,
    DynamicCache,
    EncoderDecoderCache,
    MtpCache,
    QuantizedCache,
    StaticCache,
)
from transformers.utils.generic import ModelOutput

from iobundle.calls._caches import (
    flatten_dynamic_cache,
    flatten_encoder_decoder_cache,
    flatten_static_cache,
    unflatten_dynamic_cache,
    unflatten_encoder_decoder_cache,
    unflatten_static_cache,
)
from iobundle.calls._layouts import (
    BUILTIN_LAYOUTS,
    DYNAMIC_CACHE_NAME,
    ENCODER_DECODER_CACHE_NAME,
    NODE_TYPE_VERSION,
    QUANTIZED_CACHE_NAME,
    STATIC_CACHE_NAME,
)
from iobundle.calls._quantized_cache import flatten_quantized_cache, unflatten_quantized_cache
from iobundle.calls._registry import NodeType, register_node_type
from iobundle.errors import UnsupportedInputError

__all__ = ["register_all"]

logger = logging.getLogger(__name__)

_MODELS_PREFIX = "transformers.models."


# --------------------------------------------------------------------------- model outputs


def _flatten_model_output(output: Any) -> tuple[list[Any], list[str]]:
    return list(output.values()), list(output.keys())


def _model_output_unflattener(cls: type) -> Any:
    def unflatten(children: list[Any], context: Any) -> Any:
        return cls(**dict(zip(context, children, strict=True)))

    return unflatten


def _model_output_name(cls: type) -> str | None:
    """Return the stable node type name of a ModelOutput class, or None if not from transformers."""
    module = cls.__module__
    if module.startswith(_MODELS_PREFIX):
        model = module[len(_MODELS_PREFIX) :].split(".", 1)[0]
        return f"{_MODELS_PREFIX}{model}.{cls.__name__}"
    if module == "transformers" or module.startswith("transformers."):
        return f"transformers.{cls.__name__}"
    return None


def _model_output_classes() -> list[type]:
    """Return every concrete (dataclass) ModelOutput subclass loaded now, parents first."""
    seen: set[type] = set()
    found: list[type] = []
    stack = list(reversed(ModelOutput.__subclasses__()))
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if dataclasses.is_dataclass(cls):
            found.append(cls)
        stack.extend(reversed(cls.__subclasses__()))
    return found


# --------------------------------------------------------------------------- registration


# Caches iobundle cannot record, and why: a recorder warns once and marks their calls incomplete
# (rather than recording an opaque cache that no export can use).
_REFUSED_CACHES: dict[type, str] = {
    MtpCache: "it shifts its queries by a per-layer offset that iobundle does not record yet. Record the main model.",
    DFlashCache: (
        "it counts accepted draft tokens in a Python int that changes at every call. Record the target model "
        "without speculative decoding."
    ),
}


def _refuse_cache(cache: Any) -> tuple[list[Any], Any]:
    raise UnsupportedInputError(
        f"The cache is a {type(cache).__name__}, which iobundle cannot record: {_REFUSED_CACHES[type(cache)]}"
    )


def _never_rebuilt(children: list[Any], context: Any) -> Any:
    raise ValueError("iobundle never writes this cache to a bundle, so it does not rebuild one.")


def _cache_node_type(name: str, cls: type, flatten: Any, unflatten: Any) -> NodeType:
    """A cache's node type, its layout (``empty_dim``, ``child_empty_dims``) from the torch-free table."""
    layout = BUILTIN_LAYOUTS[(name, NODE_TYPE_VERSION)]
    return NodeType(name, NODE_TYPE_VERSION, cls, flatten, unflatten, layout.empty_dim, layout.child_empty_dims)


CACHE_NODE_TYPES: tuple[NodeType, ...] = (
    _cache_node_type(DYNAMIC_CACHE_NAME, DynamicCache, flatten_dynamic_cache, unflatten_dynamic_cache),
    _cache_node_type(STATIC_CACHE_NAME, StaticCache, flatten_static_cache, unflatten_static_cache),
    _cache_node_type(
        ENCODER_DECODER_CACHE_NAME,
        EncoderDecoderCache,
        flatten_encoder_decoder_cache,
        unflatten_encoder_decoder_cache,
    ),
    _cache_node_type(QUANTIZED_CACHE_NAME, QuantizedCache, flatten_quantized_cache, unflatten_quantized_cache),
    *(
        NodeType(f"transformers.{cls.__name__}", NODE_TYPE_VERSION, cls, _refuse_cache, _never_rebuilt)
        for cls in _REFUSED_CACHES
    ),
)


def register_all() -> None:
    """Register the node types of the transformers caches and of every loaded ``ModelOutput`` class.

    ``ModelOutput`` classes are found by walking ``ModelOutput.__subclasses__()``, so only
    classes whose module has been imported are registered (``transformers.modeling_outputs``
    and ``transformers.generation.utils`` always are). Calling it again registers the classes
    loaded since, which is how a model-specific output met later becomes known. Classes
    defined outside transformers (remote code) are left out.

    Example:
        >>> register_all()
        >>> find_node_type(DynamicCache()).name
        'transformers.DynamicCache'
    """
    for node_type in CACHE_NODE_TYPES:
        register_node_type(node_type)
    for cls in _model_output_classes():
        name = _model_output_name(cls)
        if name is None:
            logger.debug("Not registering %s.%s: not defined by transformers", cls.__module__, cls.__qualname__)
            continue
        register_node_type(
            NodeType(name, NODE_TYPE_VERSION, cls, _flatten_model_output, _model_output_unflattener(cls))
        )
    logger.debug("Registered transformers node types (transformers %s)", transformers.__version__)
