"""``observe_modules``: observe several modules of one model in one capture; save one bundle per module."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from iobundle._remote import join_url, local_path
from iobundle.errors import BundleExistsError, ObserverArgumentError
from iobundle.observer._observer import InputObserver
from iobundle.schema import Manifest

__all__ = ["ModuleObservers", "observe_modules"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def _bundle(directory: str | os.PathLike[str], name: str) -> str:
    """``directory/<name>.iobundle``: a local path or a URL."""
    return join_url(os.fspath(directory), f"{name}.iobundle")


class ModuleObservers(dict[str, InputObserver]):
    """The observers of one :func:`observe_modules` block: an :class:`InputObserver` per name, and ``save``.

    Attributes:
        model: The model whose modules were observed: what ``save`` stores in each bundle.
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[str]) -> None:
        super().__init__((name, InputObserver()) for name in names)
        self.model = model

    def save(
        self, directory: str | os.PathLike[str], *, overwrite: bool = False, include_model: bool = True
    ) -> dict[str, Manifest]:
        """Write one bundle per module, ``directory/<name>.iobundle``; each exports alone.

        With ``include_model`` (the default) each bundle stores the whole model, with the path of
        its module inside it (``save(..., include_model=model)`` of each observer), so
        ``iobundle export directory/<name>.iobundle --from-bundle`` rebuilds the model and exports
        that module with its own programs.

        Args:
            directory: The folder (or URL) of the bundles; created if missing.
            overwrite: Replace bundles already there.
            include_model: Store the model in each bundle (a transformers model only); False saves
                the calls alone.

        Returns:
            The manifest of each bundle, by name.

        Raises:
            BundleExistsError: A bundle's directory is not empty and ``overwrite`` is False (checked for
                every local one before anything is written).
            ObserverArgumentError: ``include_model`` and the model is not a transformers model (refused
                before anything is written).
        """
        targets = {name: _bundle(directory, name) for name in self}
        for target in targets.values():
            path = local_path(target)
            if not overwrite and path is not None and path.is_dir() and any(path.iterdir()):
                raise BundleExistsError(
                    f"'{path}' already exists and is not empty. Pass overwrite=True to replace it, or choose "
                    "another directory."
                )
        manifests = {}
        for name, observer in self.items():
            try:
                manifests[name] = observer.save(
                    targets[name], overwrite=overwrite, include_model=self.model if include_model else False
                )
            except ObserverArgumentError as exc:
                raise ObserverArgumentError(
                    f"Cannot store the model in '{targets[name]}': {exc} To save the calls alone: save(directory, "
                    "include_model=False), then export each bundle with --model MODULE:FACTORY (a function returning "
                    "its module)."
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

    For a model whose ``generate()`` calls its parts itself: a VLM encodes the images before the
    prefill and passes the features to it, an encoder-decoder model runs its encoder once before
    the decoder steps. Each module is observed as ``InputObserver()(module, n, method_name)`` would;
    every method is restored on exit, even on error.

    Args:
        model: The model that holds the modules (or is one of them).
        modules: By a name that becomes the bundle's file name, a module (its ``forward`` is
            observed) or a method of one (``{"vision": model.model.get_image_features, "text": model}``).
        store_n_calls: How many calls of each to record; or a number per name.
        stream_to: A folder (or URL) to stream each module's calls to, as ``<name>.iobundle``.
        overwrite: Replace what ``stream_to`` holds.

    Yields:
        The observers by name; ``save(directory)`` writes a bundle per module.

    Raises:
        ObserverArgumentError: A name is not a plain file name, a module is not inside ``model``,
            a method is given twice, or ``store_n_calls`` lacks a name.

    Example:
        >>> with torch.no_grad(), observe_modules(
        ...     model, {"vision": model.model.visual, "text": model}, store_n_calls=16
        ... ) as observers:
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
    """Each name's module and method name; refuse names that are not file names, modules outside ``model``,
    a method twice, a missing count."""
    if not isinstance(model, torch.nn.Module):
        raise ObserverArgumentError(f"observe_modules: model is a {type(model).__name__}; pass a torch.nn.Module.")
    if not modules:
        raise ObserverArgumentError('observe_modules: modules is empty; pass {"name": module, ...}.')
    inside = {id(m) for m in model.modules()}
    targets: dict[str, tuple[Any, str]] = {}
    for name, value in modules.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ObserverArgumentError(
                f"observe_modules: the name {name!r} becomes the file name {name}.iobundle; use letters, "
                "digits, '_', '-' and '.' (not first)."
            )
        module, method = (value, "forward") if isinstance(value, torch.nn.Module) else (
            getattr(value, "__self__", None), getattr(value, "__name__", "")
        )  # fmt: skip
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
