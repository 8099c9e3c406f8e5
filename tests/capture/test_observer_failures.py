"""The observed program never fails because it is observed; ``save`` fails loudly and cleanly.

While recording, whatever goes wrong inside iobundle (a value it cannot record, a tensor it
cannot copy, a full disk, an unwritable ``stream_to``) becomes an ``ObservationWarning`` and a
call marked ``incomplete``, and the user's method returns its result. ``save`` instead raises an
``IobundleError`` naming the path, and leaves nothing that looks like a complete bundle.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import (
    BundleExistsError,
    BundleNotFoundError,
    BundleWriteError,
    InputObserver,
    IobundleError,
    load_bundle,
)
from iobundle.capture import ObservationWarning, _entries, _snapshots, _writer

DYN = torch.export.Dim.DYNAMIC


class Double(torch.nn.Module):
    def forward(self, x, shared=None):
        return x * 2 if shared is None else (x * 2, shared + 1)


class Unregistered:
    """A class nobody registered as a pytree node."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Untraversable(tuple):
    """A named-tuple look-alike whose items cannot be listed: recording it raises."""

    _fields = ("a",)

    def __iter__(self):
        raise RuntimeError("no iteration today")


def observe(
    model: torch.nn.Module, inputs: list[Any], observer: InputObserver | None = None, **kwargs: Any
) -> tuple[InputObserver, list[Any]]:
    observer = observer or InputObserver()
    with observer(model, store_n_calls=len(inputs), **kwargs):
        results = [model(*x) if isinstance(x, tuple) else model(x) for x in inputs]
    return observer, results


def inputs(n: int = 3) -> list[torch.Tensor]:
    return [torch.full((i + 1, 3), float(i)) for i in range(n)]


def statuses(source: Any) -> list[str]:
    return (
        [c.status for c in source.info.calls] if isinstance(source, InputObserver) else [c.status for c in source.calls]
    )


def enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_for_call(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Appending call ``index``'s range to a segment fails: the disk is full."""
    real = os.pwritev
    first: list[int] = []

    def pwritev(fd: int, parts: Any, offset: int) -> int:
        first.append(offset)
        if len(first) == index + 1:
            enospc()
        return real(fd, parts, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)


# --------------------------------------------------------------------------- while recording


class TestUnrecordableValues:
    def test_unknown_output_class_is_opaque_and_the_program_goes_on(self, tmp_path: Path) -> None:
        class ReturnsUnknown(torch.nn.Module):
            def forward(self, x):
                return x + 1, Unregistered(x)

        with pytest.warns(ObservationWarning, match="Unregistered"):
            observer, results = observe(ReturnsUnknown(), inputs(2), stream_to=tmp_path / "run")
        assert isinstance(results[0][1], Unregistered)  # the caller got its real output
        bundle = load_bundle(tmp_path / "run")
        assert bundle.verify() == []
        # D4: the value is recorded as opaque, the tensors around it as usual
        assert [c.outputs.items[1].kind for c in bundle.calls] == ["opaque", "opaque"]
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes()) == str(({0: DYN},))

    @pytest.mark.parametrize("stream", [False, True])
    def test_an_output_that_cannot_be_traversed_makes_the_call_incomplete(self, tmp_path: Path, stream: bool) -> None:
        class Breaks(torch.nn.Module):
            def forward(self, x):
                return Untraversable((x,)) if x.shape[0] == 2 else x * 2

        options = {"stream_to": tmp_path / "run"} if stream else {}
        with pytest.warns(ObservationWarning, match="could not record the outputs"):
            observer, results = observe(Breaks(), inputs(3), **options)
        assert isinstance(results[1], Untraversable)
        assert statuses(observer) == ["ok", "incomplete", "ok"]
        if not stream:
            observer.save(tmp_path / "run")
        bundle = load_bundle(tmp_path / "run")
        assert statuses(bundle) == ["ok", "incomplete", "ok"]
        assert "RuntimeError: no iteration today" in bundle.calls[1].error
        assert bundle.calls[1].outputs is None and bundle.calls[1].args[0].kind == "tensor"
        assert bundle.num_obs() == observer.num_obs() == 2
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes())

    @pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
    def test_a_dtype_a_bundle_cannot_hold_makes_the_streamed_call_incomplete(self, tmp_path: Path) -> None:
        class Half(torch.nn.Module):
            def forward(self, x):
                return x.to(torch.complex32) if x.shape[0] == 2 else x

        with pytest.warns(ObservationWarning, match=r"call 1: its tensors could not be written.*complex32"):
            observer, results = observe(Half(), inputs(3), stream_to=tmp_path / "run")
        assert results[1].dtype == torch.complex32
        bundle = load_bundle(tmp_path / "run")
        assert statuses(bundle) == statuses(observer) == ["ok", "incomplete", "ok"]
        assert bundle.calls[1].outputs.kind == "opaque"  # the tensor that could not be written
        assert bundle.verify() == []
        observer.save(tmp_path / "copy")  # the in-memory state agrees with the bundle
        assert load_bundle(tmp_path / "copy").manifest.calls == bundle.manifest.calls


