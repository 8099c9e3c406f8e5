"""``torch.export`` arguments from aligned calls: stand-ins for None slots, the chosen call, removed inputs."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from iobundle._lazy import lazy_module
from iobundle.calls import (
    RecordedCalls,
    build_value,
    positional_names,
    replace_tensors,
    restore_token_counts,
)
from iobundle.errors import AlignmentError, InputSelectionError
from iobundle.replay.infer._align import Alignment, _is_absent, align_calls
from iobundle.replay.infer._dynamic import _fill_tensor, empty_dims, flat_dynamic_dims
from iobundle.schema import (
    CallEntry,
    Node,
    TensorNode,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def aligned_tensors(
    rc: RecordedCalls, alignment: Alignment, slots: list[str | None], extra: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The tensors of one aligned call, absent ones replaced by stand-ins (see :func:`_fill_tensor`)."""
    dims: list[list[int]] | None = None
    empty: list[int | None] = []
    result = []
    for index, key in enumerate(slots):
        if key is not None:
            result.append(extra[key] if extra and key in extra else rc.store.get(key))
            continue
        if dims is None:
            dims = flat_dynamic_dims(rc, alignment)
            empty = empty_dims(alignment)
        result.append(_fill_tensor(rc, alignment, index, dims[index], empty[index]))
    return result


def placeholder_inputs(alignment: Alignment, call: CallEntry, slots: list[str | None]) -> list[int | str]:
    """Inputs of ``call`` that were absent at capture and are fed a stand-in (empty tensor, zeros, placeholder).

    The model never saw those values: when such a call differs, it is reported as not checked
    rather than as a numeric mismatch (an empty stand-in for an absent cache usually matches;
    one for an absent mask usually does not).
    """
    owners = [alignment.owners[i] for i, key in enumerate(slots) if key is None]
    return list(dict.fromkeys([*call.filled, *owners]))


