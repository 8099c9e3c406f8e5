"""``InputObserver``: record the calls of a model's method, infer export arguments, save a bundle."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from iobundle.capture._api import RecordedCallsAPI
from iobundle.capture._calls import DictTensorStore, RecordedCalls, signature_entry
from iobundle.capture._record import record_inputs
from iobundle.capture._tree import TensorCollector, build_value, record_value, tensor_keys
from iobundle.capture._writer import save_recorded_calls
from iobundle.errors import CaptureError
from iobundle.schema import CallEntry, Manifest, MissingValueEntry, Node

__all__ = ["InputObserver", "ObservationInfo", "ObservationWarning"]

logger = logging.getLogger(__name__)


class ObservationWarning(UserWarning):
    """Something could not be recorded; the observed program went on undisturbed."""


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor``, detached from autograd."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class RecordedInputs:
    """The inputs of one recorded call, as the model received them (absent ones filled by ``value_if_missing``)."""

    def __init__(self, rc: RecordedCalls, call: CallEntry) -> None:
        self._rc = rc
        self.call = call

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(build_value(a, self._rc.store.get, path=f"args[{i}]") for i, a in enumerate(self.call.args))

    @property
    def kwargs(self) -> dict[str, Any]:
        return {k: build_value(v, self._rc.store.get, path=k) for k, v in self.call.kwargs.items()}

    @property
    def cst_kwargs(self) -> dict[str, Any]:
        return dict(self.call.cst_kwargs)

    @property
    def flat_list(self) -> list[torch.Tensor]:
        keys = [k for a in self.call.args for k in tensor_keys(a)]
        keys += [k for v in self.call.kwargs.values() for k in tensor_keys(v)]
        return [self._rc.store.get(k) for k in keys]


class ObservationInfo:
    """Per-call records of the successful calls: ``inputs``, ``flat_outputs``, ``latencies``.

    ``calls`` lists every recorded call, failed ones included.
    """

    def __init__(self, rc: RecordedCalls) -> None:
        self._rc = rc

    def __len__(self) -> int:
        return len(self._rc.ok_calls)

    @property
    def calls(self) -> list[CallEntry]:
        return list(self._rc.calls)

    @property
    def inputs(self) -> list[RecordedInputs]:
        return [RecordedInputs(self._rc, c) for c in self._rc.ok_calls]

    @property
    def flat_outputs(self) -> list[list[torch.Tensor]]:
        return [[self._rc.store.get(k) for k in tensor_keys(c.outputs)] if c.outputs else [] for c in self._rc.ok_calls]

    @property
    def outputs(self) -> list[Any]:
        return [build_value(c.outputs, self._rc.store.get) if c.outputs else None for c in self._rc.ok_calls]

    @property
    def latencies(self) -> list[float]:
        return [c.latency or 0.0 for c in self._rc.ok_calls]


class InputObserver(RecordedCallsAPI):
    """Record the calls a model's method receives; infer export arguments and dynamic shapes; save a bundle.

    A drop-in replacement for ``torch.onnx.InputObserver`` that can also write what it saw to disk.

    Args:
        value_if_missing: Placeholders for arguments present only in some calls, by name or position
            (``{"pixel_values": torch.empty((0, 3, 224, 224))}``). They serve argument and shape
            inference only; the model never receives them.

    Example:
        >>> observer = InputObserver()
        >>> with observer(model, store_n_calls=4):
        ...     model.generate(input_ids, max_new_tokens=3)
        >>> observer.save("run.iobundle")
        >>> ep = torch.export.export(model, (), kwargs=observer.infer_arguments(),
        ...                          dynamic_shapes=observer.infer_dynamic_shapes())
    """

    def __init__(self, value_if_missing: dict[str | int, Any] | None = None) -> None:
        self.value_if_missing = dict(value_if_missing or {})
        self._rc: RecordedCalls | None = None
        self._collector = TensorCollector(snapshot)
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- the observed method ------------------------------------------------------------------

    @contextlib.contextmanager
    def __call__(
        self, model: torch.nn.Module | Any, store_n_calls: int = 3, method_name: str = "forward"
    ) -> Iterator[InputObserver]:
        """Replace ``model.<method_name>`` by a recording wrapper for the duration of the block.

        The first ``store_n_calls`` calls made inside the block are recorded (inputs copied before
        the call, outputs after, wall time measured); later ones run unrecorded. The method's
        signature stays visible to ``inspect``. The original method is restored on exit, even on error.

        Raises:
            CaptureError: ``model`` has no such method, or it differs from the one observed before.
        """
        method = getattr(model, method_name, None)
        if method is None or not callable(method):
            raise CaptureError(f"{type(model).__name__} has no method {method_name!r} to observe.")
        if store_n_calls < 0:
            raise CaptureError(f"store_n_calls must be >= 0, got {store_n_calls}.")
        sig = signature_entry(method, method_name)
        if self._rc is None:
            self._rc = RecordedCalls(signature=sig, store=DictTensorStore(self._collector.tensors))
            self._rc.value_if_missing = self._record_missing_values(self._rc)
        elif [p.name for p in self._rc.signature.parameters] != [p.name for p in sig.parameters]:
            raise CaptureError(
                f"This observer recorded {self._rc.signature.qualname} before; it cannot also record "
                f"{sig.qualname} with another signature. Use one InputObserver per method."
            )
        budget = {"left": store_n_calls}
        had_instance_attr = method_name in getattr(model, "__dict__", {})

        @functools.wraps(method)
        def recording_method(*args: Any, **kwargs: Any) -> Any:
            return self._observe_call(method, budget, args, kwargs)

        recording_method.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
        setattr(model, method_name, recording_method)
        try:
            yield self
        finally:
            if had_instance_attr:
                setattr(model, method_name, method)
            else:
                delattr(model, method_name)

    def _record_missing_values(self, rc: RecordedCalls) -> list[MissingValueEntry]:
        names = rc.names
        entries = []
        for key, value in self.value_if_missing.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CaptureError(f"value_if_missing: keys are parameter names or positions, got {key!r}.")
            if isinstance(key, str) and key not in names and rc.var_keyword is None:
                raise CaptureError(
                    f"value_if_missing: {key!r} is not a parameter of {rc.signature.qualname} "
                    f"(parameters: {names}) and it takes no **kwargs."
                )
            if isinstance(key, int) and not 0 <= key < len(names):
                raise CaptureError(
                    f"value_if_missing: position {key} is outside the signature of {rc.signature.qualname} ({names})."
                )
            node = record_value(value, self._collector, path=f"value_if_missing[{key!r}]", on_opaque=self._opaque)
            entries.append(MissingValueEntry(key=key, value=node))
        return entries

    def _opaque(self, path: str, type_name: str, reason: str) -> None:
        key = f"{path}:{type_name}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"iobundle: {path} is a {type_name} ({reason}); it is recorded as opaque. Register the class "
                "as a pytree node to record its tensors.",
                ObservationWarning,
                stacklevel=4,
            )

    def _observe_call(self, method: Any, budget: dict[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rc = self._rc
        assert rc is not None
        call: CallEntry | None = None
        with self._lock:
            record = budget["left"] > 0
            if record:
                budget["left"] -= 1
                try:
                    call = record_inputs(rc, self._collector, args, kwargs, index=len(rc.calls), on_opaque=self._opaque)
                except Exception as exc:  # observation never breaks the observed program
                    self._internal_failure("the inputs", exc)
                    call = None
        if not record:
            return method(*args, **kwargs)
        begin = time.perf_counter()
        try:
            result = method(*args, **kwargs)
        except BaseException as exc:
            latency = time.perf_counter() - begin
            if call is not None:
                with self._lock:
                    self._append(
                        call.model_copy(
                            update={"status": "failed", "error": f"{type(exc).__name__}: {exc}", "latency": latency}
                        )
                    )
            raise
        latency = time.perf_counter() - begin
        if call is not None:
            with self._lock:
                try:
                    outputs: Node | None = record_value(result, self._collector, path="output", on_opaque=self._opaque)
                    status = "ok"
                except Exception as exc:
                    self._internal_failure("the outputs", exc)
                    outputs, status = None, "incomplete"
                self._append(call.model_copy(update={"outputs": outputs, "latency": latency, "status": status}))
        return result

    def _append(self, call: CallEntry) -> None:
        rc = self._rc
        assert rc is not None
        rc.calls.append(call.model_copy(update={"index": len(rc.calls)}))
        rc.touch()

    def _internal_failure(self, what: str, exc: Exception) -> None:
        warnings.warn(
            f"iobundle could not record {what} of a call ({type(exc).__name__}: {exc}); the call is marked "
            "incomplete and the observed program goes on.",
            ObservationWarning,
            stacklevel=4,
        )

    # -- results ------------------------------------------------------------------------------

    def _recorded(self) -> RecordedCalls:
        if self._rc is None:
            raise CaptureError("Nothing was observed yet. Run the model inside `with observer(model):` first.")
        return self._rc

    def num_obs(self) -> int:
        """Return the number of successfully recorded calls (0 before any observation)."""
        return 0 if self._rc is None else len(self._rc.ok_calls)

    @property
    def info(self) -> ObservationInfo:
        """Per-call records: ``len(info)``, ``info.inputs``, ``info.flat_outputs``, ``info.latencies``."""
        return ObservationInfo(self._recorded())

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Manifest:
        """Write the recorded calls to the bundle directory ``path``.

        Args:
            path: Target directory (``run.iobundle``); created if missing.
            overwrite: Replace an existing non-empty directory.

        Returns:
            The manifest written to ``path/manifest.json``.

        Raises:
            CaptureError: Nothing was observed.
            BundleExistsError: ``path`` is not empty and ``overwrite`` is False.
            BundleWriteError: Writing failed (disk full, permission denied).
        """
        manifest = save_recorded_calls(self._recorded(), path, overwrite=overwrite)
        logger.info("saved %d calls to %s", len(manifest.calls), path)
        return manifest
