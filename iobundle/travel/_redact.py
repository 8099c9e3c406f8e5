"""Synthetic stand-ins for a bundle's recorded inputs, so that a bundle can go into a bug report without private data.

Each input tensor (call arguments and ``value_if_missing`` placeholders) is replaced by a tensor of
the same dtype and shape, drawn from a seeded generator; the parameter it is passed as decides some
rules (:data:`TOKEN_ID_NAMES`, :data:`POSITION_NAMES`). The rules, and what is kept verbatim, are
the user's to read in docs/travel.md ("Bug reports without private data"), in short:

- a mask (bool; values within {0, 1}, {0, -inf} or {0, the dtype's lowest}) keeps its two values,
  each element drawn at the observed frequency (never for token ids);
- positions, and integer rows ``0..n-1`` that are not token ids, keep rows that count up by one;
  other increasing rows become sorted draws within the row's range;
- other integers are drawn within their observed ``[min, max]``; one holding one value only is
  drawn within the range of every call of that parameter, the vocabulary for token ids when the
  config is stored, else among its two neighbours, and never takes that value;
- floats are drawn with the observed mean and standard deviation (finite values only); one of a
  single value is drawn around it at its own scale, and no element takes that value.

The bundle writer records its own producer (the redacting machine's versions).
"""

from __future__ import annotations

import os
import shutil

import torch

from iobundle._paths import Tree
from iobundle._progress import ProgressCallback, notify
from iobundle.calls import (
    DictTensorStore,
    RecordedCalls,
    check_file,
    read_stored_config,
    tensor_keys,
)
from iobundle.errors import BundleExistsError, IobundleError, ModelLoadError
from iobundle.replay import Bundle, recorded_calls
from iobundle.schema import CallEntry, ModelEntry

__all__ = ["POSITION_NAMES", "TOKEN_ID_NAMES", "copy_model_files", "redact_calls", "synthetic_like"]

TOKEN_ID_NAMES = frozenset({"input_ids", "decoder_input_ids", "labels", "token_ids", "ids"})
"""Parameters whose integer tensors are token ids: always drawn afresh, never kept as masks or positions."""

POSITION_NAMES = frozenset({"position_ids", "cache_position", "cache_positions", "decoder_position_ids"})
"""Parameters whose rows that count up by one are kept (positions say nothing but lengths)."""