class TestTensorsThatCannotBeCopied:
    @pytest.mark.parametrize("stream", [False, True])
    def test_a_failing_snapshot_makes_the_call_incomplete(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
    ) -> None:
        real = _snapshots.snapshot_tensor

        def refuse_seven(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.shape[0] == 7:
                raise RuntimeError("cannot copy this one")
            return real(tensor)

        monkeypatch.setattr(_snapshots, "snapshot_tensor", refuse_seven)
        shared = torch.ones(5, 3)
        calls = [(torch.full((n, 3), float(n)), shared) for n in (2, 7, 3)]
        options = {"stream_to": tmp_path / "run"} if stream else {}
        with pytest.warns(ObservationWarning, match="could not record the inputs.*cannot copy this one"):
            observer, results = observe(Double(), calls, **options)
        assert torch.equal(results[1][0], torch.full((7, 3), 14.0))  # the program got its result
        assert statuses(observer) == ["ok", "incomplete", "ok"]
        if not stream:
            observer.save(tmp_path / "run")
        bundle = load_bundle(tmp_path / "run")
        assert statuses(bundle) == ["ok", "incomplete", "ok"]
        assert bundle.calls[1].args == [] and "cannot copy this one" in bundle.calls[1].error
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes()) == str(({0: DYN}, {}))
        # nothing half-recorded stays behind: every snapshot belongs to a recorded call
        referenced = {k for c in bundle.calls for k in _entries.call_keys(c)}
        assert set(bundle.manifest.tensors) == referenced

    def test_an_output_snapshot_failure_keeps_the_inputs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = _snapshots.snapshot_tensor
        monkeypatch.setattr(
            _snapshots,
            "snapshot_tensor",
            lambda t: (_ for _ in ()).throw(RuntimeError("no")) if t.shape[0] == 9 else real(t),
        )

        class Grows(torch.nn.Module):
            def forward(self, x):
                return torch.zeros(9) if x.shape[0] == 2 else x

        with pytest.warns(ObservationWarning, match="could not record the outputs"):
            observer, _ = observe(Grows(), inputs(3))
        call = observer.info.calls[1]
        assert call.status == "incomplete" and call.outputs is None and call.args[0].kind == "tensor"

    def test_a_sparse_tensor_makes_the_call_incomplete(self) -> None:
        class Sums(torch.nn.Module):
            def forward(self, x):
                return x.sum() if not x.is_sparse else x.to_dense().sum()

        with pytest.warns(ObservationWarning, match="could not record the inputs"):
            observer, results = observe(Sums(), [torch.eye(3), torch.eye(3).to_sparse()])
        assert results[1] == 3.0
        assert statuses(observer) == ["ok", "incomplete"]


