"""Module state at replay: the state a call found on the module tree becomes an input, the state it left an output.

A call recorded with ``state`` (``{"in": {path: tensor}, "out": {path: tensor}, "training": {path: bool}}``,
see :class:`~iobundle.schema.CallEntry`) is replayed as a call of :class:`WithModuleState`: the model's
method with one more keyword argument, ``module_state`` (the state in, loaded into the module before
the call; None where the call made it), returning ``(outputs, state out)``, in the recorded training mode.
Export, validation and re-runs take that form, so the exported program takes the state as inputs and
returns what the call leaves, and each call is checked from the state it found. A call recorded before
the state was found (it has none) is not replayed; states in that are all None (a cache built lazily) are no state.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

from iobundle.calls import RecordedCalls
from iobundle.errors import ModelLoadError
from iobundle.schema import CallEntry, ConstNode, DictNode, NoneNode, ParameterEntry, TupleNode

__all__ = ["WithModuleState", "explicit_state", "state_note"]

_SAME = "Replay it with the model the bundle was recorded from."

_LACKING = (
    "recorded before iobundle found the state its module tree keeps between calls, so the call does not carry "
    "it: not replayed (the calls recorded after it carry their state)"
)


def state_note(rc: RecordedCalls) -> str:
    """The export report's line on the module state of the calls ``rc`` recorded."""
    lacking = [call.index for call in rc.ok_calls if call.state is None]
    made = [c.index for c in rc.ok_calls if c.state is not None and any(v.kind == "none" for v in _parts(c)[0].items)]
    note = f"the state the model keeps on its modules is the input {_argument(rc)!r}, returned after the outputs"
    note += f"; calls {lacking} were {_LACKING}" if lacking else ""
    if made:  # None is a constant to torch.export
        note += f"; calls {made} found None where they made the state: a program of their own checks them if need be"
    return note


def _argument(rc: RecordedCalls) -> str:
    """``module_state``, or that name with ``_`` appended until no parameter of the method has it."""
    name, taken = "module_state", set(rc.names)
    while name in taken:
        name += "_"
    return name


def _parts(call: CallEntry) -> list[DictNode]:
    """The state in and out of ``call`` and its training flags (none in a state recorded before them), checked."""
    state = call.state
    named = isinstance(state, DictNode) and state.keys in (["in", "out"], ["in", "out", "training"])
    parts = [*state.items, DictNode(keys=[], items=[])][:3] if named else []  # type: ignore[union-attr]
    dicts = len(parts) == 3 and all(isinstance(p, DictNode) and all(isinstance(k, str) for k in p.keys) for p in parts)
    if not dicts or not all(isinstance(f, ConstNode) and isinstance(f.value, bool) for f in parts[2].items):
        raise ModelLoadError(
            f"calls[{call.index}].state is not {{'in': {{path: tensor}}, 'out': {{path: tensor}}, "
            "'training': {path: bool}}; the bundle is corrupt."
        )
    return parts


def explicit_state(rc: RecordedCalls) -> RecordedCalls:
    """The calls of ``rc``, which carry module state, as calls of :class:`WithModuleState`; ``rc`` itself when no
    call's state in holds a tensor (a cache built lazily, bound where None was, is no state)."""
    name, names = _argument(rc), set(rc.names)
    parts = {call.index: _parts(call) for call in rc.calls if call.state is not None}
    if all(isinstance(v, NoneNode) for state_in, *_ in parts.values() for v in state_in.items):
        return rc
    calls = []
    for call in rc.calls:
        if call.state is None:
            lacking = call.status == "ok"
            calls.append(call.model_copy(update={"status": "incomplete", "error": _LACKING}) if lacking else call)
            continue
        state_in, state_out, _ = parts[call.index]
        kwargs = {k: v for k, v in call.kwargs.items() if k in names}
        kwargs[name] = state_in  # after the named keywords, before those **kwargs collects
        kwargs.update((k, v) for k, v in call.kwargs.items() if k not in names)
        outputs = TupleNode(items=[NoneNode() if call.outputs is None else call.outputs, state_out])
        calls.append(call.model_copy(update={"kwargs": kwargs, "outputs": outputs, "state": None}))
    parameters = [p for p in rc.signature.parameters if p.kind != "VAR_KEYWORD"]
    parameters.append(ParameterEntry(name=name, kind="KEYWORD_ONLY", has_default=True))
    parameters += [p for p in rc.signature.parameters if p.kind == "VAR_KEYWORD"]
    signature = rc.signature.model_copy(update={"method": "forward", "parameters": parameters})
    return RecordedCalls(signature=signature, calls=calls, store=rc.store, value_if_missing=list(rc.value_if_missing))


