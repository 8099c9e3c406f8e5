"""The built-in demo: a tiny decoder, captured during generation, exported and validated from its bundle (internal)."""

from __future__ import annotations

__all__ = ["DEMO_FACTORY", "TinyDecoder", "capture_demo", "capture_llama_demo", "demo_model", "generate"]

from iobundle.demo._capture import DEMO_FACTORY, capture_demo
from iobundle.demo._llama import capture_llama_demo
from iobundle.demo._model import TinyDecoder, demo_model, generate
