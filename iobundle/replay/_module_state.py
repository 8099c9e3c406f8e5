"""Module state at replay: the state a call found on the module tree becomes an input, the state it left an output.

A call recorded with ``state`` (``{"in": {path: tensor}, "out": {path: tensor}}``, see
:class:`~iobundle.schema.CallEntry`) is replayed as a call of :class:`WithModuleState`: the model's
method with one more keyword argument, ``module_state`` (the state in, loaded into the module before
the call), returning ``(outputs, state out)``. Export, validation and re-runs take that form, so the
exported program takes the state as inputs and returns what the call leaves, and each call is
checked from the state it found. A call recorded before the state was found (it has none) is not replayed.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

from iobundle.calls import RecordedCalls
from iobundle.errors import ModelLoadError
from iobundle.schema import CallEntry, DictNode, NoneNode, ParameterEntry, TupleNode

__all__ = ["WithModuleState", "explicit_state", "state_note"]

_LACKING = (
    "recorded before iobundle found the state its module tree keeps between calls, so the call does not carry "
    "it: not replayed (the calls recorded after it carry their state)"
)


def state_note(rc: RecordedCalls) -> str:
    """The export report's line on the module state of the calls ``rc`` recorded."""
    lacking = [call.index for call in rc.ok_calls if call.state is None]
    return f"the state the model keeps on its modules is the input {_argument(rc)!r}, returned after the outputs" + (
        f"; calls {lacking} were {_LACKING}" if lacking else ""
    )


def _argument(rc: RecordedCalls) -> str:
    """``module_state``, or that name with ``_`` appended until no parameter of the method has it."""
    name, taken = "module_state", set(rc.names)
    while name in taken:
        name += "_"
    return name


def _parts(call: CallEntry) -> list[DictNode]:
    """The state in and out of ``call``, checked: ``{"in": {path: ...}, "out": {path: ...}}``."""
    state = call.state
    named = isinstance(state, DictNode) and state.keys == ["in", "out"]
    parts = [p for p in state.items if isinstance(p, DictNode)] if named else []  # type: ignore[union-attr]
    if not (len(parts) == 2 and all(isinstance(k, str) for p in parts for k in p.keys)):
        raise ModelLoadError(
            f"calls[{call.index}].state is not {{'in': {{path: tensor}}, 'out': {{path: tensor}}}}; the bundle is corrupt."
        )
    return parts


def explicit_state(rc: RecordedCalls) -> RecordedCalls:
    """The calls of ``rc``, which carry module state, as calls of :class:`WithModuleState`."""
    name, names = _argument(rc), set(rc.names)
    calls = []
    for call in rc.calls:
        if call.state is None:
            lacking = call.status == "ok"
            calls.append(call.model_copy(update={"status": "incomplete", "error": _LACKING}) if lacking else call)
            continue
        state_in, state_out = _parts(call)
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


def _tables(model: torch.nn.Module, paths: list[str]) -> list[tuple[dict[str, Any], str]]:
    """Where each recorded ``model.<module path>.<name>`` lives: a buffer or tensor attribute of a module of ``model``
    (or a public attribute holding None, bound by the first call).

    Paths come from the bundle: they are looked up among ``named_modules()`` and the tables of the
    module found, never followed as attributes.
    """
    modules = dict(model.named_modules(prefix="model"))
    places = []
    for path in paths:
        prefix, _, name = path.rpartition(".")
        module = modules.get(prefix)
        table = None
        if module is not None:
            table = next((t for t in (module._buffers, module.__dict__) if isinstance(t.get(name), torch.Tensor)), None)
            if table is None and not name.startswith("_") and name in module.__dict__ and module.__dict__[name] is None:
                table = module.__dict__  # None until the first call binds the state there (a lazily made hidden state)
        if table is None:
            raise ModelLoadError(
                f"The bundle records module state at {path!r}, but the model has no buffer or tensor attribute there "
                "(nor a public attribute holding None, where a first call binds it). "
                "Replay it with the model the bundle was recorded from."
            )
        places.append((table, name))
    return places


class WithModuleState(torch.nn.Module):
    """``model.<method>`` that takes the module state in (``module_state``) and returns ``(outputs, state out)``.

    Made from the recorded calls (before :func:`explicit_state`). The state in is copied into the
    module for the call; the module's own tensors are put back after it.
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
        parts = [part for call in rc.calls if call.state is not None for part in _parts(call)]
        paths = list(dict.fromkeys(str(path) for part in parts for path in part.keys))
        self.places = SimpleNamespace(at=dict(zip(paths, _tables(model, paths))))  # a leaf to torch.export

    def run(self, args: tuple[Any, ...], state: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> Any:
        places = self.places.at
        kept = [(table, name, table[name]) for table, name in places.values()]
        try:
            for path, value in state.items():
                table, name = places[path]
                table[name] = value if value is None else value.clone()
            outputs = getattr(self.model, self.method)(*args, **kwargs)
            return outputs, {path: table[name] for path, (table, name) in places.items()}
        finally:
            for table, name, value in kept:
                table[name] = value