def _rebuild(rc: RecordedCalls, best: CallEntry, tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
    local = {f"\x00{i}": t for i, t in enumerate(tensors)}
    fresh: Iterator[Node] = (TensorNode(key=k) for k in local)
    args_nodes = [replace_tensors(a, fresh) for a in best.args]
    kwargs_nodes = {k: replace_tensors(v, fresh) for k, v in best.kwargs.items()}
    get = local.__getitem__
    args = [build_value(n, get, path=f"args[{i}]") for i, n in enumerate(args_nodes)]
    kwargs = {k: build_value(n, get, path=k) for k, n in kwargs_nodes.items()}
    return args, kwargs


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied into a storage of its own if it views a larger one (a bundle's memory-mapped file).

    Arguments handed to the user or to ``torch.export`` must not share one storage: ``torch.save``
    refuses views of one buffer as different dtypes, and torch.export bounds dynamic sizes by the
    storage a tensor views (a batch capped at what the file happens to hold).
    """
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def select_call(alignment: Alignment) -> int:
    """The call infer_arguments uses by default: the first laid out exactly like the best call."""
    best = alignment.best_call
    for i, call in enumerate(alignment.calls):
        if len(call.args) == len(best.args) and len(call.kwargs) == len(best.kwargs):
            return i
    return alignment.best


def infer_arguments(
    rc: RecordedCalls,
    index: int | None = None,
    *,
    flat: bool = False,
    as_args_kwargs: bool = False,
    alignment: Alignment | None = None,
    slots: list[str | None] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Build arguments for ``torch.export.export`` from one recorded call (absent inputs filled).

    Args:
        rc: The recorded calls.
        index: Which ok call to use; by default the first call laid out like the best call.
        flat: Return the flat list of tensors instead of the nested structure.
        as_args_kwargs: Always return ``(args, kwargs)``.
        alignment: A precomputed alignment.
        slots: Aligned tensor keys to use instead of a recorded call's.
        extra: Tensors for keys of ``slots`` that ``rc.store`` does not hold.

    Raises:
        AlignmentError: ``index`` is out of range, or the arguments cannot be laid out as asked.
    """
    alignment = alignment or align_calls(rc)
    if slots is None:
        if index is None:
            index = select_call(alignment)
        if not -len(alignment.calls) <= index < len(alignment.calls):
            raise AlignmentError(f"No recorded call {index}: there are {len(alignment.calls)} successful calls.")
        slots = alignment.slots[index]
    tensors = [_own_storage(t) for t in aligned_tensors(rc, alignment, slots, extra)]
    if flat:
        return tensors
    best = alignment.best_call
    args, kwargs = _rebuild(rc, best, tensors)
    kwargs = {**kwargs, **best.cst_kwargs}
    restore_token_counts({**dict(zip(rc.names, args)), **kwargs})  # rebuilt sliding layers: tokens seen
    if as_args_kwargs:
        return tuple(args), kwargs
    if not kwargs:
        return tuple(args)
    if not args:
        return kwargs
    if rc.var_positional:
        raise AlignmentError(
            f"The arguments cannot be returned as one tuple or one dict because of *{rc.var_positional[0]} in "
            "the signature. Call infer_arguments(as_args_kwargs=True)."
        )
    return {**dict(zip(rc.names, args)), **kwargs}


def remove_inputs(rc: RecordedCalls, names: Collection[str]) -> int:
    """Remove the named inputs from every recorded call, as ``Bundle.remove_inputs`` says; return how many.

    A positional argument followed by others in a call moves those to keywords.
    """
    names = set(names)
    params = set(rc.names)
    unknown = sorted(
        n for n in names if n not in params and not any(n in c.kwargs or n in c.cst_kwargs for c in rc.calls)
    )
    if unknown:
        warnings.warn(
            f"remove_inputs: {unknown} are neither parameters of {rc.signature.method} nor recorded inputs; "
            "nothing was removed for them. Check the spelling against the signature.",
            UserWarning,
            stacklevel=3,
        )
    pos_names = list(positional_names(rc.signature))
    var = rc.var_positional
    new_calls = []
    removed = 0
    for call in rc.calls:
        removed += sum(1 for k in call.kwargs if k in names) + sum(1 for k in call.cst_kwargs if k in names)
        removed += sum(1 for n, a in zip(pos_names, call.args) if n in names and not _is_absent(a))
        if var is not None and var[0] in names:
            removed += max(0, len(call.args) - var[1])
        args = list(call.args)
        kwargs = {k: v for k, v in call.kwargs.items() if k not in names}
        cst = {k: v for k, v in call.cst_kwargs.items() if k not in names}
        if var is not None and var[0] in names:
            args = args[: var[1]]
        cut = [i for i, n in enumerate(pos_names[: len(args)]) if n in names]
        if cut:
            first = cut[0]
            if len(args) > len(pos_names):
                raise InputSelectionError(
                    f"remove_inputs({sorted(names)}): call {call.index} passes positional arguments after "
                    f"{pos_names[first]!r} that belong to *{var[0] if var else 'args'}; they cannot become keywords. "
                    f"Remove *{var[0] if var else 'args'} too, or record calls that pass {pos_names[first]!r} by name."
                )
            moved = {}
            for i in range(first, len(args)):
                param = rc.parameter(pos_names[i])
                if pos_names[i] in names:
                    continue
                if param is not None and param.kind == "POSITIONAL_ONLY":
                    raise InputSelectionError(
                        f"remove_inputs: {pos_names[i]!r} is positional-only and follows a removed argument."
                    )
                moved[pos_names[i]] = args[i]
            args = args[:first]
            kwargs = {**moved, **kwargs}
            order = {n: i for i, n in enumerate(rc.names)}
            kwargs = dict(sorted(kwargs.items(), key=lambda kv: order.get(kv[0], len(order))))
        filled = [f for f in call.filled if f not in names]
        new_calls.append(call.model_copy(update={"args": args, "kwargs": kwargs, "cst_kwargs": cst, "filled": filled}))
    rc.calls = new_calls
    rc.value_if_missing = [v for v in rc.value_if_missing if v.key not in names]
    rc.touch()
    return removed


def received_arguments(
    rc: RecordedCalls,
    call: CallEntry,
    device: str | torch.device | None = None,
    *,
    replace: dict[str, torch.Tensor] | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments the model received in ``call``, to call the eager model with (``run``, the export check).

    Fresh copies (the model may change its inputs in place; the store is read-only), moved to
    ``device`` when given; the placeholders the observer filled in for absent inputs
    (``value_if_missing``) are left out, as the model never saw them; constants included.
    ``replace`` gives tensors to use instead of the stored ones, by key (a call cut to another batch).
    """

    def tensor(key: str) -> torch.Tensor:
        t = (replace[key] if replace is not None and key in replace else rc.store.get(key)).clone()
        return t.to(device) if device is not None else t

    names = list(positional_names(rc.signature))
    args = []
    for i, node in enumerate(call.args):
        filled = i in call.filled or (i < len(names) and names[i] in call.filled)
        args.append(None if filled else build_value(node, tensor, path=f"args[{i}]"))
    kwargs = {k: build_value(v, tensor, path=k) for k, v in call.kwargs.items() if k not in call.filled}
    kwargs.update(call.cst_kwargs)
    restore_token_counts({**dict(zip(names, args)), **kwargs})  # rebuilt sliding layers: tokens seen
    return args, kwargs


def spread_var_keyword(mapping: dict[str, Any], var_keyword: str | None) -> dict[str, Any]:
    """``mapping`` with the entries under ``**var_keyword`` spread among the others (``{**rest, **mapping[var_kw]}``)."""
    if not var_keyword or var_keyword not in mapping:
        return mapping
    return {**{k: v for k, v in mapping.items() if k != var_keyword}, **mapping[var_keyword]}
