"""The built-in demo: a tiny decoder, captured during generation, exported and validated from its bundle."""

from __future__ import annotations

__all__ = ["TinyDecoder", "demo_model", "generate"]

from iobundle.demo._model import TinyDecoder, demo_model, generate
