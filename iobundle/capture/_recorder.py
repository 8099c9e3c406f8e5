"""``CallRecorder``: record the calls of a model's method in memory or streamed to a bundle; save a bundle."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from iobundle._implementations import ATTN_IMPLEMENTATIONS, SAFE_ATTN_IMPLEMENTATION
from iobundle._remote import Staging, clear_local_bundle, join_url, local_path, open_filesystem, staged
from iobundle.calls import (
    RecordedCalls,
    TensorCollector,
    autocast_state,
    record_inputs,
    record_value,
    signature_entry,
)
from iobundle.capture._module_state import StateWatch, state_message
from iobundle.capture._snapshots import SnapshotTable
from iobundle.capture._stream import CallStream
from iobundle.capture._writer import BundleWriter, save_recorded_calls
from iobundle.errors import (
    BundleExistsError,
    IobundleError,
    ObserverArgumentError,
    ObserverArgumentTypeError,
    ObserverStateError,
    UnsupportedInputError,
)
from iobundle.schema import MANIFEST_FILENAME, CallEntry, DictNode, Manifest, MissingValueEntry, Node

__all__ = ["CallRecorder", "ObservationWarning"]

logger = logging.getLogger(__name__)


class ObservationWarning(UserWarning):
    """Something could not be recorded; the observed program went on undisturbed."""


def _failure(what: str, exc: Exception) -> str:
    return (
        f"iobundle could not record {what} of a call ({type(exc).__name__}: {exc}); the call is marked "
        "incomplete and the observed program goes on."
    )


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return a == b


_R = TypeVar("_R", bound="CallRecorder")


class CallRecorder:
    """Record the calls a model's method receives, in memory or streamed to a bundle; save them as a bundle.

    The recording half of :class:`iobundle.observer.InputObserver`, which adds inference, export
    and validation on top of it.

    Args:
        value_if_missing: Placeholders for arguments present only in some calls, by name or position
            (``{"pixel_values": torch.empty((0, 3, 224, 224))}``). They serve argument and shape
            inference only; the model never receives them.
    """

    def __init__(self, value_if_missing: dict[str | int, Any] | None = None) -> None:
        self.value_if_missing = dict(value_if_missing or {})
        self._rc: RecordedCalls | None = None
        # Snapshots live in a table whose keys stay valid once streamed to disk and dropped from memory.
        self._table = SnapshotTable()
        self._collector = TensorCollector(self._table.snapshot, self._table)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._stream: CallStream | None = None
        self._stream_writer: BundleWriter | None = None
        self._streamed: list[CallEntry] = []
        self._observed_model: Any = None  # the last model observed: what save(include_model=True) stores
        self._staging: dict[str, Staging] = {}  # stream_to URL -> the local directory streamed to, then uploaded
        self._staging_overwrite: dict[str, bool] = {}  # stream_to URL -> the overwrite= of its latest block
        self._uploaded: dict[str, bytes] = {}  # stream_to URL -> the manifest this observer uploaded there last

    # -- the observed method ------------------------------------------------------------------

    @contextlib.contextmanager
    def __call__(
        self: _R,
        model: torch.nn.Module | Any,
        store_n_calls: int = 3,
        method_name: str = "forward",
        *,
        stream_to: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        durable: bool = False,
    ) -> Iterator[_R]:
        """Replace ``model.<method_name>`` by a recording wrapper for the duration of the block.

        The first ``store_n_calls`` calls made inside the block are recorded (inputs copied before
        the call, outputs after, wall time measured); later ones run unrecorded. The method's
        signature stays visible to ``inspect``. The original method is restored on exit, even on error.
        The method may be called from several threads at once; each call is recorded whole.

        With ``stream_to``, each recorded call is written to that bundle directory as soon as it
        returns, by a background thread, and a line is appended to its ``journal.jsonl`` after each call:
        if the process dies (SIGKILL, the OOM killer, a crash of Python), the bundle holds every
        finished call but the last at most. Written snapshots leave memory (about 1.5 calls are
        held at a time); ``infer_*`` and ``save`` read them back from the bundle. Leaving the block
        waits for the writer, fsyncs every file written and writes the final manifest with fsync:
        a closed stream is durable. The bundle holds every call this observer recorded, earlier
        blocks included.

        ``durable`` chooses what survives a crash of the *machine* (power loss, kernel panic)
        while the block runs. By default (False) files are renamed into place without fsync: the
        guarantee above holds for any death of the process, since the page cache outlives it,
        but a crash of the machine before the block is left may lose any call of the block, or
        leave ``journal.jsonl`` empty (the operating system writes the data back when it chooses).
        With True each call's file, the directory and the journal are fsynced before the next
        call is accepted, so a crash of the machine loses at most the call in flight; each call
        then waits for the disk (about 1 s per 200 MiB on a slow disk, 3 fsyncs per call).

        Recording never breaks the observed program: what cannot be recorded or written (a value
        of an unknown class, a tensor that cannot be copied, a full disk, an unwritable
        ``stream_to``) becomes an :class:`ObservationWarning` and a call marked ``incomplete``;
        without a usable ``stream_to`` the calls are kept in memory. One of the first 2 recorded calls
        of a block that changes tensors the model's modules keep (state the calls do not carry) is
        one warning naming them.

        Args:
            model: The object whose method is observed.
            store_n_calls: How many calls of this block to record.
            method_name: The method to observe.
            stream_to: A bundle directory to write each call to as it returns. A URL (``s3://...``,
                ``memory://...``; needs fsspec, ``pip install 'iobundle[remote]'``) streams to a local
                staging directory, uploaded when the block is left (``manifest.json`` last); the
                staging directory is removed when the observer is garbage-collected.
            overwrite: Replace what ``stream_to`` holds.
            durable: fsync each streamed call before accepting the next one (survives a power
                loss during the block), instead of once when the block is left.

        Raises:
            ObserverArgumentError: ``model`` has no such method, or it differs from the one observed
                before, or a ``value_if_missing`` key is outside the signature (a ``ValueError``).
            ObserverArgumentTypeError: A ``value_if_missing`` key is neither a name nor a position
                (a ``TypeError``).
            ObserverStateError: A block of this observer streams already and this one has ``stream_to``.
            BundleExistsError: ``stream_to`` is not empty and ``overwrite`` is False.
        """
        method = getattr(model, method_name, None)
        if method is None or not callable(method):
            raise ObserverArgumentError(
                f"{type(model).__name__} does not have a method {method_name!r} to observe. "
                "Pass method_name= the name of one of its methods ('forward' by default)."
            )
        if store_n_calls < 0:
            raise ObserverArgumentError(f"store_n_calls must be >= 0, got {store_n_calls}.")
        sig = signature_entry(method, method_name)
        if self._rc is None:
            self._rc = RecordedCalls(signature=sig, store=self._table)
            self._rc.value_if_missing = self._record_missing_values(self._rc)
        elif [p.name for p in self._rc.signature.parameters] != [p.name for p in sig.parameters]:
            raise ObserverArgumentError(
                f"This observer recorded {self._rc.signature.qualname} before; it cannot also record "
                f"{sig.qualname} with another signature. Use one InputObserver per method."
            )
        budget: dict[str, Any] = {"left": store_n_calls}
        had_instance_attr = method_name in getattr(model, "__dict__", {})

        @functools.wraps(method)
        def recording_method(*args: Any, **kwargs: Any) -> Any:
            return self._observe_call(method, budget, args, kwargs)

        recording_method.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
        stream = None
        if stream_to is not None:
            target = self._stream_path(stream_to, overwrite=overwrite)
            stream = self._open_stream(target, overwrite=overwrite, durable=durable)
        self._observed_model = model
        setattr(model, method_name, recording_method)
        budget["state"] = StateWatch(model, min(2, store_n_calls))  # walks the tree as the calls will find it
        entered = _EnteredModules(model) if store_n_calls else None
        budget["entered"] = entered
        try:
            yield self
        finally:
            if had_instance_attr:
                setattr(model, method_name, method)
            else:
                delattr(model, method_name)
            if entered is not None:
                entered.stop()
            if stream is not None:
                self._close_stream(stream)
        if entered is not None and budget["left"] == store_n_calls:  # left normally, not by an exception
            self._warn(entered.no_call_message(type(model).__name__, method_name), stacklevel=3)

    # -- streaming ------------------------------------------------------------------------------

    def _open_stream(self, path: Path, *, overwrite: bool, durable: bool) -> CallStream | None:
        """Start writing calls to ``path``; on an unusable directory, warn, keep recording in memory, return None."""
        rc = self._rc
        assert rc is not None
        if self._stream is not None:
            raise ObserverStateError(
                f"This observer already streams to '{self._stream.path}' in an enclosing block; "
                "a nested block cannot stream too. Drop stream_to= from the inner block."
            )
        writer, written = self._stream_writer, self._streamed
        try:
            if writer is None or not _same_path(writer.path, path):
                writer, written = BundleWriter(path, overwrite=overwrite), []
            stream = CallStream(writer, rc, self._table, written=written, durable=durable)
        except BundleExistsError:
            raise
        except (IobundleError, OSError) as exc:
            self._warn(
                f"iobundle cannot stream calls to '{path}' ({type(exc).__name__}: {exc}); they are kept in "
                "memory instead. Call observer.save() with a writable path to keep them.",
                stacklevel=4,
            )
            return None
        self._stream_writer, self._streamed, self._stream = writer, [], stream
        done = {c.index for c in written}
        with self._lock:
            for call in rc.calls:
                if call.index not in done:
                    stream.submit(call, recorded_now=False)
            messages = self._apply_stream_failures(stream)
        for message in messages:
            self._warn(message, stacklevel=4)
        return stream

    def _stream_path(self, stream_to: str | os.PathLike[str], *, overwrite: bool) -> Path:
        """The local directory to stream to: ``stream_to`` itself, or the staging directory of a URL."""
        local = local_path(stream_to)
        if local is not None:
            return local
        url = str(stream_to)
        staging = self._staging.get(url)
        self._staging_overwrite[url] = overwrite
        if staging is None:
            fs, inner = open_filesystem(url)  # MissingDependencyError without fsspec, before anything runs
            if not overwrite and fs.exists(inner) and (not fs.isdir(inner) or fs.ls(inner, detail=False)):
                raise BundleExistsError(
                    f"'{url}' already exists and is not empty. Pass overwrite=True to replace it, or choose another URL."
                )
            staging = self._staging[url] = Staging(url, prefix="iobundle-stream-")
            weakref.finalize(self, staging.close)
            logger.info("streaming to %s, uploaded to %s when the block ends", staging.path, url)
        return staging.path

    def _close_stream(self, stream: CallStream) -> None:
        """Wait for the writer, write the final manifest (and upload it to its URL); problems become warnings."""
        messages = []
        try:
            stream.close()
        except Exception as exc:
            messages.append(f"iobundle could not write the final manifest of '{stream.path}' ({exc}).")
        staging = next((st for st in self._staging.values() if st.path == stream.path), None)
        if staging is not None and not messages:
            url = staging.url
            try:
                # Replace only with the user's overwrite=, or what this observer uploaded there itself.
                overwrite = self._staging_overwrite.get(url, False) or self._holds_own_upload(url)
                staging.upload(overwrite=overwrite)
                self._uploaded[url] = (stream.path / MANIFEST_FILENAME).read_bytes()
            except Exception as exc:
                messages.append(
                    f"iobundle could not upload the streamed bundle to '{url}' ({exc}); it stays in {stream.path} "
                    "while the observer lives: call observer.save() with another path to keep it."
                )
        with self._lock:
            self._stream = None
            self._streamed = stream.manifest_calls
            messages = self._apply_stream_failures(stream) + messages
        for message in messages:
            self._warn(message, stacklevel=4)

    def _holds_own_upload(self, url: str) -> bool:
        """Whether ``url`` still holds the manifest this observer uploaded there last (no one wrote since)."""
        mine = self._uploaded.get(url)
        if mine is None:
            return False
        fs, inner = open_filesystem(url)
        try:
            return bool(fs.cat_file(join_url(inner, MANIFEST_FILENAME)) == mine)
        except Exception:
            return False

    def _apply_stream_failures(self, stream: CallStream) -> list[str]:
        """Mark incomplete the calls the writer could not write; return the messages to warn with."""
        rc = self._rc
        assert rc is not None
        messages = []
        for entry, message in stream.take_failures():
            if entry is not None:
                i = entry.index
                if not (0 <= i < len(rc.calls) and rc.calls[i].index == i):
                    i = next((j for j, c in enumerate(rc.calls) if c.index == entry.index), -1)
                if i >= 0:
                    rc.calls[i] = entry
                    rc.touch()
            messages.append(
                message + (" The call is marked incomplete; the observed program goes on." if entry else "")
            )
        return messages

    def _warn(self, message: str, *, stacklevel: int) -> None:
        warnings.warn(message, ObservationWarning, stacklevel=stacklevel + 1)

    def _record_missing_values(self, rc: RecordedCalls) -> list[MissingValueEntry]:
        names = rc.names
        entries = []
        for key, value in self.value_if_missing.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise ObserverArgumentTypeError(
                    f"Unexpected type {type(key).__name__} for the value_if_missing key {key!r}; keys are "
                    "parameter names (str) or positions (int)."
                )
            if isinstance(key, str) and key not in names and rc.var_keyword is None:
                raise ObserverArgumentError(
                    f"Unexpected keyword argument {key!r} in value_if_missing: it is not a parameter of {rc.signature.qualname} "
                    f"(parameters: {names}) and it takes no **kwargs."
                )
            if isinstance(key, int) and not 0 <= key < len(names):
                raise ObserverArgumentError(
                    f"Unexpected keyword argument at position {key} in value_if_missing: it is outside the signature of {rc.signature.qualname} ({names})."
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

    def _observe_call(self, method: Any, budget: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rc = self._rc
        assert rc is not None
        with self._lock:
            record = budget["left"] > 0
            if record:
                budget["left"] -= 1
                if budget["entered"] is not None:  # the block records: which modules run no longer matters
                    budget["entered"].stop()
                    budget["entered"] = None
                call, problem = self._record_inputs(rc, args, kwargs)
                watch = budget["state"]
                state = None if watch.found else watch.before()
                state_in = self._record_state(watch.now()) if watch.found else None
        if not record:
            return method(*args, **kwargs)
        messages = [problem]
        begin = time.perf_counter()
        try:
            result = method(*args, **kwargs)
        except BaseException as exc:
            latency = time.perf_counter() - begin
            failed = call.model_copy(
                update={"status": "failed", "error": f"{type(exc).__name__}: {exc}", "latency": latency}
            )
            with self._lock:
                messages += self._finish(failed)
            for message in filter(None, messages):
                self._warn(message, stacklevel=3)
            raise
        latency = time.perf_counter() - begin
        changed = watch.changed(state, self._collector.met) if state is not None else []
        with self._lock:
            if (changed or watch.numbers) and "module-state" not in self._warned:
                self._warned.add("module-state")
                messages.append(state_message(changed, rc.signature.qualname, watch.numbers))
            update: dict[str, Any] = {"latency": latency}
            if call.status == "ok":
                outputs, problem, warning = self._record_outputs(result, call.index)
                update["outputs"] = outputs
                if changed and watch.first_in is not None:  # the call that found the state: as it was before
                    state_in = self._record_state(watch.first_in)
                elif state is not None and watch.bound:  # bound where None was: state, if a later call changes it
                    state_in = self._record_state(dict.fromkeys(watch.bound))
                if state_in is not None and (state_out := self._record_state(watch.now())) is not None:
                    parts = [state_in, state_out, watch.training()]
                    update["state"] = DictNode(keys=["in", "out", "training"], items=parts)
                if problem:
                    update.update(status="incomplete", error=problem)
                    messages.append(warning)
            messages += self._finish(call.model_copy(update=update))
        for message in filter(None, messages):
            self._warn(message, stacklevel=3)
        return result

    def _record_inputs(self, rc: RecordedCalls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[CallEntry, str]:
        """Record the inputs of a call; on failure, an incomplete call without inputs and the reason."""
        journal: list[str] = []
        self._table.journal = journal
        autocast = None
        try:
            autocast = autocast_state()  # on the caller's thread: torch.autocast's state is thread-local
            call = record_inputs(
                rc, self._collector, args, kwargs, index=len(rc.calls), on_opaque=self._opaque, autocast=autocast
            )
            return call, ""
        except Exception as exc:  # observation never breaks the observed program
            self._table.discard(journal)
            reason = _failure("the inputs", exc)
            entry = CallEntry(
                index=len(rc.calls), status="incomplete", error=reason, args=[], kwargs={}, autocast=autocast
            )
            return entry, self._warning_once("the inputs", entry.index, exc, reason)
        finally:
            self._table.journal = None

    def _record_state(self, tensors: dict[str, Any]) -> Node | None:
        """The module state ``tensors`` by path, recorded as a dict; None if they cannot be (the call then lacks them)."""
        journal: list[str] = []
        self._table.journal = journal
        try:
            return record_value(tensors, self._collector, path="module state", on_opaque=self._opaque)
        except Exception:  # observation never breaks the observed program
            self._table.discard(journal)
            return None
        finally:
            self._table.journal = None

    def _warning_once(self, what: str, index: int, exc: Exception, reason: str) -> str:
        """The warning for ``exc`` met recording ``what`` of call ``index``: once for a value iobundle cannot record.

        Such a value (a cache layer iobundle cannot rebuild) is usually passed to every call: the
        first call's warning says so and names it; later calls with the same problem are marked
        incomplete all the same, without another warning (an empty message).
        """
        if not isinstance(exc, UnsupportedInputError):
            return reason
        key = f"unsupported:{what}:{exc}"
        if key in self._warned:
            return ""
        self._warned.add(key)
        return (
            f"iobundle cannot record {what} of call {index}: {exc} This call and every later one with the same "
            "problem are marked incomplete (this is the only warning about it); the observed program goes on."
        )

    def _record_outputs(self, result: Any, index: int) -> tuple[Node | None, str, str]:
        """Record the outputs of call ``index``; on failure, None, the reason and the warning to give."""
        journal: list[str] = []
        self._table.journal = journal
        stream = self._stream
        # A writer process copies the outputs into shared memory as soon as they are recorded, before
        # the call returns (the model cannot have changed them yet): references, no copies.
        self._table.reference = stream is not None and stream.process is not None
        try:
            return record_value(result, self._collector, path="", on_opaque=self._opaque), "", ""
        except Exception as exc:
            self._table.discard(journal)
            reason = _failure("the outputs", exc)
            return None, reason, self._warning_once("the outputs", index, exc, reason)
        finally:
            self._table.journal = None
            self._table.reference = False

    def _finish(self, call: CallEntry) -> list[str]:
        """Append ``call`` (under the lock) and hand it to the stream; return the writer's complaints."""
        self._append(call)
        stream = self._stream
        if stream is None:
            return []
        stream.submit(self._recorded().calls[-1])
        return self._apply_stream_failures(stream)

    def _append(self, call: CallEntry) -> None:
        rc = self._rc
        assert rc is not None
        rc.calls.append(call if call.index == len(rc.calls) else call.model_copy(update={"index": len(rc.calls)}))
        rc.touch()

    # -- results ------------------------------------------------------------------------------

    def _recorded(self) -> RecordedCalls:
        if self._rc is None:
            raise ObserverStateError(
                "No inputs were captured: nothing was observed yet. Run the model inside `with observer(model):` first."
            )
        return self._rc

    def num_obs(self) -> int:
        """Return the number of successfully recorded calls (0 before any observation)."""
        return 0 if self._rc is None else len(self._rc.ok_calls)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        include_model: bool | torch.nn.Module = False,
    ) -> Manifest:
        """Write the recorded calls to the bundle directory ``path``.

        With ``include_model`` the bundle is self-contained: it also stores the model's config
        (``model/config.json``) and weights (``model/weights.safetensors``), and
        ``iobundle.replay.load_bundle_model`` rebuilds the model from them. Only
        transformers models can be stored (a config rebuilds them); a peft adapter (LoRA and the
        others peft merges) is stored merged into its base model, under the base class (the
        manifest's ``model.merged_adapters`` says so), a ``torch.compile`` wrapper as the module it
        wraps, and a quantized model is refused before anything is written. A model that runs with an
        attention implementation transformers does not build in (``flash_attention_2``, a hub
        kernel, one registered with ``AttentionInterface.register``) is stored, with an
        :class:`ObservationWarning`: the loader refuses it, so switch first with
        ``model.set_attn_implementation('sdpa')``.

        ``path`` may be a URL (``s3://bucket/run.iobundle``, ``memory://run``; needs fsspec:
        ``pip install 'iobundle[remote]'``): the bundle is written to a local temporary directory,
        then uploaded, ``manifest.json`` last. A ``scheme://`` string is never taken for a local path.

        Args:
            path: Target directory (``run.iobundle``) or URL; created if missing.
            overwrite: Replace an existing non-empty directory.
            include_model: True to store the observed model; or the transformers model that holds
                the observed module (``include_model=model`` after observing
                ``model.model.layers[0].self_attn``), whose path inside it is recorded too.

        Returns:
            The manifest written to ``path/manifest.json``.

        Raises:
            ObserverStateError: Nothing was observed.
            ObserverArgumentError: ``include_model`` is not a transformers model (or
                does not hold the observed module).
            BundleExistsError: ``path`` is not empty and ``overwrite`` is False, or it is the bundle
                this observer streams to (it is complete already; tensors are read back from it).
            BundleWriteError: Writing failed (disk full, permission denied); nothing that looks like
                a complete bundle is left at ``path``.
            MissingDependencyError: ``path`` is a URL and fsspec is not installed.
        """
        rc = self._recorded()
        streamed = self._stream_writer
        target = local_path(path)
        if target is None:
            return self._save_to_url(str(path), overwrite=overwrite, include_model=include_model)
        if streamed is not None and _same_path(streamed.path, target):
            raise BundleExistsError(
                f"'{path}' is the bundle this observer streamed its calls to (stream_to=); it already holds "
                "them, and its tensors are read back from it. Save to another path."
            )
        if include_model is not False:  # checked before the first byte is written
            from iobundle.capture._model_store import check_model, write_model
            from iobundle.schema import write_manifest

            observed: torch.nn.Module | None = getattr(self, "_observed_model", None)
            model = observed if include_model is True else include_model
            inside = None if model is observed else observed
            check_model(model, inside)  # refuses None (nothing observed) and anything not a transformers model
        existed = os.path.lexists(target)
        manifest = save_recorded_calls(rc, path, overwrite=overwrite)
        if include_model is not False:
            try:
                assert model is not None
                entry = write_model(path, model, inside)
                manifest = manifest.model_copy(update={"model": entry})
                write_manifest(path, manifest)
            except BaseException:  # a failed save leaves nothing behind
                with contextlib.suppress(OSError):
                    clear_local_bundle(target)
                    if not existed:
                        target.rmdir()
                raise
            attention = entry.attn_implementation
            if attention is not None and attention not in ATTN_IMPLEMENTATIONS:
                self._warn(_foreign_attention_message(attention), stacklevel=2)
        logger.info("saved %d calls to %s", len(manifest.calls), path)
        return manifest

    def _save_to_url(self, url: str, *, overwrite: bool, include_model: bool | torch.nn.Module) -> Manifest:
        """Save to a local staging directory, upload it to ``url`` (``manifest.json`` last), remove it."""
        open_filesystem(url)  # MissingDependencyError without fsspec, before anything is written
        if url in self._staging:
            raise BundleExistsError(
                f"'{url}' is the bundle this observer streamed its calls to (stream_to=); it already holds "
                "them. Save to another URL."
            )
        with staged(url, overwrite=overwrite, prefix="iobundle-save-") as local:
            manifest = self.save(local, include_model=include_model)
        logger.info("uploaded %d calls to %s", len(manifest.calls), url)
        return manifest