@pytest.mark.usefixtures("own_files")  # the failures below hit write_tensor_file
class TestStreamWriteFailures:
    @pytest.mark.usefixtures("thread_writer")
    def test_disk_full_marks_the_call_incomplete_and_the_program_goes_on(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real = _writer.write_tensor_file

        def full_for_call_one(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> Any:
            if Path(path).name == "000001.safetensors":
                enospc()
            return real(path, tensors, **kwargs)

        monkeypatch.setattr(_writer, "write_tensor_file", full_for_call_one)
        shared = torch.ones(3)
        calls = [(torch.full((n, 3), float(n)), shared) for n in (1, 2, 3)]
        with pytest.warns(ObservationWarning, match=r"call 1: .*No space left on device"):
            observer, results = observe(Double(), calls, stream_to=tmp_path / "run")
        assert torch.equal(results[1][0], torch.full((2, 3), 4.0))
        bundle = load_bundle(tmp_path / "run")
        assert statuses(bundle) == statuses(observer) == ["ok", "incomplete", "ok"]
        assert bundle.verify() == []
        incomplete = bundle.calls[1]
        assert "000001.safetensors" in incomplete.error and "No space left" in incomplete.error
        # its own tensors were not written; the shared one, written with call 0, is still referenced
        assert incomplete.args[0].kind == "opaque" and incomplete.args[1].kind == "tensor"
        assert incomplete.outputs.items[0].kind == "opaque"
        assert "calls/000001.safetensors" not in bundle.manifest.files
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes())

    @pytest.mark.usefixtures("thread_writer")
    def test_nothing_can_be_written_at_all(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        target = tmp_path / "run"
        monkeypatch.setattr(_writer, "write_tensor_file", enospc)
        monkeypatch.setattr(_writer, "_write_all", enospc)  # the journal's appends
        monkeypatch.setattr(_writer, "write_manifest", enospc)  # the final manifest
        with pytest.warns(ObservationWarning) as record:
            observer, results = observe(Double(), inputs(3), stream_to=target)
        assert [torch.equal(r, x * 2) for r, x in zip(results, inputs(3))] == [True] * 3
        messages = "\n".join(str(w.message) for w in record)
        assert "could not append call" in messages and "could not write the final manifest" in messages
        assert statuses(observer) == ["incomplete"] * 3
        assert not (target / "manifest.json").exists()
        assert load_bundle(target).calls == []  # the journal's head, written when the stream opened

    @pytest.mark.usefixtures("thread_writer")
    def test_permission_denied_while_streaming(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def denied(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(_writer, "write_tensor_file", denied)
        with pytest.warns(ObservationWarning, match="Permission denied"):
            observe(Double(), inputs(2), stream_to=tmp_path / "run")
        assert statuses(load_bundle(tmp_path / "run")) == ["incomplete", "incomplete"]

    def test_unwritable_stream_to_keeps_calls_in_memory(self, tmp_path: Path) -> None:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        target = blocker / "run.iobundle"  # cannot be created, even by root
        with pytest.warns(ObservationWarning, match=rf"cannot stream calls to '{target}'.*kept in memory"):
            observer, results = observe(Double(), inputs(3), stream_to=target)
        assert [r.shape[0] for r in results] == [1, 2, 3]
        assert statuses(observer) == ["ok"] * 3
        observer.save(tmp_path / "elsewhere")
        assert load_bundle(tmp_path / "elsewhere").num_obs() == 3


# --------------------------------------------------------------------------- save()


@pytest.fixture
def observer() -> InputObserver:
    shared = torch.ones(3)
    return observe(Double(), [(torch.full((n, 3), float(n)), shared) for n in (1, 2, 3)])[0]


@pytest.mark.usefixtures("own_files")
class TestSaveErrors:
    def test_disk_full_raises_and_leaves_no_manifest(
        self, tmp_path: Path, observer: InputObserver, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real = _writer.write_tensor_file
        target = tmp_path / "run"

        def full_at_call_two(path: Path, tensors: dict[str, torch.Tensor], **kwargs: Any) -> Any:
            if Path(path).name == "000002.safetensors":
                enospc()
            return real(path, tensors, **kwargs)

        monkeypatch.setattr(_writer, "write_tensor_file", full_at_call_two)
        with pytest.raises(BundleWriteError, match="No space left on device") as info:
            observer.save(target)
        assert isinstance(info.value, IobundleError)
        assert str(target / "calls" / "000002.safetensors") in str(info.value)
        assert not (target / "manifest.json").exists()
        with pytest.raises(BundleNotFoundError):
            load_bundle(target)

    def test_disk_full_at_the_manifest(
        self, tmp_path: Path, observer: InputObserver, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            if Path(dst).name == "manifest.json":
                enospc()
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(BundleWriteError, match=r"manifest\.json.*No space left") as info:
            observer.save(tmp_path / "run")
        assert str(tmp_path / "run") in str(info.value)
        assert not (tmp_path / "run" / "manifest.json").exists()
        assert not list((tmp_path / "run").glob("**/*.tmp"))

    def test_a_failed_overwrite_never_looks_complete(
        self, tmp_path: Path, observer: InputObserver, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        target = tmp_path / "run"
        observer.save(target)
        old = json.loads((target / "manifest.json").read_text("utf-8"))
        assert len(old["calls"]) == 3
        monkeypatch.setattr(_writer, "write_tensor_file", enospc)
        with pytest.raises(BundleWriteError, match=str(target)):
            observer.save(target, overwrite=True)
        # the old manifest went first: the directory is not a bundle, neither old nor half new
        assert not (target / "manifest.json").exists()
        with pytest.raises(BundleNotFoundError):
            load_bundle(target)

    def test_permission_denied(self, tmp_path: Path, observer: InputObserver, monkeypatch: pytest.MonkeyPatch) -> None:
        def denied(*args: Any, **kwargs: Any) -> Any:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(_writer, "write_tensor_file", denied)
        with pytest.raises(BundleWriteError, match=rf"{tmp_path / 'run'}.*Permission denied"):
            observer.save(tmp_path / "run")
        assert not (tmp_path / "run" / "manifest.json").exists()

    def test_a_path_under_a_regular_file(self, tmp_path: Path, observer: InputObserver) -> None:
        (tmp_path / "a-file").write_text("x")
        target = tmp_path / "a-file" / "run"
        with pytest.raises(BundleWriteError, match=str(target)):
            observer.save(target)

    def test_an_existing_bundle_is_kept_without_overwrite(self, tmp_path: Path, observer: InputObserver) -> None:
        target = tmp_path / "run"
        observer.save(target)
        before = (target / "manifest.json").read_bytes()
        with pytest.raises(BundleExistsError, match=rf"'{target}'.*overwrite=True") as info:
            observer.save(target)
        assert isinstance(info.value, IobundleError)
        assert (target / "manifest.json").read_bytes() == before
        assert load_bundle(target).verify() == []

    def test_an_existing_file_is_refused(self, tmp_path: Path, observer: InputObserver) -> None:
        (tmp_path / "run").write_text("mine")
        with pytest.raises(BundleExistsError, match=str(tmp_path / "run")):
            observer.save(tmp_path / "run")
        assert (tmp_path / "run").read_text() == "mine"


class TestSegmentWriteFailures:
    """A call whose range cannot be appended to its segment (the calls' small tensors share one file)."""

    @pytest.mark.usefixtures("thread_writer")  # the disk fills for this process's writes
    def test_streaming_marks_the_call_incomplete_and_the_next_range_takes_its_place(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        full_for_call(1, monkeypatch)
        shared = torch.ones(3)
        calls = [(torch.full((n, 3), float(n)), shared) for n in (1, 2, 3)]
        with pytest.warns(ObservationWarning, match=r"call 1: .*segment-000000\.bin.*No space left on device"):
            observer, results = observe(Double(), calls, stream_to=tmp_path / "run")
        assert torch.equal(results[1][0], torch.full((2, 3), 4.0))
        bundle = load_bundle(tmp_path / "run")
        assert statuses(bundle) == statuses(observer) == ["ok", "incomplete", "ok"]
        assert bundle.verify() == []
        (segment,) = bundle.manifest.files.values()
        assert [r[0] for r in segment.ranges] == [0, 2]  # call 2's bytes where call 1's would have gone
        assert torch.equal(bundle.tensor(bundle.calls[2].args[0].key), torch.full((3, 3), 3.0))
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes())

    def test_saving_raises_naming_the_segment_and_the_call(
        self, tmp_path: Path, observer: InputObserver, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        full_for_call(2, monkeypatch)
        target = tmp_path / "run"
        with pytest.raises(BundleWriteError, match=r"call 2's tensors to .*segment-000000\.bin: No space left"):
            observer.save(target)
        assert not (target / "manifest.json").exists()
        with pytest.raises(BundleNotFoundError):
            load_bundle(target)
