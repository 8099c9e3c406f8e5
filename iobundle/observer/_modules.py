"""``observe_modules``: observe several modules of one model in one capture; save one bundle per module."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from iobundle._remote import join_url, local_path
from iobundle.errors import BundleExistsError, ObserverArgumentError
from iobundle.observer._observer import InputObserver
from iobundle.schema import Manifest

__all__ = ["ModuleObservers", "observe_modules"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def _bundle(directory: str | os.PathLike[str], name: str) -> str:
    return join_url(os.fspath(directory), f"{name}.iobundle")


class ModuleObservers(dict[str, InputObserver]):
    """The :class:`InputObserver` of each module of an :func:`observe_modules` block, by name; ``model`` holds them."""

    def __init__(self, model: torch.nn.Module, names: Mapping[str, Any]) -> None:
        super().__init__((name, InputObserver()) for name in names)
        self.model = model

    def save(
        self, directory: str | os.PathLike[str], *, overwrite: bool = False, include_model: bool = True
    ) -> dict[str, Manifest]:
        """Write a bundle per module, ``directory/<name>.iobundle``; return their manifests by name.

        With ``include_model`` each bundle stores the whole model and the path of its module inside
        it, so ``iobundle export directory/<name>.iobundle --from-bundle`` exports that module alone.
        What is refused is refused before anything is written.

        Args:
            directory: The folder (or URL) of the bundles; created if missing.
            overwrite: Replace the bundles there.
            include_model: Store the model (a transformers model) in each bundle; False: the calls alone.

        Raises:
            BundleExistsError: A local bundle's directory is not empty and ``overwrite`` is False.
            ObserverArgumentError: The model cannot be stored (not a transformers model, quantized).
        """
        targets = {name: _bundle(directory, name) for name in self}
        for path in filter(None, map(local_path, targets.values())):
            if not overwrite and path.is_dir() and any(path.iterdir()):
                raise BundleExistsError(
                    f"'{path}' is not empty. Pass overwrite=True to replace it, or another directory."
                )
        manifests = {}
        for name, observer in self.items():
            try:
                manifests[name] = observer.save(
                    targets[name], overwrite=overwrite, include_model=self.model if include_model else False
                )
            except ObserverArgumentError as exc:  # the first save checks the model before writing anything
                raise ObserverArgumentError(
                    f"Cannot store the model in '{targets[name]}': {exc} To keep the calls alone: save(directory, "
                    "include_model=False), then export each bundle with --model MODULE:FACTORY."
                ) from exc
        return manifests


@contextlib.contextmanager
def observe_modules(
    model: torch.nn.Module,
    modules: Mapping[str, torch.nn.Module | Callable[..., Any]],
    *,
    store_n_calls: int | Mapping[str, int] = 3,
    stream_to: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> Iterator[ModuleObservers]:
    """Observe several modules of ``model`` in one ``with`` block, an :class:`InputObserver` each.

    For a model whose ``generate()`` runs its parts itself: a VLM encodes the images before the
    prefill, an encoder-decoder model runs its encoder before the decoder steps. Each is observed
    as ``InputObserver()(module, n, method_name)`` would; every method is restored on exit, even on error.

    Args:
        model: The model that holds the modules (or is one of them).
        modules: By a name that becomes the bundle's file name, a module (its ``forward``) or a
            method of one: ``{"vision": model.model.get_image_features, "text": model}``.
        store_n_calls: How many calls of each to record; or a number per name.
        stream_to: A folder (or URL) to stream each module's calls to, as ``<name>.iobundle``.
        overwrite: Replace what ``stream_to`` holds.

    Yields:
        The observers by name; ``save(directory)`` writes a bundle per module.

    Raises:
        ObserverArgumentError: A name is not a plain file name, a module is not inside ``model``,
            a method is given twice, or ``store_n_calls`` lacks a name.

    Example:
        >>> modules = {"vision": model.model.get_image_features, "text": model}
        >>> with torch.no_grad(), observe_modules(model, modules, store_n_calls=16) as observers:
        ...     model.generate(**inputs, max_new_tokens=15)
        >>> observers.save("vlm")  # vlm/vision.iobundle, vlm/text.iobundle
    """
    counts = store_n_calls if isinstance(store_n_calls, Mapping) else dict.fromkeys(modules, store_n_calls)
    targets = _targets(model, modules, counts)
    observers = ModuleObservers(model, targets)
    with contextlib.ExitStack() as stack:
        for name, (module, method) in targets.items():
            target = None if stream_to is None else _bundle(stream_to, name)
            stack.enter_context(observers[name](module, counts[name], method, stream_to=target, overwrite=overwrite))
        yield observers


def _targets(model: Any, modules: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, tuple[Any, str]]:
    """Each name's module and method; refuses a name that is not a file name, a module outside ``model``, ..."""
    inside = {id(m) for m in model.modules()} if isinstance(model, torch.nn.Module) else set()
    targets: dict[str, tuple[Any, str]] = {}
    for name, value in modules.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ObserverArgumentError(
                f"observe_modules: the name {name!r} becomes the file name {name}.iobundle; use letters, "
                "digits, '_', '-' and '.' (not first)."
            )
        module = value if isinstance(value, torch.nn.Module) else getattr(value, "__self__", None)
        method = "forward" if module is value else getattr(value, "__name__", "")
        if id(module) not in inside:
            raise ObserverArgumentError(
                f"observe_modules: modules[{name!r}] (a {type(value).__name__}) is neither a module of the "
                f"{type(model).__name__} given as model nor a method of one. Pass model.model.visual, "
                "model.model.get_image_features or the model."
            )
        twice = next((other for other, target in targets.items() if target == (module, method)), None)
        if twice is not None:
            raise ObserverArgumentError(
                f"observe_modules: modules[{twice!r}] and modules[{name!r}] are the same {method}; observe it once."
            )
        if name not in counts:
            raise ObserverArgumentError(f"observe_modules: store_n_calls has no count for {name!r}; give one.")
        targets[name] = module, method
    return targets
