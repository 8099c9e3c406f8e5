"""Streaming capture: ``with observer(model, stream_to=PATH)`` writes each call as it returns.

The kill trials run a capturing subprocess and SIGKILL it at many moments: the bundle left
behind must open, every call it lists must load and verify, and at most the call in flight
may be missing.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from iobundle import BundleExistsError, CaptureError, InputObserver, TensorFileError, load_bundle
from iobundle.calls._tensorfile_write import write_tensor_file
from iobundle.calls._tree import tensor_keys
from iobundle.capture import ObservationWarning, _writer, _writer_process
from iobundle.capture._entries import call_keys, pack_answer
from iobundle.capture._snapshots import POOLED_MIN_BYTES, BufferPool, SnapshotTable
from iobundle.capture._stream import INLINE_MAX_BYTES
from iobundle.schema import load_manifest

DYN = torch.export.Dim.DYNAMIC


def assert_same(a: Any, b: Any) -> None:
    """Same structure, same tensors (dtype, shape, values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def manifest_calls(path: Path) -> int:
    """How many calls the bundle lists now: its manifest, or its journal while the stream is open."""
    return len(load_manifest(path).calls)


class Decoder(torch.nn.Module):
    """Takes a growing sequence, an optional mask and a weight shared by every call."""

    def forward(self, input_ids, weight, attention_mask=None, use_cache: bool = False):
        out = input_ids.float().unsqueeze(-1) * weight
        if attention_mask is not None:
            out = out * attention_mask.float().sum()
        return {"logits": out, "last": input_ids[:, -1:]}


def decoder_calls(n: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    weight = torch.randn(4)
    calls = []
    for i in range(n):
        kwargs: dict[str, Any] = {"use_cache": True}
        if i % 2 == 0:
            kwargs["attention_mask"] = torch.ones(2, 3 + i, dtype=torch.int64)
        calls.append(((torch.randint(0, 100, (2, 3 + i)), weight), kwargs))
    return calls


def run(model: torch.nn.Module, observer: InputObserver, calls: list[Any], **kwargs: Any) -> list[Any]:
    with observer(model, store_n_calls=len(calls), **kwargs):
        return [model(*args, **kw) for args, kw in calls]


class TestStreaming:
    @pytest.mark.usefixtures("thread_writer")
    def test_each_call_is_on_disk_once_the_next_one_returns(self, tmp_path: Path) -> None:
        bundle = tmp_path / "run.iobundle"
        seen: list[int] = []

        class Probe(torch.nn.Module):
            def forward(self, x):
                seen.append(manifest_calls(bundle))  # what a crash now would leave
                return x + 1

        model, observer = Probe(), InputObserver()
        with observer(model, store_n_calls=6, stream_to=bundle):
            assert manifest_calls(bundle) == 0  # a bundle from the first moment
            for i in range(6):
                model(torch.full((i + 1, 3), float(i)))
                # call i returned: every earlier call is in the manifest
                assert manifest_calls(bundle) >= i
        assert seen[0] == 0 and all(n >= i - 1 for i, n in enumerate(seen))
        assert manifest_calls(bundle) == 6
        loaded = load_bundle(bundle)
        assert [c.index for c in loaded.calls] == list(range(6))
        assert loaded.verify() == []

    @staticmethod
    def journal_writers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The names of the threads that append each call's journal line (filled as calls are written)."""
        names: list[str] = []
        real = _writer.BundleWriter.append_call

        def append_call(self: Any, *args: Any, **kwargs: Any) -> None:
            names.append(threading.current_thread().name)
            real(self, *args, **kwargs)

        monkeypatch.setattr(_writer.BundleWriter, "append_call", append_call)
        return names

    @pytest.mark.usefixtures("thread_writer")
    @pytest.mark.parametrize("durable", [False, True])
    def test_a_small_call_is_written_by_its_own_thread(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
    ) -> None:
        """Small CPU calls are on disk when they return; durable ones are written by the writer thread."""
        bundle = tmp_path / "run.iobundle"
        writers = self.journal_writers(monkeypatch)
        model, observer = Decoder(), InputObserver()
        with observer(model, store_n_calls=4, stream_to=bundle, durable=durable):
            for i, (args, kwargs) in enumerate(decoder_calls(4)):
                model(*args, **kwargs)
                assert manifest_calls(bundle) >= (i + 1 if not durable else i)
        me = threading.current_thread().name
        assert len(writers) == 4
        assert all((name == me) != durable for name in writers), writers
        assert load_bundle(bundle).verify() == []

    @pytest.mark.usefixtures("thread_writer")
    def test_a_large_call_goes_to_the_writer_thread(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        bundle = tmp_path / "run.iobundle"
        writers = self.journal_writers(monkeypatch)
        model, observer = Decoder(), InputObserver()
        with observer(model, store_n_calls=3, stream_to=bundle):
            for i in range(3):
                model(torch.zeros(1, INLINE_MAX_BYTES // 4 + i, dtype=torch.int32), torch.ones(1))
                assert manifest_calls(bundle) >= i  # every earlier call
        assert len(writers) == 3 and all(name.startswith("iobundle-writer") for name in writers), writers
        loaded = load_bundle(bundle)
        assert loaded.num_obs() == 3 and loaded.verify() == []

    def test_streamed_and_saved_bundles_agree(self, tmp_path: Path) -> None:
        calls = decoder_calls(5)
        observer = InputObserver(value_if_missing={"attention_mask": torch.zeros(2, 0, dtype=torch.int64)})
        run(Decoder(), observer, calls, stream_to=tmp_path / "streamed")
        observer.save(tmp_path / "saved")
        streamed, saved = load_bundle(tmp_path / "streamed"), load_bundle(tmp_path / "saved")
        assert streamed.verify() == [] and saved.verify() == []
        assert streamed.manifest.calls == saved.manifest.calls
        for kwargs in ({}, {"set_batch_dimension_for": True}, {"dim_names": True}):
            expected = observer.infer_dynamic_shapes(**kwargs)
            assert str(streamed.infer_dynamic_shapes(**kwargs)) == str(expected)
            assert str(saved.infer_dynamic_shapes(**kwargs)) == str(expected)
        for index in (None, 0, 1, 4):
            for options in ({}, {"flat": True}, {"as_args_kwargs": True}):
                expected = observer.infer_arguments(index, **options)
                assert_same(streamed.infer_arguments(index, **options), expected)
                assert_same(saved.infer_arguments(index, **options), expected)

    def test_in_memory_api_reads_written_tensors_back(self, tmp_path: Path) -> None:
        calls = decoder_calls(4)
        observer = InputObserver()
        outputs = run(Decoder(), observer, calls, stream_to=tmp_path / "run")
        assert observer._table.in_memory() == 0  # everything written was dropped
        assert observer.num_obs() == 4
        for recorded, (args, kwargs) in zip(observer.info.inputs, calls):
            assert_same(recorded.args, args)
            assert_same(recorded.kwargs, {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        for flat, out in zip(observer.info.flat_outputs, outputs):
            assert_same(flat, [out["logits"], out["last"]])
        observer.save(tmp_path / "copy")  # reads the streamed bundle back
        assert load_bundle(tmp_path / "copy").verify() == []

    @pytest.mark.parametrize(
        ("name", "damage"),
        [
            ("000000.safetensors", "truncate"),
            ("000000.safetensors", "header"),
            ("000000.safetensors", "remove"),
            ("segment-000000.bin", "truncate"),
            ("segment-000000.bin", "remove"),
        ],
    )
    def test_a_damaged_streamed_file_is_an_error_not_a_crash(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, name: str, damage: str
    ) -> None:
        if name.endswith(".safetensors"):  # every tensor in its call's own file, written by this process
            monkeypatch.setattr(_writer, "SEGMENT_TENSOR_BYTES", 0)
            request.getfixturevalue("thread_writer")
        observer = InputObserver()
        run(Decoder(), observer, decoder_calls(2), stream_to=tmp_path / "run")
        file = tmp_path / "run" / "calls" / name
        if damage == "truncate":  # a segment is cut inside call 0's range (the calls after it only add bytes)
            file.write_bytes(file.read_bytes()[: 8 if name.startswith("segment") else -8])
        elif damage == "header":
            data = bytearray(file.read_bytes())
            data[8:10] = b"[ "  # same size, not an object any more
            file.write_bytes(bytes(data))
        else:
            file.unlink()
        with pytest.raises(TensorFileError, match=re.escape(name)):
            observer.infer_arguments(0)

    def test_a_tensor_seen_before_is_referenced_not_rewritten(self, tmp_path: Path) -> None:
        calls = decoder_calls(4)
        observer = InputObserver()
        run(Decoder(), observer, calls, stream_to=tmp_path / "run")
        bundle = load_bundle(tmp_path / "run")
        weight_keys = {c.args[1].key for c in bundle.calls}
        assert len(weight_keys) == 1
        (key,) = weight_keys
        segment = bundle.manifest.files["calls/segment-000000.bin"]
        (first, start, length, _), *_ = segment.ranges
        assert first == 0 and start <= bundle.manifest.tensors[key].offset < start + length  # call 0's range
        per_call = {r[0]: 0 for r in segment.ranges}
        for entry in bundle.manifest.tensors.values():
            per_call[next(c for c, s, n, _ in segment.ranges if s <= entry.offset < s + n)] += 1
        assert per_call[1] == 3  # input_ids and the two outputs, not the weight
        assert torch.equal(bundle.tensor(key), calls[0][0][1])

    def test_memory_holds_about_two_calls(self, tmp_path: Path) -> None:
        observer = InputObserver()
        held: list[int] = []
        call_bytes = 2 * 64 * 1024 * 4  # one input and one output of 64Ki floats

        class Big(torch.nn.Module):
            def forward(self, x):
                held.append(observer._table.in_memory())
                time.sleep(0.002)
                return x * 2

        model = Big()
        with observer(model, store_n_calls=40, stream_to=tmp_path / "run"):
            for i in range(40):
                model(torch.full((64 * 1024,), float(i)))
        # while call k runs: call k-1 (being written) and the input of call k
        assert max(held) <= call_bytes + call_bytes // 2
        assert observer._table.in_memory() == 0
        bundle = load_bundle(tmp_path / "run")
        assert len(bundle.calls) == 40 and bundle.verify() == []
        assert torch.equal(bundle.tensor(bundle.calls[39].args[0].key), torch.full((64 * 1024,), 39.0))

    def test_refuses_a_non_empty_directory(self, tmp_path: Path) -> None:
        target = tmp_path / "run"
        target.mkdir()
        (target / "notes.txt").write_text("mine")
        model, observer = Decoder(), InputObserver()
        with pytest.raises(BundleExistsError, match=r"overwrite=True") as info, observer(model, stream_to=target):
            pass
        assert str(target) in str(info.value)
        assert "forward" not in model.__dict__  # the method was never replaced
        assert (target / "notes.txt").read_text() == "mine"
        with pytest.raises(BundleExistsError, match="not a bundle"), observer(model, stream_to=target, overwrite=True):
            pass  # overwrite replaces a bundle, never what is not one (the rule of URLs and unpack too)
        assert (target / "notes.txt").read_text() == "mine"
        (target / "notes.txt").unlink()
        run(model, observer, decoder_calls(2), stream_to=target)
        assert len(load_bundle(target).calls) == 2

    def test_leaving_the_block_removes_the_segments_a_dead_writer_left_unlisted(self, tmp_path: Path) -> None:
        """A segment a writer process created and died before listing goes; the listed ones and other files stay."""
        target, model, observer = tmp_path / "run", Decoder(), InputObserver()
        calls = decoder_calls(3)
        with observer(model, store_n_calls=3, stream_to=target):
            for args, kw in calls:
                model(*args, **kw)
            (target / "calls" / "segment-000042.bin").write_bytes(b"a dead writer's first range")
            (target / "calls" / "segment-42.bin").write_bytes(b"not a name the writers give")
        bundle = load_bundle(target)
        assert bundle.verify() == [] and len(bundle.calls) == 3
        segments = {p.name for p in (target / "calls").glob("segment-*")}
        assert segments == {n.split("/")[1] for n in bundle.manifest.files if "segment-" in n} | {"segment-42.bin"}

    def test_leaving_the_block_removes_every_file_a_dead_writer_left_unlisted(self, tmp_path: Path) -> None:
        """A dead writer process's temporary file and unlisted call file go with its segments; other names stay."""
        target, model, observer = tmp_path / "run", Decoder(), InputObserver()
        left = ["calls/.000042.safetensors.tmp", "calls/000042.safetensors", ".manifest.json.tmp"]
        kept = ["calls/000042.safetensors.old", "calls/.000042.tmp", "calls/notes.txt", "000042.safetensors"]
        with observer(model, store_n_calls=3, stream_to=target):
            for args, kw in decoder_calls(3):
                model(*args, **kw)
            for name in left + kept:
                (target / name).write_bytes(b"x")
        bundle = load_bundle(target)
        assert bundle.verify() == [] and len(bundle.calls) == 3
        assert not any((target / name).exists() for name in left)
        assert all((target / name).read_bytes() == b"x" for name in kept)
        assert len(bundle.unlisted_files()) == 3  # those in calls/: the one beside it is the user's business

    def test_a_second_block_appends_to_the_same_bundle(self, tmp_path: Path) -> None:
        model, observer = Decoder(), InputObserver()
        calls = decoder_calls(5)
        run(model, observer, calls[:2], stream_to=tmp_path / "run")
        run(model, observer, calls[2:], stream_to=tmp_path / "run")
        bundle = load_bundle(tmp_path / "run")
        assert [c.index for c in bundle.calls] == list(range(5))
        assert bundle.verify() == []
        assert str(bundle.infer_dynamic_shapes()) == str(observer.infer_dynamic_shapes())

    def test_streaming_after_recording_in_memory_writes_earlier_calls(self, tmp_path: Path) -> None:
        model, observer = Decoder(), InputObserver()
        calls = decoder_calls(4)
        run(model, observer, calls[:2])
        run(model, observer, calls[2:], stream_to=tmp_path / "a")
        run(model, observer, [], stream_to=tmp_path / "b")  # a new directory gets every call
        for name in ("a", "b"):
            bundle = load_bundle(tmp_path / name)
            assert len(bundle.calls) == 4 and bundle.verify() == []
            assert_same(bundle.infer_arguments(3), observer.infer_arguments(3))

    def test_saving_over_the_streamed_bundle_is_refused(self, tmp_path: Path) -> None:
        observer = InputObserver()
        run(Decoder(), observer, decoder_calls(2), stream_to=tmp_path / "run")
        with pytest.raises(BundleExistsError, match="streamed"):
            observer.save(tmp_path / "run", overwrite=True)
        assert load_bundle(tmp_path / "run").verify() == []

    @pytest.mark.usefixtures("thread_writer")
    def test_a_nested_block_keeps_the_outer_stream(self, tmp_path: Path) -> None:
        model, observer = Decoder(), InputObserver()
        (args0, kw0), (args1, kw1) = decoder_calls(2)
        with observer(model, store_n_calls=1, stream_to=tmp_path / "run"):
            model(*args0, **kw0)
            with pytest.raises(CaptureError, match="nested"), observer(model, stream_to=tmp_path / "other"):
                pass
            with observer(model, store_n_calls=1):  # records into the outer stream
                model(*args1, **kw1)
            assert manifest_calls(tmp_path / "run") >= 1
        assert len(load_bundle(tmp_path / "run").calls) == 2
        assert not (tmp_path / "other").exists()

    def test_streaming_from_many_threads(self, tmp_path: Path) -> None:
        class Tagged(torch.nn.Module):
            def forward(self, x, shared):
                time.sleep(random.random() / 500)
                return x * 2 + shared

        model, observer = Tagged(), InputObserver()
        shared = torch.zeros(3)
        with observer(model, store_n_calls=64, stream_to=tmp_path / "run"), ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: model(torch.full((1 + i % 5, 3), float(i)), shared), range(64)))
        bundle = load_bundle(tmp_path / "run")
        assert len(bundle.calls) == 64 and bundle.verify() == []
        tags = set()
        for call in bundle.calls:
            x, out = bundle.tensor(call.args[0].key), bundle.tensor(call.outputs.key)
            assert torch.equal(out, x * 2)
            tags.add(int(x[0, 0]))
        assert tags == set(range(64))

    def test_streaming_large_tensors_from_many_threads(self, tmp_path: Path) -> None:
        class Tagged(torch.nn.Module):
            def forward(self, x):
                time.sleep(random.random() / 500)
                return x * 2

        model, observer = Tagged(), InputObserver()
        n = POOLED_MIN_BYTES // 4 + 100  # every snapshot goes through the buffer pool
        with observer(model, store_n_calls=48, stream_to=tmp_path / "run"), ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: model(torch.full((n + i % 3,), float(i))), range(48)))
        bundle = load_bundle(tmp_path / "run")
        assert len(bundle.calls) == 48 and bundle.verify() == []
        tags = set()
        for call in bundle.calls:
            x, out = bundle.tensor(call.args[0].key), bundle.tensor(call.outputs.key)
            assert torch.equal(x, torch.full_like(x, x[0])) and torch.equal(out, x * 2)
            tags.add(int(x[0]))
        assert tags == set(range(48))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="names fsynced files through /proc")
class TestDurability:
    @staticmethod
    def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """Record the path of every file or directory fsynced from now on."""
        synced: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        return synced

    @pytest.mark.usefixtures("thread_writer")
    def test_by_default_every_file_is_fsynced_when_the_block_is_left(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        synced = self.fsynced(monkeypatch)
        bundle = tmp_path / "run"
        model, observer, during = Decoder(), InputObserver(), []
        with observer(model, store_n_calls=4, stream_to=bundle):
            for args, kwargs in decoder_calls(4):
                model(*args, **kwargs)
                during.append(len(synced))
        assert during == [0, 0, 0, 0]  # renamed into place, not fsynced, while the block runs
        real = bundle.resolve()
        files = {str(p) for p in (real / "calls").glob("*")}
        assert files == {str(real / "calls" / "segment-000000.bin")} and files <= set(synced)  # 4 calls, 1 file
        assert {str(real), str(real / "calls"), str(real / ".manifest.json.tmp")} <= set(synced)
        # the final manifest comes last, then the directory without the journal
        assert synced[-3:] == [str(real / ".manifest.json.tmp"), str(real), str(real)]
        assert not (real / "journal.jsonl").exists()
        assert load_bundle(bundle).verify() == [] and manifest_calls(bundle) == 4

    @pytest.mark.usefixtures("thread_writer")
    def test_durable_fsyncs_each_call_before_the_next_is_accepted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        synced = self.fsynced(monkeypatch)
        bundle = tmp_path / "run"
        model, observer = Decoder(), InputObserver()
        with observer(model, store_n_calls=4, stream_to=bundle, durable=True):
            for i, (args, kwargs) in enumerate(decoder_calls(4)):
                model(*args, **kwargs)
                if i:  # call i was accepted once call i - 1 was written: its range fsynced, then its line
                    assert sum(f.endswith("/calls/segment-000000.bin") for f in synced) >= i
                    assert sum(f.endswith("/journal.jsonl") for f in synced) >= i
        assert load_bundle(bundle).verify() == [] and manifest_calls(bundle) == 4


class TestBufferPool:
    @pytest.mark.usefixtures("thread_writer")
    def test_copies_wait_for_the_writer_beyond_one_and_a_half_calls(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real_take, real_write = BufferPool.take, _writer.write_tensor_file
        lent: list[int] = []

        def take(self: BufferPool, nbytes: int) -> torch.Tensor:
            buf = real_take(self, nbytes)
            lent.append(self._lent)
            return buf

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.01)  # a writer slower than the model: the copies catch up with it
            return real_write(*args, **kwargs)

        monkeypatch.setattr(BufferPool, "take", take)
        monkeypatch.setattr(_writer, "write_tensor_file", slow_write)
        n = POOLED_MIN_BYTES // 4  # one pooled buffer per tensor
        model, observer = Doubler(), InputObserver()
        with observer(model, store_n_calls=12, stream_to=tmp_path / "run"):
            for i in range(12):
                model(torch.full((n,), float(i)))
        call = 2 * POOLED_MIN_BYTES  # one input, one output
        assert max(lent) <= call + call // 2  # 2 calls without the budget
        bundle = load_bundle(tmp_path / "run")
        assert bundle.verify() == []
        for i, c in enumerate(bundle.calls):  # no buffer was reused before its bytes were written
            assert torch.equal(bundle.tensor(c.args[0].key), torch.full((n,), float(i)))
            assert torch.equal(bundle.tensor(c.outputs.key), torch.full((n,), 2.0 * i))

    def test_a_recycled_key_is_read_once_its_file_is_complete(self, tmp_path: Path) -> None:
        table = SnapshotTable()
        table.pool = BufferPool()
        x = torch.arange(POOLED_MIN_BYTES // 4, dtype=torch.float32)
        table["t0"] = table.snapshot(x)
        path = tmp_path / "f.safetensors"
        entry = write_tensor_file(path, {"t0": x})
        table.released("t0")  # its bytes are in the file, the file is not complete yet
        assert "t0" in table and table.shape("t0") == tuple(x.shape) and table.in_memory() == 0
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(table.get("t0")))
        reader.start()
        time.sleep(0.05)
        assert not got  # waits for the writer
        table.written(
            [("t0", path.name, "t0", "F32", tuple(x.shape), "cpu", None, None)], tmp_path, {path.name: entry.size}
        )
        reader.join(10)
        assert torch.equal(got[0], x)

    def test_a_packed_answer_is_applied_when_a_read_waits_for_its_key(self, tmp_path: Path) -> None:
        """The writer process's answer is kept as it came; the read of a key it names applies it, waiting or not."""
        table = SnapshotTable()
        x, y = torch.arange(6.0), torch.ones(2, 3)
        table["t0"], table["t1"] = x.clone(), y.clone()
        table.in_ring([(["t0"], x.dtype, tuple(x.shape), 0, x.nbytes, x.nbytes)])  # copied: memory lets it go
        table.in_ring([(["t1"], y.dtype, tuple(y.shape), 0, y.nbytes, y.nbytes)])
        path = tmp_path / "f.safetensors"
        entry = write_tensor_file(path, {"t0": x, "t1": y})
        rows = [
            ("t0", path.name, "t0", "F32", tuple(x.shape), "cpu", None, None),
            ("t1", path.name, "t1", "F32", tuple(y.shape), "cpu", None, None),
        ]
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(table.get("t0")))
        reader.start()
        time.sleep(0.05)
        assert not got  # pending: waits for the answer
        table.written_packed(pack_answer(rows, {path.name: entry}), tmp_path)
        reader.join(10)
        assert torch.equal(got[0], x)
        assert torch.equal(table.get("t1"), y) and table.shape("t1") == (2, 3)

    def test_a_packed_answer_counts_from_when_it_came_not_from_when_it_is_applied(self, tmp_path: Path) -> None:
        """Keys the table drops after an answer came (discard: what was not written) keep what the answer said."""
        table = SnapshotTable()
        x, y = torch.arange(4.0), torch.zeros(3)
        table["t0"], table["t1"] = x.clone(), y.clone()
        table.in_ring([(["t0"], x.dtype, (4,), 0, x.nbytes, x.nbytes), (["t1"], y.dtype, (3,), 0, y.nbytes, y.nbytes)])
        path = tmp_path / "f.safetensors"
        entry = write_tensor_file(path, {"t0": x})
        row = ("t0", path.name, "t0", "F32", (4,), "cpu", None, None)
        table.written_packed(pack_answer([row], {path.name: entry}), tmp_path)  # t0 written, t1 not
        table.discard(["t0", "t1"])  # a later failure drops what was not written
        assert torch.equal(table.get("t0"), x)  # written before the discard: read from its file
        assert "t1" not in table
        with pytest.raises(KeyError):
            table.get("t1")

    def test_a_recycled_key_whose_file_failed_is_gone(self) -> None:
        table = SnapshotTable()
        table.pool = BufferPool()
        table["t0"] = table.snapshot(torch.ones(POOLED_MIN_BYTES // 4))
        table.released("t0")
        table.discard(["t0"])
        assert "t0" not in table
        with pytest.raises(KeyError):
            table.get("t0")


def wait_listed(bundle: Path, n: int) -> None:
    """Wait until the bundle lists ``n`` calls (the writer process writes them in its own time)."""
    deadline = time.monotonic() + 120
    while manifest_calls(bundle) < n:
        assert time.monotonic() < deadline, f"{bundle} never listed {n} calls"
        time.sleep(0.01)


@pytest.mark.usefixtures("process_writer")
class TestWriterProcess:
    """The writer process fed through shared memory (``iobundle.capture._writer_process``, ``IOBUNDLE_WRITER=process``)."""

    @staticmethod
    def parent_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
        """The indices of the calls this process writes itself (filled by its BundleWriter.write_call)."""
        indices: list[int] = []
        real = _writer.BundleWriter.write_call

        def write_call(self: Any, call: Any, *args: Any, **kwargs: Any) -> list[str]:
            indices.append(call.index)
            return real(self, call, *args, **kwargs)

        monkeypatch.setattr(_writer.BundleWriter, "write_call", write_call)
        return indices

    def test_a_call_leaves_memory_once_its_bytes_are_in_the_ring(self, tmp_path: Path) -> None:
        """The child answers calls many at once: until then memory holds none of their snapshots, only the next call's input."""
        observer, held = InputObserver(), []
        n = 1000  # small: copied (the input) and referenced (the output), never pooled

        class Holding(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                held.append(observer._table.in_memory())
                return x * 2

        model = Holding()
        with observer(model, store_n_calls=20, stream_to=tmp_path / "run"):
            for i in range(20):
                model(torch.full((n,), float(i)))
            # read back while not answered yet: the key waits for the answer (20 ms without a call), then reads
            last = observer._rc.calls[-1].outputs.key
            assert torch.equal(observer._table.get(last), torch.full((n,), 38.0))
        assert max(held) == n * 4  # the input copy of the call running, nothing of earlier calls
        bundle = load_bundle(tmp_path / "run")
        assert len(bundle.calls) == 20 and bundle.verify() == []

    @pytest.mark.parametrize("durable", [False, True])
    def test_calls_are_written_by_the_writer_process(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
    ) -> None:
        bundle = tmp_path / "run.iobundle"
        mine = self.parent_writes(monkeypatch)
        model, observer, calls = Decoder(), InputObserver(), decoder_calls(6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to the thread
            outputs = run(model, observer, calls, stream_to=bundle, durable=durable)
        assert mine == []
        loaded = load_bundle(bundle)
        assert [c.index for c in loaded.calls] == list(range(6)) and loaded.verify() == []
        assert not (bundle / "journal.jsonl").exists()  # closed: the final manifest is written
        for call, (args, _), out in zip(loaded.calls, calls, outputs):
            assert_same(loaded.tensor(call.args[0].key), args[0])
            assert_same(loaded.tensor(call.outputs.items[0].key), out["logits"])
        assert str(observer.infer_dynamic_shapes()) == str(loaded.infer_dynamic_shapes())

    def test_a_non_finite_constant_in_a_container_reaches_the_bundle(self, tmp_path: Path) -> None:
        class Scaled(torch.nn.Module):
            def forward(self, x: torch.Tensor, limits: dict[str, Any]) -> torch.Tensor:
                return x.clamp(max=limits["high"][0])

        observer, model = InputObserver(), Scaled()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the child accepts every call: none incomplete
            with observer(model, store_n_calls=3, stream_to=tmp_path / "run"):
                for i in range(3):
                    model(torch.arange(4.0 + i), {"high": [float("inf"), float("nan"), -0.0]})
        loaded = load_bundle(tmp_path / "run")
        assert [c.status for c in loaded.calls] == ["ok"] * 3
        values = [item.value for item in loaded.calls[2].args[1].items[0].items]
        assert values[0] == float("inf") and values[1] != values[1] and str(values[2]) == "-0.0"

    def test_the_child_stores_a_growing_tensor_as_its_new_part(self, tmp_path: Path) -> None:
        run(Doubler(), InputObserver(), [((torch.arange(10 + i),), {}) for i in range(4)], stream_to=tmp_path / "run")
        loaded = load_bundle(tmp_path / "run")
        extended = [k for k, e in loaded.manifest.tensors.items() if e.extends is not None]
        assert len(extended) == 6  # inputs and outputs of calls 1-3, checked byte for byte by the child
        assert loaded.verify() == []
        for i, call in enumerate(loaded.calls):
            assert torch.equal(loaded.tensor(call.args[0].key), torch.arange(10 + i))

    @pytest.mark.parametrize("variable", ["process", "thread", "auto", None])
    def test_iobundle_writer_in_the_environment_chooses_the_writer(self, tmp_path: Path, variable: str | None) -> None:
        script = textwrap.dedent(
            f"""
            import torch
            from iobundle import InputObserver, load_bundle
            from iobundle.capture import _writer_process

            model, observer = torch.nn.Identity(), InputObserver()
            with observer(model, store_n_calls=2, stream_to={str(tmp_path / "run")!r}):
                model(torch.ones(2))
                model(torch.ones(3))
            print(len(_writer_process._CHILDREN), load_bundle({str(tmp_path / "run")!r}).num_obs())
            """
        )
        env = {k: v for k, v in os.environ.items() if k != "IOBUNDLE_WRITER"}
        if variable is not None:
            env["IOBUNDLE_WRITER"] = variable
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == (["0", "2"] if variable == "thread" else ["1", "2"])  # default: auto

    @pytest.mark.parametrize(
        ("setting", "kind"), [("process", "process"), ("thread", "thread"), ("auto", "auto"), ("", "auto")]
    )
    def test_the_writer_setting_is_process_thread_or_auto(
        self, monkeypatch: pytest.MonkeyPatch, setting: str, kind: str
    ) -> None:
        from iobundle.capture import _stream

        monkeypatch.setattr(_stream, "WRITER", setting)
        assert _stream.stream_writer_kind() == kind

    def test_the_next_stream_reuses_the_idle_writer_process(self, tmp_path: Path) -> None:
        model = Decoder()
        run(model, InputObserver(), decoder_calls(2), stream_to=tmp_path / "a")
        idle = list(_writer_process._IDLE)
        assert len(idle) >= 1 and all(c.proc.poll() is None for c in idle)
        run(model, InputObserver(), decoder_calls(2), stream_to=tmp_path / "b")
        assert {c.proc.pid for c in _writer_process._IDLE} & {c.proc.pid for c in idle}
        assert [load_bundle(tmp_path / n).num_obs() for n in "ab"] == [2, 2]

    def test_a_write_error_in_the_child_marks_the_call_incomplete(self, tmp_path: Path) -> None:
        """A real error in the child (its calls/ folder replaced by a file): the same BundleWriteError, warned."""
        bundle = tmp_path / "run.iobundle"
        model, observer = Doubler(), InputObserver()
        warned = pytest.warns(ObservationWarning, match=r"could not record call 1: .*BundleWriteError: Cannot write")
        # call 1's tensors are large: they need a file of their own (the calls' segment is open already)
        with warned, observer(model, store_n_calls=3, stream_to=bundle):
            model(torch.ones(3))
            wait_listed(bundle, 1)  # call 0 is written
            (bundle / "calls").rename(tmp_path / "calls-away")
            (bundle / "calls").write_text("not a folder")
            model(torch.ones(20_000))
            wait_listed(bundle, 2)  # call 1 failed: its journal line lists it incomplete
            (bundle / "calls").unlink()
            (tmp_path / "calls-away").rename(bundle / "calls")
            model(torch.ones(5))
        assert [c.status for c in observer.info.calls][:2] == ["ok", "incomplete"]
        loaded = load_bundle(bundle)
        assert [c.status for c in loaded.calls][:2] == ["ok", "incomplete"] and loaded.verify() == []

    def test_no_process_falls_back_to_the_thread_with_one_warning(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_writer_process, "_IDLE", [])
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
        with pytest.warns(ObservationWarning) as record:
            run(Decoder(), InputObserver(), decoder_calls(4), stream_to=tmp_path / "run")
        assert len(record) == 1 and "cannot start its writer process" in str(record[0].message)
        loaded = load_bundle(tmp_path / "run")
        assert loaded.num_obs() == 4 and loaded.verify() == []

    def test_a_child_that_dies_before_starting_leaves_its_calls_to_the_thread(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        false = "/bin/false" if Path("/bin/false").exists() else "/usr/bin/false"
        monkeypatch.setattr(_writer_process, "_IDLE", [])
        monkeypatch.setattr(sys, "executable", false)  # exits at once, having read nothing
        with pytest.warns(ObservationWarning) as record:
            run(Decoder(), InputObserver(), decoder_calls(4), stream_to=tmp_path / "run")
        assert len(record) == 1 and "writer process" in str(record[0].message) and "stopped" in str(record[0].message)
        loaded = load_bundle(tmp_path / "run")
        assert [c.status for c in loaded.calls] == ["ok"] * 4 and loaded.verify() == []

    def test_a_call_whose_child_died_while_it_was_handed_over_is_written_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The child dies after a call was handed over and the reader sees it before the call's send fails:
        the call is among the lost ones, and the thread writes it once (it was written twice)."""
        child = tmp_path / "a-child-that-never-starts"
        child.write_text("#!/bin/sh\nexec sleep 600\n")
        child.chmod(0o755)
        monkeypatch.setattr(_writer_process, "_IDLE", [])
        monkeypatch.setattr(sys, "executable", str(child))
        real_send = _writer_process._Child.send
        handed: list[int] = []

        def send(self: _writer_process._Child, message: tuple[Any, ...]) -> None:
            if message[0] == "call" and not handed:
                handed.append(message[1])
                reader = next(t for t in threading.enumerate() if t.name.startswith("iobundle-writer-reader"))
                self.proc.kill()
                reader.join(60)  # it saw the child's end and took this call among the lost ones
                assert not reader.is_alive()
            real_send(self, message)  # the pipe is closed now: OSError

        monkeypatch.setattr(_writer_process._Child, "send", send)
        with pytest.warns(ObservationWarning) as record:
            run(Decoder(), InputObserver(), decoder_calls(4), stream_to=tmp_path / "run")
        messages = [str(w.message) for w in record]
        assert handed and len(messages) == 1 and "stopped" in messages[0], messages
        loaded = load_bundle(tmp_path / "run")
        assert [c.status for c in loaded.calls] == ["ok"] * 4 and loaded.verify() == []

    def test_a_killed_writer_process_leaves_the_next_calls_to_the_thread(self, tmp_path: Path) -> None:
        bundle = tmp_path / "run.iobundle"
        model, observer = Doubler(), InputObserver()
        with (
            pytest.warns(ObservationWarning, match="writer process .* stopped"),
            observer(model, store_n_calls=6, stream_to=bundle),
        ):
            for i in range(3):
                model(torch.full((i + 1,), float(i)))
            wait_listed(bundle, 3)
            busy = [c for c in _writer_process._CHILDREN if c not in _writer_process._IDLE]
            assert len(busy) == 1
            os.kill(busy[0].proc.pid, signal.SIGKILL)
            busy[0].proc.wait(60)  # dead for sure: the next call finds its pipe closed
            for i in range(3, 6):
                model(torch.full((i + 1,), float(i)))
        loaded = load_bundle(bundle)
        assert [c.index for c in loaded.calls] == list(range(6)) and loaded.verify() == []
        assert [c.status for c in loaded.calls] == ["ok"] * 6
        for call in loaded.calls:  # the calls after the kill were written by the thread
            assert torch.equal(loaded.tensor(call.outputs.key), torch.full((call.index + 1,), 2.0 * call.index))
        from safetensors import safe_open

        for file in (bundle / "calls").iterdir():  # the dead process's segment too: sealed when the stream closed
            with safe_open(file, framework="pt") as f:
                listed = [e for e in loaded.manifest.tensors.values() if e.file == f"calls/{file.name}"]
                assert listed and len(f.keys()) == len(listed)


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


# --------------------------------------------------------------------------- SIGKILL

# A zygote imports torch and iobundle once, then forks one capturing child per trial: the trials
# cost a fork, not an interpreter start. The zygote runs no torch op before forking.
ZYGOTE = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from iobundle.observer import InputObserver


    def capture(path, size, slow, durable, mode, calls):
        def say(text):  # one write per line: the writer thread prints too
            os.write(1, (text + "\\n").encode())

        from iobundle.capture import _stream

        # the hooks below patch this process
        _stream.WRITER = "process" if mode.startswith("process") else "auto" if mode.startswith("auto") else "thread"

        if slow:
            real_replace = os.replace

            def replace(src, dst):  # announce each rename, hold the file complete but unrenamed, and after
                say(f"rename {src}")
                time.sleep(slow)
                real_replace(src, dst)
                say(f"renamed {dst}")
                time.sleep(slow if mode in ("manifest-renamed", "reopen-renamed") else 0)

            os.replace = replace
        if mode == "journal-append":
            from iobundle.capture import ObservationWarning, _writer, _writer_process

            def write_all(fd, data):  # hold each journal line half written
                os.write(fd, data[: len(data) // 2])
                say("append")
                time.sleep(slow)
                os.write(fd, data[len(data) // 2 :])

            _writer._write_all = write_all
        if mode == "segment-append":
            real_pwritev = os.pwritev

            def pwritev(fd, parts, offset):  # hold each range of a segment half written
                data = b"".join(parts)
                half = len(data) // 2
                os.pwrite(fd, data[:half], offset)
                say("segment")
                time.sleep(slow)
                return half + real_pwritev(fd, [data[half:]], offset + half)

            os.pwritev = pwritev

        class Doubler(torch.nn.Module):
            def forward(self, x, shared):
                return x * 2, shared[:4] + 1

        shared = torch.arange(size, dtype=torch.float32)  # passed to every call: written once
        model, observer = Doubler(), InputObserver()
        first = calls if mode.startswith(("manifest", "reopen")) else 100_000
        with observer(model, store_n_calls=100_000, stream_to=path, durable=durable):
            say("ready")
            for i in range(first):
                n = size + i if mode != "auto-mixed" or i % 3 != 2 else 2_000_000 + i  # every third call large
                model(torch.full((n,), float(i)), shared)
                say(f"done {i + 1}")
        say("closed")
        if mode.startswith("reopen"):  # a second block appends to the same bundle
            with observer(model, store_n_calls=100_000, stream_to=path, durable=durable):
                for i in range(first, 100_000):
                    model(torch.full((size + i,), float(i)), shared)
                    say(f"done {i + 1}")
        time.sleep(60)


    for line in sys.stdin:
        command, *rest = line.split()
        if command == "run":
            log, path, size, slow, durable, mode, calls = rest
            pid = os.fork()
            if pid == 0:
                try:
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(os.open(log + ".stderr", os.O_WRONLY | os.O_CREAT, 0o644), 2)
                    capture(path, int(size), float(slow), durable == "1", mode, int(calls))
                finally:
                    os._exit(0)
            print("pid", pid, flush=True)
        elif command == "kill":
            pid = int(rest[0])
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # dead for sure: nothing writes to the bundle any more
            print("dead", flush=True)
    """
)


class Zygote:
    """A preloaded interpreter that forks capturing children on demand and kills them."""

    def __init__(self, script: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._lock = threading.Lock()  # two trials may share a zygote: one request/answer at a time

    def _ask(self, line: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        with self._lock:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
            return self.process.stdout.readline().strip()

    def run(self, log: Path, bundle: Path, size: int, slow: float, durable: bool, mode: str, calls: int) -> int:
        return int(self._ask(f"run {log} {bundle} {size} {slow} {int(durable)} {mode} {calls}").split()[1])

    def kill(self, pid: int) -> None:
        assert self._ask(f"kill {pid}") == "dead"

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)


def read_lines(log: Path) -> list[str]:
    try:
        text = log.read_text("utf-8")
    except FileNotFoundError:
        return []
    return text.split("\n")[:-1]  # the last piece may be a line being written


def wait_for(log: Path, predicate: Any, *, start: int = 0, timeout: float = 60.0) -> int:
    """Wait until a line from ``start`` on satisfies ``predicate``; return its index."""
    deadline = time.monotonic() + timeout
    while True:
        lines = read_lines(log)
        for i in range(start, len(lines)):
            if predicate(lines[i]):
                return i
        if time.monotonic() > deadline:
            raise AssertionError(f"{log}: the child never printed what was awaited; last lines: {lines[-5:]}")
        time.sleep(0.001)


MODES = {  # mode: (floats per tensor, seconds each rename or append is held)
    "delay": (1000, 0.0),  # kill after a random delay
    "big": (2_000_000, 0.0),  # 8 MB tensors: kills land inside writes
    "tensor-rename": (20_000, 0.1),  # kill once a call's own file is written (and fsynced if durable), not yet renamed
    "segment-append": (1000, 0.1),  # kill with a call's range of a segment half written
    "journal-append": (1000, 0.1),  # kill with a call's journal line half written
    "manifest-rename": (1000, 0.1),  # leaving the block: kill once the final manifest is written, not yet renamed
    "manifest-renamed": (1000, 0.1),  # leaving the block: kill once it is renamed, the journal not yet removed
    "reopen-rename": (1000, 0.1),  # a second block: kill once the new journal is written, not yet renamed
    "reopen-renamed": (1000, 0.1),  # a second block: kill once it is renamed, the manifest not yet removed
    "process-delay": (1000, 0.0),  # the writer process: kill the recording process after a random delay
    "process-big": (2_000_000, 0.0),  # the writer process, 8 MB tensors
    "auto-mixed": (1000, 0.0),  # the default: small calls to the writer process, every third one (8 MB) to the thread
}


def call_length(mode: str, size: int, i: int) -> int:
    """The length of call ``i``'s first input (the zygote's capture makes the same)."""
    return size + i if mode != "auto-mixed" or i % 3 != 2 else 2_000_000 + i


def writer_children(pid: int) -> list[int]:
    """The writer processes that ``pid`` started."""
    found = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat_path.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat_path.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"_writer_child" in cmdline:
            found.append(int(stat_path.parent.name))
    return found


def wait_exited(pids: list[int], timeout: float = 120.0) -> bool:
    """Wait until every process of ``pids`` has exited (gone, or a zombie nobody reaped); whether they did."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state in ("Z", "X"):
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    return True


def kill_trial(zygote: Zygote, workdir: Path, mode: str, durable: bool, rng: random.Random) -> dict[str, Any]:
    """Run one capture, kill it at a moment chosen by ``mode``, check the bundle left behind."""
    size, slow = MODES[mode]
    bundle, log = workdir / "run.iobundle", workdir / "child.log"
    workdir.mkdir()
    k = rng.randint(1, 4)
    pid = zygote.run(log, bundle, size, slow, durable, mode, k)
    children: list[int] = []
    try:
        wait_for(log, lambda line: line == "ready")
        children = writer_children(pid)
        if mode.startswith("process"):
            assert len(children) == 1, f"{mode}: the writer processes of {pid}: {children}"
        if mode in ("delay", "process-delay"):
            time.sleep(rng.uniform(0.0, 0.3))
        elif mode in ("big", "process-big", "auto-mixed"):
            time.sleep(rng.uniform(0.0, 1.0))
        elif mode in ("journal-append", "segment-append"):
            after = wait_for(log, lambda line: line == f"done {k}")
            wait_for(log, lambda line: line == ("append" if mode == "journal-append" else "segment"), start=after)
        elif mode == "tensor-rename":
            after = wait_for(log, lambda line: line == f"done {k}")
            suffix = f"calls/.{k:06d}.safetensors.tmp"
            wait_for(log, lambda line: line.startswith("rename") and line.endswith(suffix), start=after)
        else:
            after = wait_for(log, lambda line: line == f"done {k}")
            name = "manifest.json" if mode.startswith("manifest") else "journal.jsonl"
            wanted = f"rename {bundle}/.{name}.tmp" if mode.endswith("rename") else f"renamed {bundle}/{name}"
            wait_for(log, lambda line: line == wanted, start=after)
    finally:
        zygote.kill(pid)
    # the writer process writes every call it received, then exits: it outlives its parent only that long
    orphaned = not wait_exited(children)
    lines = read_lines(log)
    reported = max((int(line.split()[1]) for line in lines if line.startswith("done ")), default=0)
    leftovers = sorted(p.name for p in bundle.rglob(".*.tmp"))
    loaded = load_bundle(bundle)
    n = len(loaded.calls)
    # leaving a block waits for every call: then each one that returned is listed
    # and a writer process loses nothing it received: only a call whose hand-off the kill cut short
    in_flight = 0 if mode.startswith(("manifest", "reopen", "process")) else 1
    assert n >= reported - in_flight, f"{mode}: {reported} calls finished but the bundle lists {n}"
    assert loaded.verify() == [], mode
    assert [c.index for c in loaded.calls] == list(range(n))
    shared_keys = set()
    for i, call in enumerate(loaded.calls):
        assert call.status == "ok"
        x, shared = (loaded.tensor(node.key) for node in call.args)
        doubled, head = (loaded.tensor(k) for k in tensor_keys(call.outputs))
        assert torch.equal(x, torch.full((call_length(mode, size, i),), float(i)))
        assert torch.equal(doubled, x * 2)
        assert torch.equal(head, shared[:4] + 1)
        assert all(loaded.manifest.tensors[k].file in loaded.manifest.files for k in call_keys(call))
        shared_keys.add(call.args[1].key)
    assert len(shared_keys) <= 1  # deduplicated: one key, in the first call's file or the first segment
    if shared_keys:
        file = loaded.manifest.tensors[shared_keys.pop()].file
        own = size * 4 >= _writer.SEGMENT_TENSOR_BYTES  # float32
        assert file == ("calls/000000.safetensors" if own else "calls/segment-000000.bin"), file
    segments = {n: e.size for n, e in loaded.manifest.files.items() if e.ranges is not None}
    tail = any(p.stat().st_size > segments.get(f"calls/{p.name}", 0) for p in bundle.glob("calls/segment-*.bin"))
    journal, manifest = (bundle / "journal.jsonl").exists(), (bundle / "manifest.json").exists()
    torn = journal and not (bundle / "journal.jsonl").read_bytes().endswith(b"\n")
    return {
        "torn": torn,
        "segment_tail": tail,
        "mode": mode,
        "durable": durable,
        "reported": reported,
        "listed": n,
        "unfinished_files": leftovers,
        "orphaned": orphaned,
        "state": ("journal" if journal else "")
        + ("+" if journal and manifest else "")
        + ("manifest" if manifest else ""),
    }


@pytest.mark.skipif(
    not hasattr(os, "fork") or not Path("/proc/self/fd").exists(), reason="needs fork, SIGKILL and /proc"
)
def test_sigkill_at_any_moment_leaves_a_loadable_bundle(tmp_path: Path) -> None:
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    rng = random.Random(int(os.environ.get("IOBUNDLE_KILL_SEED", "5")))
    steps = [
        "tensor-rename",
        "segment-append",
        "journal-append",
        "manifest-rename",
        "manifest-renamed",
        "reopen-rename",
        "reopen-renamed",
    ]
    modes = [(m, False) for m in ["delay"] * 6 + ["big"] * 5 + steps * 3 + ["process-delay"] * 4 + ["process-big"] * 3]
    modes += [(m, False) for m in ["auto-mixed"] * 4]
    modes += [(m, True) for m in ["delay", "big", *steps, "process-delay", "process-big", "auto-mixed"]]
    trials = [(i, mode, durable, random.Random(rng.random())) for i, (mode, durable) in enumerate(modes)]
    workers = 2
    zygotes = [Zygote(script) for _ in range(workers)]
    try:
        with ThreadPoolExecutor(workers) as pool:
            results = list(
                pool.map(
                    lambda t: kill_trial(zygotes[t[0] % workers], tmp_path / f"trial{t[0]}", t[1], t[2], t[3]),
                    trials,
                )
            )
    finally:
        for zygote in zygotes:
            zygote.close()
    assert len(results) == len(modes) >= 20
    by_mode = {m: [r for r in results if r["mode"] == m] for m in MODES}
    summary = {
        m: {
            "trials": len(rs),
            "durable": sum(r["durable"] for r in rs),
            "reported": [r["reported"] for r in rs],
            "listed": [r["listed"] for r in rs],
            "killed_mid_write": sum(bool(r["unfinished_files"]) for r in rs),
            "left": sorted({r["state"] for r in rs}),
            "orphaned": sum(r["orphaned"] for r in rs),
        }
        for m, rs in by_mode.items()
    }
    print("kill trials:", json.dumps(summary))
    assert not any(r["orphaned"] for r in results), summary  # every writer process ended after its parent
    # the rename modes really killed inside a write: the unfinished file was left behind, unlisted
    assert all(any(".safetensors.tmp" in f for f in r["unfinished_files"]) for r in by_mode["tensor-rename"]), summary
    assert all(".manifest.json.tmp" in r["unfinished_files"] for r in by_mode["manifest-rename"]), summary
    assert all(".journal.jsonl.tmp" in r["unfinished_files"] for r in by_mode["reopen-rename"]), summary
    # each step of the journal's life was hit: only a journal, then both (they agree), never neither
    assert {r["state"] for r in by_mode["journal-append"]} == {"journal"}, summary
    # a range half appended: past the segment's size as the journal gives it, never read
    assert {r["state"] for r in by_mode["segment-append"]} == {"journal"}, summary
    assert all(r["segment_tail"] for r in by_mode["segment-append"]), summary
    assert all(r["torn"] for r in by_mode["journal-append"]), summary  # a half line, which the reader ignored
    assert {r["state"] for r in by_mode["manifest-rename"]} == {"journal"}, summary
    assert {r["state"] for r in by_mode["manifest-renamed"]} == {"journal+manifest"}, summary
    assert {r["state"] for r in by_mode["reopen-rename"]} == {"manifest"}, summary
    assert {r["state"] for r in by_mode["reopen-renamed"]} == {"journal+manifest"}, summary


# --------------------------------------------------------------------------- after a killed writer

KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from iobundle import InputObserver
    from iobundle.capture import _stream, _writer

    _stream.WRITER = "thread"
    path, moment = sys.argv[1], sys.argv[2]
    if moment == "rename":  # a call's own file is complete under its temporary name, not renamed yet
        real_replace = os.replace

        def replace(src, dst):
            if str(src).endswith("calls/.000002.safetensors.tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)

        os.replace = replace
    else:  # a call's own file is renamed into place, its journal line not written yet
        appended = []

        def write_all(fd, data):
            appended.append(data)
            if len(appended) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            os.write(fd, data)

        _writer._write_all = write_all

    class Doubler(torch.nn.Module):
        def forward(self, x):
            return x * 2

    model, observer = Doubler(), InputObserver()
    with observer(model, store_n_calls=5, stream_to=path):
        for i in range(5):  # 80 KB tensors: each call has its own file
            model(torch.full((20_000,), float(i)))
    """
)


@pytest.mark.parametrize(
    ("moment", "left"), [("rename", "calls/.000002.safetensors.tmp"), ("journal", "calls/000002.safetensors")]
)
def test_a_killed_streams_leftovers_are_reported_then_removed_by_the_next_stream(
    tmp_path: Path, moment: str, left: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer SIGKILLed mid-file leaves a temporary file, or a complete file no line lists: the bundle opens
    without them, verify() warns about them, and the next stream (overwrite=True) removes them, only them."""
    bundle, outside = tmp_path / "run", tmp_path / "outside.bin"
    script = tmp_path / "capture.py"
    script.write_text(KILLED_WRITER)
    done = subprocess.run([sys.executable, str(script), str(bundle), moment], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert (bundle / "journal.jsonl").is_file() and not (bundle / "manifest.json").exists()
    assert (bundle / left).is_file()
    loaded = load_bundle(bundle)
    assert [c.index for c in loaded.calls] == [0, 1]
    with caplog.at_level("WARNING", logger="iobundle"):
        assert loaded.verify() == []  # a warning, not a problem
    assert [r.getMessage() for r in caplog.records] == loaded.unlisted_files()
    assert len(loaded.unlisted_files()) == 1 and str(bundle / left) in loaded.unlisted_files()[0]
    assert "killed" in loaded.unlisted_files()[0]
    # what is not the writers': a user's file in calls/ and beside it, a near-miss name, a link leading outside
    outside.write_bytes(b"mine")
    (bundle / "calls" / "notes.txt").write_text("mine")
    (bundle / "calls" / "000002.safetensors.bak").write_text("mine")
    (bundle / "notes.txt").write_text("mine")
    (bundle / "calls" / "000004.safetensors").symlink_to(outside)
    mine = {"calls/notes.txt", "calls/000002.safetensors.bak", "calls/000004.safetensors"}
    with pytest.raises(BundleExistsError, match="overwrite=True"), InputObserver()(Doubler(), stream_to=bundle):
        pass
    run(Doubler(), InputObserver(), [((torch.ones(3),), {})], stream_to=bundle, overwrite=True)
    reloaded = load_bundle(bundle)
    assert len(reloaded.calls) == 1 and reloaded.verify() == []
    files = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if not p.is_dir()}
    assert files == {"manifest.json", "notes.txt", *mine, *reloaded.manifest.files}
    assert (bundle / "calls" / "000004.safetensors").is_symlink() and outside.read_bytes() == b"mine"
    assert {m.split(": ")[0] for m in reloaded.unlisted_files()} == {str(bundle / n) for n in mine}
    assert all("never removes it" in m for m in reloaded.unlisted_files())
