"""The recorded calls: what capture and replay both work on. Needs torch and safetensors; never onnx.

Internal tier: ``__all__`` is the interface between iobundle's parts, not a public API.

- the in-memory model of recorded calls and its tensor stores (:class:`RecordedCalls`);
- value trees (containers, scalars, tensor references, registered node types) and the
  node-type registry, transformers' caches and outputs included;
- turning a call's ``args``/``kwargs`` into a manifest entry;
- dtype names and the tensor file primitives: one writer of safetensors files (``_tensorfile_write``),
  one of segments (``_segments``: many calls' small tensors appended to one file) and one
  reader of untrusted bundle members (``_tensorfile_read``: names, sizes, hashes, mapped tensors), side by side;
- the ``torch.autocast`` state of a call, read at capture and re-entered at replay;
- delta storage (a tensor stored as what it adds to one stored before) and the integrity hashes.

Capture fills a :class:`RecordedCalls` while observing; replay builds one from a manifest.
Neither stage is imported from here.
"""

from __future__ import annotations

__all__ = [
    # Recorded calls
    "DictTensorStore",
    "RecordedCalls",
    "TensorStore",
    "positional_names",
    "record_inputs",
    "signature_entry",
    # torch.autocast at a recorded call
    "ReplayAutocast",
    "autocast_state",
    "module_device_type",
    "replay_autocast",
    # Value trees and node types
    "DYNAMIC_CACHE_NAME",
    "ENCODER_DECODER_CACHE_NAME",
    "STATIC_CACHE_NAME",
    "Layout",
    "NodeType",
    "TensorCollector",
    "attention_name",
    "build_value",
    "call_key",
    "collect_tensor_keys",
    "count_leaves",
    "count_tensors",
    "cache_child_labels",
    "dynamic_cache_parts",
    "iter_tensor_nodes",
    "map_structure",
    "node_layout",
    "record_value",
    "register_node_type",
    "replace_tensors",
    "tensor_keys",
    "tree_key",
    "restore_token_counts",
    "transformers_pytree_nodes",
    # Tensor paths (what reports show and --atol NAME=... takes)
    "child_path",
    "item_labels",
    "path_matches",
    "tensor_paths",
    "call_paths",
    # Delta storage and hashes
    "DeltaIndex",
    "extends_bytes",
    "Match",
    "Packed",
    "PinnedStager",
    "buffer_size",
    "WRITE_HASH",
    "new_hasher",
    "rebuild",
    # Tensor files
    "FLOATING_NAMES",
    "NAME_TO_DTYPE",
    "dtype_name",
    "parse_header",
    "read_exactly",
    "SegmentWriter",
    "seal_segment",
    "segment_header_entry",
    "tensor_bytes",
    "tensor_span",
    "write_tensor_file",
    # Reading bundle members (untrusted bytes)
    "BundleTensorStore",
    "check_file",
    "check_file_header",
    "check_segment_member",
    "listed_files",
    "read_member",
    # The stored model config
    "read_stored_config",
]

import importlib
import sys
from contextlib import AbstractContextManager
from typing import Any

from iobundle.calls._autocast import (
    ReplayAutocast,
    autocast_state,
    module_device_type,
    replay_autocast,
)
from iobundle.calls._calls import DictTensorStore, RecordedCalls, TensorStore, positional_names, signature_entry
from iobundle.calls._config import read_stored_config
from iobundle.calls._delta import DeltaIndex, Match, extends_bytes, rebuild
from iobundle.calls._dtypes import FLOATING_NAMES, NAME_TO_DTYPE, dtype_name
from iobundle.calls._hashing import WRITE_HASH, new_hasher
from iobundle.calls._layouts import (
    DYNAMIC_CACHE_NAME,
    ENCODER_DECODER_CACHE_NAME,
    STATIC_CACHE_NAME,
    Layout,
    attention_name,
    cache_child_labels,
    dynamic_cache_parts,
)
from iobundle.calls._paths import call_paths, child_path, item_labels, path_matches, tensor_paths
from iobundle.calls._record import record_inputs
from iobundle.calls._registry import (
    NodeType,
    node_layout,
    register_node_type,
    register_provider,
)
from iobundle.calls._segments import SegmentWriter, seal_segment, segment_header_entry
from iobundle.calls._staging import Packed, PinnedStager, buffer_size
from iobundle.calls._tensorfile_read import (
    BundleTensorStore,
    check_file,
    check_file_header,
    check_segment_member,
    listed_files,
    read_member,
)
from iobundle.calls._tensorfile_write import (
    parse_header,
    read_exactly,
    tensor_bytes,
    tensor_span,
    write_tensor_file,
)
from iobundle.calls._tree import (
    TensorCollector,
    build_value,
    count_leaves,
    count_tensors,
    iter_tensor_nodes,
    map_structure,
    record_value,
    replace_tensors,
    tensor_keys,
)
from iobundle.schema import call_key, collect_tensor_keys, tree_key

# transformers' node types register themselves the first time one of its classes is met (or named).
register_provider("transformers", lambda: importlib.import_module("iobundle.calls._transformers").register_all())


def restore_token_counts(arguments: dict[str, Any]) -> int:
    """Give the rebuilt sliding-window cache layers among a call's ``arguments`` (by name) their token count.

    See ``iobundle.calls._caches.restore_token_counts``; nothing is imported unless transformers'
    caches are loaded already (so none can be among the values).
    """
    if "transformers.cache_utils" not in sys.modules:
        return 0
    from iobundle.calls._caches import restore_token_counts as restore

    return restore(arguments)


def transformers_pytree_nodes() -> AbstractContextManager[None]:
    """Register transformers' caches with ``torch.utils._pytree`` for the duration of a ``with`` block.

    iobundle needs no registration to observe, save, load or export. This is for code that calls
    ``torch.export`` itself with a ``DynamicCache``/``EncoderDecoderCache``/``StaticCache`` among its
    inputs: the layouts are iobundle's (per-layer key and value tensors, nothing that varies between
    calls in the context). Any registration present before is restored on exit. Needs transformers.

    Example:
        >>> with transformers_pytree_nodes():
        ...     ep = torch.export.export(model, (), kwargs=bundle.infer_arguments(),
        ...                              dynamic_shapes=bundle.infer_dynamic_shapes())
    """
    from iobundle.calls._torch_pytree import torch_pytree_nodes as nodes

    return nodes()
