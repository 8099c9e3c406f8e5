"""Build the user's model from a ``MODULE:FACTORY`` reference (imported from the user's environment)."""

from __future__ import annotations

import importlib
import os
import sys

import torch

from iobundle.errors import ModelLoadError

__all__ = ["model_from_factory"]


def model_from_factory(reference: str) -> torch.nn.Module:
    """Import ``MODULE`` and call ``FACTORY()`` (a dotted attribute path is allowed) to get the model.

    This runs the user's code, from the user's ``sys.path`` plus the current directory; it is
    never given anything read from a bundle.

    Raises:
        ModelLoadError: The reference is malformed, the import or the call fails, or the result
            is not a ``torch.nn.Module``.
    """
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ModelLoadError(f"--model {reference!r}: expected MODULE:FACTORY, e.g. mypackage.models:build_model.")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelLoadError(
            f"--model {reference!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}). "
            "It must be importable from the current directory or the installed packages."
        ) from exc
    finally:
        if added:
            sys.path.remove(cwd)
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ModelLoadError(f"--model {reference!r}: {module_name} has no attribute {attr!r}.")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelLoadError(f"--model {reference!r}: {attr} is not callable.")
    try:
        model = factory()
    except Exception as exc:
        raise ModelLoadError(f"--model {reference!r}: {attr}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(
            f"--model {reference!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module."
        )
    return model
