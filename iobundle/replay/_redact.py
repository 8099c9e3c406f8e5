"""Synthetic stand-ins for a bundle's recorded inputs, so that a bundle can go into a bug report without private data.

Each input tensor (call arguments and ``value_if_missing`` placeholders) is replaced by a tensor of
the same dtype and shape, drawn from a seeded generator:

- a tensor with at most two distinct values (an attention mask of 0/1, a bool mask, an additive
  mask of 0/-inf) keeps those two values, each element drawn with the observed frequency of the
  larger one: masks stay masks, an all-ones mask stays all ones;
- an integer tensor whose every row increases (positions, ``cache_position``) keeps rows that
  count up by one as they are (they only tell lengths, which the shapes tell anyway); other
  increasing rows become sorted draws within the row's range;
- other integer tensors (token ids) are drawn uniformly within the observed ``[min, max]``, so
  ids stay valid for the embedding;
- floating-point and complex tensors are drawn from a normal law with the observed mean and
  standard deviation (finite values only).

Scalars, constants and the structure of the calls are kept; so are the recorded outputs when asked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

import torch

from iobundle._progress import ProgressCallback, notify
from iobundle.calls import DictTensorStore, RecordedCalls, tensor_keys
from iobundle.errors import ModelLoadError
from iobundle.replay._bundle import Bundle
from iobundle.replay._tensorfile import check_file, read_member
from iobundle.schema import CallEntry, ModelEntry

__all__ = ["copy_model_files", "redact_calls", "synthetic_like"]


def _two_values(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    lo, hi = t.min(), t.max()
    if bool(((t == lo) | (t == hi)).all()):
        return lo, hi
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def synthetic_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A synthetic tensor of ``t``'s dtype and shape (see the module docstring for the rules)."""
    t = t.detach().cpu()
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    if t.dtype == torch.bool:
        p = t.float().mean()
        return torch.rand(t.shape, generator=generator) < p
    work = t if not (t.is_floating_point() and t.element_size() == 1) else t.float()  # float8: no comparisons
    pair = _two_values(work) if not t.is_complex() else None
    if pair is not None:
        lo, hi = pair
        p = (work == hi).float().mean()
        pick = torch.rand(t.shape, generator=generator) < p
        return torch.where(pick, hi, lo).to(t.dtype)
    if t.is_floating_point() or t.is_complex():
        x = t.to(torch.complex128 if t.is_complex() else torch.float64)
        finite = x[torch.isfinite(x)]
        mean = finite.mean() if finite.numel() else torch.zeros((), dtype=x.dtype)
        std = finite.std() if finite.numel() > 1 else torch.ones((), dtype=torch.float64)
        std = std.abs() if std.is_complex() else std
        noise = torch.randn(t.shape, generator=generator, dtype=x.dtype)
        return (noise * std + mean).to(t.dtype)
    lo, hi = int(t.min()), int(t.max())
    if t.ndim >= 1 and t.shape[-1] > 1:
        rows = _rows(t.to(torch.int64))
        steps = rows[:, 1:] - rows[:, :-1]
        if bool((steps == 1).all()):
            return t.clone()  # positions: arange rows say nothing but their start and length
        if bool((steps >= 0).all()):
            low, high = rows.min(dim=1, keepdim=True).values, rows.max(dim=1, keepdim=True).values
            draws = torch.rand(rows.shape, generator=generator, dtype=torch.float64)
            values = (low + (draws * (high - low + 1).double()).floor().long()).clamp(max=high)
            return values.sort(dim=1).values.reshape(t.shape).to(t.dtype)
    return torch.randint(lo, hi + 1, t.shape, generator=generator, dtype=torch.int64).to(t.dtype)


def _redact_error(call: CallEntry) -> CallEntry:
    if call.error is None:
        return call
    kind = call.error.split(":", 1)[0].strip()[:100]
    return call.model_copy(update={"error": f"{kind}: (message removed by iobundle redact)"})


REDACT_TASK = "redact"


def redact_calls(
    bundle: Bundle, *, keep_outputs: bool = False, seed: int = 0, on_progress: ProgressCallback | None = None
) -> RecordedCalls:
    """The calls of ``bundle`` with synthetic inputs (and no outputs unless ``keep_outputs``), in memory.

    The error messages of failed calls are reduced to the exception's type (they may quote
    values). A tensor used both as an input and as an output gets its synthetic value in both.
    Write the result with ``iobundle.capture.save_recorded_calls``, or use
    ``iobundle.redact_bundle``, which does both. ``on_progress`` is called with a
    :class:`~iobundle.replay.ProgressEvent` (task ``"redact"``) before the first call and after
    each call's inputs are made.
    """
    rc = bundle._recorded()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def synthesize(keys: list[str]) -> None:  # in order of first use: the same seed gives the same values
        for key in keys:
            if key not in tensors:
                tensors[key] = synthetic_like(rc.store.get(key), generator)

    notify(on_progress, REDACT_TASK, 0, len(rc.calls))
    for entry in rc.value_if_missing:
        synthesize(tensor_keys(entry.value))
    for done, call in enumerate(rc.calls, start=1):
        keys = [k for a in call.args for k in tensor_keys(a)]
        keys += [k for v in call.kwargs.values() for k in tensor_keys(v)]
        synthesize(keys)
        notify(on_progress, REDACT_TASK, done, len(rc.calls), f"call {call.index}")
    calls = []
    for call in rc.calls:  # after every input: a tensor that is also an input never keeps its real value
        call = _redact_error(call)
        if keep_outputs and call.outputs is not None:
            for key in tensor_keys(call.outputs):
                if key not in tensors:
                    tensors[key] = rc.store.get(key)
        elif call.outputs is not None:
            call = call.model_copy(update={"outputs": None})
        calls.append(call)
    return RecordedCalls(
        signature=rc.signature, calls=calls, store=DictTensorStore(tensors), value_if_missing=list(rc.value_if_missing)
    )


def copy_model_files(bundle: Bundle, target: str | os.PathLike[str]) -> ModelEntry:
    """Copy the model files of ``bundle`` (config and weights, checked first) into the bundle directory ``target``.

    Raises:
        ModelLoadError: ``bundle`` stores no model.
        IntegrityError: A model file's size or sha256 differs from the manifest.
    """
    entry = bundle.manifest.model
    if entry is None:
        raise ModelLoadError(
            f"The bundle '{bundle.path}' stores no model, so there is none to keep. Drop --keep-model (keep_model=True)."
        )
    root = bundle._store.bundle_root
    for name, file in entry.files.items():
        member = check_file(root, name, file, hash_check=True)
        path = Path(target).joinpath(*PurePosixPath(name).parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(member, Path):
            shutil.copyfile(member, path)
        else:
            path.write_bytes(read_member(member, name, file.size))
    return entry