def _tables(modules: dict[str, torch.nn.Module], paths: list[str]) -> list[tuple[dict[str, Any], str]]:
    """Where each recorded ``model.<module path>.<name>`` lives: a buffer or tensor attribute of one of ``modules``
    (or a public buffer or attribute holding None, bound by the first call).

    Paths come from the bundle: they are looked up among ``named_modules()`` and the tables of the
    module found, never followed as attributes.
    """
    places = []
    for path in paths:
        prefix, _, name = path.rpartition(".")
        tables = (modules[prefix]._buffers, modules[prefix].__dict__) if prefix in modules else ()
        table = next((t for t in tables if isinstance(t.get(name), torch.Tensor)), None)
        if table is None and not name.startswith("_"):  # None until the first call binds the state there
            table = next((t for t in tables if name in t and t[name] is None), None)
        if table is None:
            raise ModelLoadError(
                f"The bundle records module state at {path!r}, but the model has no buffer or tensor attribute there "
                f"(nor a public buffer or attribute holding None, where a first call binds it). {_SAME}"
            )
        places.append((table, name))
    return places


class WithModuleState(torch.nn.Module):
    """``model.<method>`` that takes the module state in (``module_state``) and returns ``(outputs, state out)``.

    Made from the recorded calls (before :func:`explicit_state`). The state in is copied into the
    module for the call, run with the training flags of the first call that recorded them; the
    module's own tensors and flags are put back after it.
    """

    def __new__(cls, model: torch.nn.Module, rc: RecordedCalls) -> WithModuleState:
        signature, name = inspect.signature(getattr(model, rc.signature.method)), _argument(rc)

        def forward(self: WithModuleState, *args: Any, **kwargs: Any) -> Any:
            return self.run(args, kwargs.pop(name, None) or {}, kwargs)  # without it: from the model's own state

        params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None))
        params += [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
        params.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD))
        forward.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return super().__new__(type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__}))

    def __init__(self, model: torch.nn.Module, rc: RecordedCalls) -> None:
        super().__init__()
        self.model = model
        self.method = rc.signature.method
        parts = [_parts(call) for call in rc.calls if call.state is not None]
        paths = list(dict.fromkeys(str(path) for part in parts for path in (*part[0].keys, *part[1].keys)))
        modules = dict(model.named_modules(prefix="model"))
        modes = next((dict(zip(p[2].keys, p[2].items)) for p in parts if p[2].keys), {})
        if unknown := [path for path in modes if path not in modules]:
            raise ModelLoadError(
                f"The bundle records training flags of modules the model lacks ({unknown[:4]}). {_SAME}"
            )
        training = [(modules[str(path)], flag.value) for path, flag in modes.items()]  # type: ignore[union-attr]
        self.places = SimpleNamespace(at=dict(zip(paths, _tables(modules, paths))), training=training)  # leaves

    def run(self, args: tuple[Any, ...], state: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> Any:
        places = self.places.at
        kept = [(table, name, table[name]) for table, name in places.values()]
        flags = [(m, m.training) for m in self.model.modules()] if self.places.training else []
        try:
            for module, flag in self.places.training:
                module.train(flag)
            for path, value in state.items():
                table, name = places[path]
                table[name] = value if value is None else value.clone()
            outputs = getattr(self.model, self.method)(*args, **kwargs)
            return outputs, {path: table[name] for path, (table, name) in places.items()}
        finally:
            for table, name, value in kept:
                table[name] = value
            for module, flag in flags:
                module.training = flag
