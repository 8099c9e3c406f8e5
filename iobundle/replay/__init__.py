"""Open bundles offline; infer, export (torch.export, ONNX) and validate (onnxruntime) from them."""

from __future__ import annotations

__all__ = ["Bundle", "load_bundle"]

from iobundle.replay._bundle import Bundle, load_bundle