class _EnteredModules:
    """The first modules whose ``forward`` runs while a block has recorded nothing: where its calls went.

    A wrapper (a PEFT adapter, a pipeline) often calls the model it wraps directly, so the
    observed method never runs. A global forward pre-hook notes the first few modules entered,
    until the block records its first call (one Python call per module call until then).
    """

    _KEEP = 64

    def __init__(self, model: Any) -> None:
        self._model = model
        self._first: list[weakref.ref[torch.nn.Module]] = []
        self._seen: set[int] = set()
        self._handle: Any = None
        if isinstance(model, torch.nn.Module):
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._entered)

    def _entered(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) not in self._seen and len(self._first) < self._KEEP:
            self._seen.add(id(module))
            self._first.append(weakref.ref(module))

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def no_call_message(self, class_name: str, method_name: str) -> str:
        """The warning for a block that recorded no call, naming the module of ``model`` that ran instead."""
        message = f"iobundle recorded no call of {class_name}.{method_name} in this `with` block: "
        if isinstance(self._model, torch.nn.Module):
            names = {id(m): name for name, m in self._model.named_modules()}
            for ref in self._first:
                module = ref()
                if module is not None and module is not self._model and id(module) in names:
                    path = names[id(module)]
                    return message + (
                        f"the block ran {type(module).__name__}.forward (model.{path}) instead, as a wrapper (a PEFT "
                        f"adapter, a pipeline) does when it calls the model it wraps. Observe that module: "
                        f"`with observer(model.{path}):`."
                    )
        return message + (
            "nothing called it. Call the model inside the block, or pass method_name= the method that runs "
            "(for generate(), observe 'forward' of the module generate() calls)."
        )


def _foreign_attention_message(attention: str) -> str:
    """The warning of ``save(include_model=...)`` for a model whose attention the loader will refuse."""
    return (
        f"The model runs with the attention implementation {attention!r}, which transformers does not build in "
        f"(built-in: {', '.join(sorted(ATTN_IMPLEMENTATIONS))}; others import or fetch code): "
        "'iobundle export/run --from-bundle' and load_bundle_model will refuse the model stored in this bundle. "
        f"Call model.set_attn_implementation({SAFE_ATTN_IMPLEMENTATION!r}) before saving, or rebuild the model "
        "yourself when replaying (--model MODULE:FACTORY)."
    )
