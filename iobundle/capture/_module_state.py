"""``StateWatch``: the tensors (and numbers) of an observed module tree that a recorded call changes (state the calls do not carry)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from iobundle.schema import ConstNode, DictNode

__all__ = ["StateWatch", "state_message"]

_COPIED_BYTES = 1 << 20  # a buffer or attribute up to this size is copied before a watched call, to compare values


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no version counter: only its identity is compared
        return None


_Place = tuple[str, dict[str, Any], str]  # module path, the table holding the name, the name
_NUMBERS = frozenset({int, float})  # attributes of these types are watched too: state iobundle cannot record
# What places held at a moment: the places, their values, and by index of a tensor its version and a copy
_Held = tuple[list[_Place], list[Any], dict[int, int | None], dict[int, torch.Tensor]]
_VERSION = operator.attrgetter("_version")
_FIXED_NUMBERS = frozenset(
    {
        torch.nn.Linear,
        torch.nn.Conv1d,
        torch.nn.Conv2d,
        torch.nn.Conv3d,
        torch.nn.LayerNorm,
        torch.nn.GroupNorm,
        torch.nn.RMSNorm,
        torch.nn.Dropout,
        torch.nn.Identity,
    }
)
"""torch.nn's layers whose forward sets no attribute: their numbers (``in_features``, ``eps``, ``p``) are not
watched, only their tensors (14 of the 24 numbers a layer of a Llama holds, each read four times per
``generate()``). Exact types only: a subclass's forward may keep a counter."""


class _Known(NamedTuple):
    """Where a module tree holds tensors and numbers (:func:`_places`), with the columns a watched call reads."""

    places: list[_Place]
    numbers: list[_Place]
    tables: list[dict[str, Any]]
    modes: dict[str, bool]
    place_tables: list[dict[str, Any]]  # each place's table and name, as two columns: read with map(dict.get)
    place_names: list[str]
    number_tables: list[dict[str, Any]]
    number_names: list[str]
    copyable: list[int]  # the places outside a parameters table: what a watched call copies up to _COPIED_BYTES


def _places(model: torch.nn.Module) -> _Known:
    """Where the tree holds tensors (parameters, buffers, tensor or None attributes) and numbers, and the
    tables that hold them (for :func:`_sizes`): 1.5-6 ms for a 32-layer tiny Llama (420 modules, 8,500
    attributes); walked when the block is entered, and again after a watched call that added attributes,
    parameters, buffers or submodules. Last, the training flag of the root and of each module whose flag differs
    from its parent's, by path, in the tree's order."""
    places: list[_Place] = []
    numbers: list[_Place] = []
    tables: list[dict[str, Any]] = []
    copyable: list[int] = []
    for prefix, module in model.named_modules(prefix="model"):
        attributes = module.__dict__
        tables += (attributes, attributes["_parameters"], attributes["_buffers"], attributes["_modules"])
        for name, value in attributes.items():
            if value is None or isinstance(value, torch.Tensor):  # None: a tensor may be bound there later
                copyable.append(len(places))
                places.append((prefix, attributes, name))
            elif type(value) in _NUMBERS and type(module) not in _FIXED_NUMBERS:
                numbers.append((prefix, attributes, name))
        places.extend((prefix, attributes["_parameters"], name) for name in attributes["_parameters"])
        copyable.extend(range(len(places), len(places) + len(attributes["_buffers"])))
        places.extend((prefix, attributes["_buffers"], name) for name in attributes["_buffers"])
    modes, flags = {"model": model.training}, {}
    if any(t.get("training") is not model.training for t in tables[::4]):  # mixed (rare): walked again for paths
        for prefix, module in model.named_modules(prefix="model"):
            flags[prefix] = flag = module.training
            if flag != flags.get(prefix.rpartition(".")[0], flag):
                modes[prefix] = flag
    return _Known(
        places,
        numbers,
        tables,
        modes,
        [table for _, table, _ in places],
        [name for _, _, name in places],
        [table for _, table, _ in numbers],
        [name for _, _, name in numbers],
        copyable,
    )


def _sizes(tables: list[dict[str, Any]]) -> list[int]:
    """How many entries each table of :func:`_places` holds: what tells a new place (0.03 ms at 32 layers)."""
    return list(map(len, tables))


