"""A griffe extension (``extensions:`` of mkdocstrings in mkdocs.yml): the API pages show the tolerance keywords.

griffe reads signatures from the source, where a function decorated with
``iobundle.replay.check.tolerance_options`` lists only ``tolerances``: the keywords it takes
(``atol``, ``rtol``, ``output_atol``, ...) are added by the decorator. For those functions this
extension takes the signature and the docstring from the decorated object itself (its
``__signature__`` and ``__doc__``, which name the keywords), so the page shows what a caller may pass.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

DECORATOR = "tolerance_options"


def _runtime_object(func: griffe.Function) -> Any:
    obj: Any = importlib.import_module(func.module.path)
    for part in func.path[len(func.module.path) + 1 :].split("."):
        obj = getattr(obj, part)
    return obj


def _text(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


class ToleranceOptions(griffe.Extension):
    """Signature and docstring of the functions ``tolerance_options`` decorates, from the decorated object."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if not any(DECORATOR in str(d.value) for d in func.decorators):
            return
        obj = _runtime_object(func)
        parsed = {p.name: p for p in func.parameters}
        parameters = []
        for p in inspect.signature(obj).parameters.values():
            kind = griffe.ParameterKind(p.kind.description)
            default = None if p.default is inspect.Parameter.empty else repr(p.default)
            known = parsed.get(p.name)
            if known is not None and known.kind == kind and known.default == default:
                parameters.append(known)  # as griffe read it, cross-references included
            else:
                parameters.append(griffe.Parameter(p.name, annotation=_text(p.annotation), kind=kind, default=default))
        func.parameters = griffe.Parameters(*parameters)
        if func.docstring is not None and obj.__doc__:
            func.docstring.value = inspect.cleandoc(obj.__doc__)
