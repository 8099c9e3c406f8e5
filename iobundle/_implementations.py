"""The attention and experts implementations transformers runs from its own code; stdlib only.

Shared by capture (``save(include_model=...)`` warns when the model runs with another one) and
replay (``load_bundle_model`` and ``--from-bundle`` refuse a stored model that names another
one), so both sides agree on the list.
"""

from __future__ import annotations

__all__ = ["ATTN_IMPLEMENTATIONS", "EXPERTS_IMPLEMENTATIONS", "SAFE_ATTN_IMPLEMENTATION"]

#: Attention implementations transformers 5.24 ships in its own code: no hub kernel
#: (``org/repo``, ``kernels-community/...``), no ``flash_attention_*`` (imports flash-attn or a
#: hub kernel), no ``paged|...`` (the paged/continuous-batching path), no implementation
#: registered by the user with ``transformers.AttentionInterface.register``.
ATTN_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flex_attention"})

#: Experts (mixture-of-experts) implementations written in torch inside transformers;
#: ``deepgemm`` and ``sonicmoe`` load hub kernels, the FP8 ones need a quantized model.
EXPERTS_IMPLEMENTATIONS = frozenset({"eager", "grouped_mm", "batched_mm"})

SAFE_ATTN_IMPLEMENTATION = "sdpa"
"""The built-in implementation to switch to before saving (``model.set_attn_implementation('sdpa')``)."""
