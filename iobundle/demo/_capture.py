"""The capture half of the demo: run the tiny decoder's generation loop under an observer, save the bundle."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from iobundle.demo._model import demo_model, generate
from iobundle.observer import InputObserver

__all__ = ["DEMO_FACTORY", "capture_demo"]

DEMO_FACTORY = "iobundle.demo:demo_model"


def capture_demo(
    directory: str | os.PathLike[str], *, batch: int = 2, prompt_length: int = 6, new_tokens: int = 5
) -> tuple[Path, int]:
    """Generate ``new_tokens`` tokens with the demo model, recording every call; return the bundle path and call count.

    The bundle goes to ``directory/demo.iobundle`` (replaced if present).
    """
    model = demo_model()
    observer = InputObserver()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.embed.num_embeddings, (batch, prompt_length), generator=generator)
    with observer(model, store_n_calls=new_tokens + 1):
        generate(model, prompt, new_tokens)
    path = Path(directory) / "demo.iobundle"
    observer.save(path, overwrite=True)
    return path, observer.num_obs()