def _hold(known: _Known, copy: bool = False) -> _Held:
    """What the places of ``known`` hold now; with ``copy``, buffers and attributes up to ``_COPIED_BYTES`` are
    copied too.

    Lists by place, not a dictionary by path: a watched call compares about a thousand places at 32 layers
    (read with ``map`` over the place's table and name: 22 µs, where a comprehension over the places took 33).
    """
    values: list[Any] = list(map(dict.get, known.place_tables, known.place_names))
    present = [i for i, value in enumerate(values) if value is not None]  # most places hold None
    try:  # a tensor at every place that holds something: read at once
        versions: dict[int, int | None] = dict(zip(present, map(_VERSION, map(values.__getitem__, present))))
    except (AttributeError, RuntimeError):  # a place holds something else now, or an inference tensor
        versions = {i: _version(values[i]) for i in present if isinstance(values[i], torch.Tensor)}
    copies: dict[int, torch.Tensor] = {}
    if copy:
        parameter = torch.nn.Parameter
        for i in known.copyable:  # a parameter is never copied: most places are skipped unread
            value = values[i]
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, parameter)
                and value.numel() * value.element_size() <= _COPIED_BYTES
            ):
                copies[i] = value.detach().clone()
    return known.places, values, versions, copies


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    except Exception:  # a tensor that cannot be compared (a subclass, a meta tensor) counts as changed
        return False


class StateWatch:
    """Compares the tensors a module tree holds before and after its first ``calls`` recorded calls.

    A tensor rebound to other values (``self.h = new_h``) or changed in place (``self.h.copy_(...)``,
    ``self.count += 1`` on a buffer) is state kept between calls. Not state: a tensor rebound or
    rewritten in place to the values it had (a table recomputed each call the same way, as longrope's
    ``inv_freq``; only buffers and attributes up to 1 MiB are copied to tell), and a tensor the call
    adds (a cache built lazily; a later watched call that changes it is state). Changes made without
    the version counter (through ``.data``, in place to an inference tensor, BatchNorm's running statistics)
    are not seen. A tensor bound where None was (:attr:`bound`: a state the call made, or a cache) is that
    call's state out, None its state in. Numbers
    (``int`` and ``float`` attributes, as a step counter; not those of torch's own layers in
    ``_FIXED_NUMBERS``) the calls change are noted too: state that cannot be recorded.
    """

    def __init__(self, model: Any, calls: int = 2) -> None:
        self._model, self._left = model, calls if isinstance(model, torch.nn.Module) else 0
        # where the tree holds tensors and numbers: walked here (when the block is entered, not inside
        # the first call), then again after the first watched call (a tensor it built lazily)
        self._known: _Known | None = None
        self._sizes: list[int] | None = None
        if self._left:
            try:
                self._known = _places(model)
                self._sizes = _sizes(self._known.tables)
            except Exception:  # observation never breaks the observed program: the first call walks it
                pass
        self.found: dict[str, _Place] = {}  # the state, by path, once a watched call changed it
        self.first_in: dict[str, torch.Tensor | None] | None = None  # the state before that call, when all was kept
        self.bound: dict[str, _Place] = {}  # before the state is found, the places the last watched call bound
        self.numbers: list[str] = []  # the numbers (int, float attributes) the last watched call changed

    def now(self) -> dict[str, Any]:
        """What the module tree holds where the state was found, else where the last watched call bound a tensor
        where None was (a tensor, unless the model rebound it)."""
        return {path: table.get(name) for path, (_, table, name) in (self.found or self.bound).items()}

    def training(self) -> DictNode:
        """The training flags of the walk when the block was entered, or the root's alone once it changed
        (``train()`` and ``eval()`` set the whole tree): O(1) per call."""
        flag, modes = self._model.training, self._known.modes if self._known is not None else {}
        modes = modes if modes.get("model") == flag else {"model": flag}
        return DictNode(keys=list(modes), items=[ConstNode(value=v) for v in modes.values()])

    def before(self) -> tuple[_Held, _Known, list[Any]] | None:
        """The tensors and numbers before a call, for ``changed``; None once the watched calls are spent."""
        if self._left <= 0:
            return None
        self._left -= 1
        try:
            known = self._known if self._known is not None else _places(self._model)
            return _hold(known, copy=True), known, list(map(dict.get, known.number_tables, known.number_names))
        except Exception:  # observation never breaks the observed program
            return None

    def changed(self, held: tuple[_Held, _Known, list[Any]], carried: Callable[[Any], bool]) -> list[str]:
        """The paths of the tensors held before whose values the call changed, but those ``carried`` as inputs.

        The first call that changes some sets :attr:`found`, and :attr:`first_in` if their values before it were
        kept. Numbers the call changed are set in :attr:`numbers`.
        """
        (before, walked, numbers_before), paths, first_in, bound = held, [], {}, []
        try:
            if self._known is None or _sizes(self._known.tables) != self._sizes:  # a place added (a tensor built lazily)
                self._known = _places(self._model)
                self._sizes = _sizes(self._known.tables)
            known = self._known
            after = _hold(known)
            now = list(map(dict.get, walked.number_tables, walked.number_names, numbers_before))
            self.numbers = (
                []
                if all(map(operator.is_, now, numbers_before))  # most calls: every number the object it was
                else [
                    f"{prefix}.{name}"
                    for (prefix, _, name), value, new in zip(walked.numbers, numbers_before, now)
                    if new is not value and (type(new) is not type(value) or new != value)
                ]
            )
        except Exception:
            return []
        for key, tensor, old, values in _moved(before, after):
            if old is None:
                bound.append(key)  # bound where None was
                continue
            if carried(old) and ".".join(key) not in self.bound:  # not state this watch recorded itself
                continue  # passed to the call (a static cache the model holds too)
            # compared with its values before the call: its copy, or the tensor it was before it was rebound
            reference = values if values is not None else None if tensor is old else old
            if reference is None or not _equal(tensor, reference):
                paths.append(".".join(key))
                first_in[key] = reference
        places = {(p, n): (p, t, n) for p, t, n in known.places} if bound or (paths and not self.found) else {}
        self.bound = {".".join(key): places[key] for key in bound}
        if paths and not self.found:
            self.found = {".".join(key): places[key] for key in first_in} | self.bound
            kept = {".".join(key): t for key, t in first_in.items() if t is not None}
            self.first_in = kept | dict.fromkeys(self.bound) if len(kept) == len(first_in) else None
        return paths