def _mask_values(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two values of a mask (see the module docstring), or None when ``t`` is no mask."""
    lo, hi = t.min(), t.max()
    if not bool(((t == lo) | (t == hi)).all()):
        return None
    allowed: list[tuple[float, float]] = [(0, 1)]
    if t.is_floating_point():
        allowed += [(float("-inf"), 0), (float(torch.finfo(t.dtype).min), 0)]
    if any({float(lo), float(hi)} <= {x, y} for x, y in allowed):
        return lo, hi
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _is_token_ids(name: str | None) -> bool:
    return name is not None and (name in TOKEN_ID_NAMES or name.endswith("input_ids"))


def synthetic_like(
    t: torch.Tensor,
    generator: torch.Generator,
    *,
    name: str | None = None,
    bounds: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A synthetic tensor of ``t``'s dtype and shape (see the module docstring for the rules).

    Args:
        t: The recorded tensor.
        generator: The seeded generator to draw from.
        name: The parameter ``t`` was passed as (None when unknown): token ids and positions by name.
        bounds: ``(low, high)`` (inclusive) to draw integers within when ``t`` holds a single value
            (its own range would give it back): the range over every call, or the vocabulary.
    """
    t = t.detach().cpu()
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    if t.dtype == torch.bool:
        p = t.float().mean()
        return torch.rand(t.shape, generator=generator) < p
    integer = not (t.is_floating_point() or t.is_complex())
    token_ids = integer and _is_token_ids(name)
    work = t if not (t.is_floating_point() and t.element_size() == 1) else t.float()  # float8: no comparisons
    pair = _mask_values(work) if not (t.is_complex() or token_ids) else None
    if pair is not None:
        rare, common = pair
        p = (work == common).float().mean()
        pick = torch.rand(t.shape, generator=generator) < p
        return torch.where(pick, common, rare).to(t.dtype)
    if not integer:
        return _synthetic_floats(t, generator)
    lo, hi = int(t.min()), int(t.max())
    if not token_ids and t.ndim >= 1:
        rows = _rows(t.to(torch.int64))
        steps = rows[:, 1:] - rows[:, :-1]
        positions = name in POSITION_NAMES
        counting = bool((steps == 1).all())
        if counting and (positions or (t.shape[-1] > 1 and bool((rows[:, 0] == 0).all()))):
            return t.clone()  # positions: arange rows say nothing but their start and length
        if lo != hi and t.shape[-1] > 1 and bool((steps >= 0).all()):
            low, high = rows.min(dim=1, keepdim=True).values, rows.max(dim=1, keepdim=True).values
            flat = high == low  # a row of one value: its own range would give it back
            low, high = torch.where(flat, lo, low), torch.where(flat, hi, high)
            draws = torch.rand(rows.shape, generator=generator, dtype=torch.float64)
            values = (low + (draws * (high - low + 1).double()).floor().long()).clamp(max=high)
            return values.sort(dim=1).values.reshape(t.shape).to(t.dtype)
    if lo == hi:
        return _other_integers(t, lo, bounds, generator)
    return torch.randint(lo, hi + 1, t.shape, generator=generator, dtype=torch.int64).to(t.dtype)


def _synthetic_floats(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Normal draws with the observed mean and spread; a tensor of one value never gets that value back."""
    x = t.to(torch.complex128 if t.is_complex() else torch.float64)
    finite = x[torch.isfinite(x)]
    mean = finite.mean() if finite.numel() else torch.zeros((), dtype=x.dtype)
    constant = finite.numel() == x.numel() and bool((finite == finite[0]).all())
    std = finite.std() if finite.numel() > 1 and not constant else torch.ones((), dtype=torch.float64)
    std = std.abs() if std.is_complex() else std
    if constant:  # no spread to keep: draw at the value's own scale
        std = torch.clamp(mean.abs().to(torch.float64), min=1.0)
    noise = torch.randn(t.shape, generator=generator, dtype=x.dtype)
    out = (noise * std + mean).to(t.dtype)
    if not constant:
        return out
    back = out.to(x.dtype)  # compared in 64 bits: float8 has no comparisons
    other = -mean if bool(mean != 0) else torch.ones((), dtype=x.dtype)
    return torch.where(back == x, other, back).to(t.dtype)  # rounding may land on the recorded value


def _other_integers(
    t: torch.Tensor, value: int, bounds: tuple[int, int] | None, generator: torch.Generator
) -> torch.Tensor:
    """Integers of ``t``'s shape, none equal to ``value`` (the one value ``t`` holds), within ``bounds`` if it has others."""
    lo, hi = bounds if bounds is not None else (value, value)
    if lo == hi == value:  # nothing else seen: the neighbours the dtype holds
        info = torch.iinfo(t.dtype)
        lo, hi = max(value - 1, info.min), min(value + 1, info.max)
    inside = lo <= value <= hi
    draws = torch.randint(lo, hi + (0 if inside else 1), t.shape, generator=generator, dtype=torch.int64)
    if inside:
        draws = draws + (draws >= value).long()  # [lo, hi] without value
    return draws.to(t.dtype)


def _vocab_size(bundle: Bundle) -> int | None:
    """``vocab_size`` of the model config the bundle stores (a multimodal config's text part too), if any."""
    entry = bundle.manifest.model
    if entry is None:
        return None
    try:
        config = read_stored_config(bundle.root, entry)
    except IobundleError:
        return None  # the model loader says what is wrong with the config; here it only narrows the draws
    for part in (config, config.get("text_config")):
        size = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


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
    rc = recorded_calls(bundle)
    generator = torch.Generator().manual_seed(seed)
    names = rc.names
    inputs: dict[str, str | None] = {}  # tensor key -> the parameter it was passed as
    for entry in rc.value_if_missing:
        name = entry.key if isinstance(entry.key, str) else (names[entry.key] if entry.key < len(names) else None)
        inputs.update((k, inputs.get(k, name)) for k in tensor_keys(entry.value))
    for call in rc.calls:
        for j, a in enumerate(call.args):
            inputs.update((k, inputs.get(k, names[j] if j < len(names) else None)) for k in tensor_keys(a))
        for name, v in call.kwargs.items():
            inputs.update((k, inputs.get(k, name)) for k in tensor_keys(v))
    bounds: dict[str | None, tuple[int, int]] = {}  # per parameter, the integer range over every call
    for key, name in inputs.items():
        t = rc.store.get(key)
        if t.numel() and t.dtype != torch.bool and not (t.is_floating_point() or t.is_complex()):
            lo, hi = int(t.min()), int(t.max())
            old = bounds.get(name, (lo, hi))
            bounds[name] = (min(lo, old[0]), max(hi, old[1]))
    vocab = _vocab_size(bundle)
    tensors: dict[str, torch.Tensor] = {}

    def synthesize(keys: list[str]) -> None:  # in order of first use: the same seed gives the same values
        for key in keys:
            if key not in tensors:
                name = inputs[key]
                span = (0, vocab - 1) if vocab is not None and _is_token_ids(name) else bounds.get(name)
                tensors[key] = synthetic_like(rc.store.get(key), generator, name=name, bounds=span)

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
        call = _redact_error(call).model_copy(update={"state": None})  # module state holds real values
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
        IntegrityError: A model file's size or hash differs from the manifest.
    """
    entry = bundle.manifest.model
    if entry is None:
        raise ModelLoadError(
            f"The bundle '{bundle.path}' stores no model, so there is none to keep. Drop --keep-model (keep_model=True)."
        )
    root = bundle.root
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with Tree(target, error=BundleExistsError) as tree:  # written from checked folders: never through a link
        for name, file in entry.files.items():
            check_file(root, name, file, hash_check=True)
            source, _ = root.open(name)
            with source, os.fdopen(tree.open(name, flags, 0o644, create_folders=True), "wb") as out:
                shutil.copyfileobj(source, out)
    return entry