def _moved(before: _Held, after: _Held) -> list[tuple[tuple[str, str], torch.Tensor, Any, Any]]:
    """``(path, tensor now, value before, its copy)`` for each place holding a tensor that was rebound, changed in
    place or bound where None was between ``before`` and ``after``; a tensor the call added is not listed."""
    places, values, versions, copies = before
    now_places, now_values, now_versions, _ = after
    if now_places is places and now_versions == versions and all(map(operator.is_, now_values, values)):
        return []  # most calls: every place holds what it held, unchanged
    if now_places is places:  # the same places: compared by position, most of them None or untouched
        indices = [
            i for i, version in now_versions.items() if now_values[i] is not values[i] or versions.get(i) != version
        ]
        index: dict[int, int | None] = dict(zip(indices, indices))
    else:  # places were added: matched by path
        at = {(prefix, name): i for i, (prefix, _, name) in enumerate(places)}
        index = {j: at.get((prefix, name)) for j, (prefix, _, name) in enumerate(now_places) if j in now_versions}
    moved = []
    for j, i in index.items():
        tensor, version = now_values[j], now_versions[j]
        old = None if i is None else values[i]
        if i is None or (old is not None and (i not in versions or (old is tensor and versions[i] == version))):
            continue  # added by the call, or untouched
        moved.append(((now_places[j][0], now_places[j][2]), tensor, old, copies.get(i)))
    return moved


def _names(paths: Sequence[str]) -> str:
    return ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def state_message(paths: list[str], what: Any, numbers: Sequence[str] = ()) -> str:
    """The warning for the state ``paths`` (tensors) and ``numbers`` (not recorded) that calls of ``what`` change."""
    message = f"iobundle: a call of {what} changed "
    if paths:
        message += (
            f"tensors its module tree keeps between calls ({_names(paths)}). Each recorded call now records them "
            "too, as it found and left them (the call's state); replay loads them into the module before each call, "
            "and the exported program takes them as the input 'module_state' and returns them after the outputs. "
            "Calls recorded before this one lack them and are not replayed."
        )
    if numbers:
        message += (" It also changed " if paths else "") + (
            f"numbers its module tree keeps between calls ({_names(numbers)}), which iobundle cannot record: "
            "replayed from the bundle, each call sees the values the model holds then, and outputs that depend "
            "on them differ. Keep such state in a tensor (a buffer) to have it recorded with each call."
        )
    return message
