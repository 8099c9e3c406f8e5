"""Format version 6 as docs/format.md specifies it: every tensor in a safetensors file, read without iobundle.

The reader recipe of docs/format.md (json and safetensors, torch as safetensors' framework) is taken
from the page itself and run over every closed golden bundle of the newest version, over a
streamed ``generate()`` of a tiny Llama and over a saved 3-call bundle: each call's tensors must
be the bytes iobundle loads, and the recorded inputs the bytes the model was called with.
``iobundle upgrade`` brings every older golden bundle to the newest version.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

from iobundle import InputObserver, load_bundle, upgrade_bundle  # noqa: E402
from iobundle.cli import main  # noqa: E402
from iobundle.errors import BundleWriteError, TensorFileError  # noqa: E402
from iobundle.schema import FORMAT_VERSION  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"
FORMAT_PAGE = Path(__file__).parents[2] / "docs" / "format.md"
sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))  # tiny_models.py
from tiny_models import tiny_llama  # noqa: E402


def recipe() -> Any:
    """``read_calls`` of the reader recipe in docs/format.md, executed from the page's code block."""
    page = FORMAT_PAGE.read_text("utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "def read_calls" in b]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(FORMAT_PAGE), "exec"), namespace)
    return namespace["read_calls"]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_recipe(path: Path) -> dict[int, list[torch.Tensor]]:
    """Every file of ``calls/`` opens with safetensors; the recipe gives each call's tensors as iobundle loads them."""
    for file in (path / "calls").iterdir():
        with safetensors.safe_open(file, framework="pt") as f:
            assert f.keys() is not None
    b = load_bundle(path)
    calls = dict(recipe()(path))
    assert sorted(calls) == [c.index for c in b.manifest.calls]
    for index, keys in slot_keys(path).items():
        assert len(calls[index]) == len(keys)
        for key, got in zip(keys, calls[index]):
            want = b.tensor(key)
            assert got.dtype == want.dtype and got.shape == want.shape and raw(got) == raw(want), (index, key)
    return calls


def slot_keys(path: Path) -> dict[int, list[str]]:
    """Per call index, the keys of its tensor slots as manifest.json lists them."""
    return {c["index"]: c["keys"] for c in json.loads((path / "manifest.json").read_text())["calls"]}


NEWEST = sorted(
    p.name
    for p in GOLDEN.iterdir()
    if (p / "manifest.json").exists() and f'"format_version":{FORMAT_VERSION},' in (p / "manifest.json").read_text()
)


def test_there_are_golden_bundles_of_the_newest_version():
    assert {"sealed_nested", "sealed_growing", "sealed_llama"} <= set(NEWEST)


@pytest.mark.parametrize("name", NEWEST)
def test_the_recipe_reads_every_golden_bundle_of_the_newest_version(name):
    if name == "sealed_llama":
        pytest.importorskip("transformers")
    check_recipe(GOLDEN / name)


class Inputs:
    """The tensors each call of ``model`` received (a forward pre-hook), cloned: what the bundle must hold."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen = {f"args.{i}": a for i, a in enumerate(args)} | {f"kwargs.{k}": v for k, v in kwargs.items()}
        self.calls.append({k: v.detach().clone() for k, v in seen.items() if isinstance(v, torch.Tensor)})


def check_inputs(path: Path, inputs: Inputs) -> None:
    """Each recorded input tensor is in the recipe's tensors of its call, byte for byte (found by its stored path)."""
    from iobundle.calls import call_paths

    b = load_bundle(path)
    calls = check_recipe(path)
    assert len(b.manifest.calls) == len(inputs.calls)
    for call, seen in zip(b.manifest.calls, inputs.calls):
        by_path = dict(call_paths(call))
        slots = slot_keys(path)[call.index]
        for at, value in seen.items():
            got = calls[call.index][slots.index(by_path[at])]
            assert got.dtype == value.dtype and raw(got) == raw(value), (call.index, at)


def test_a_streamed_generate_of_a_tiny_llama_is_safetensors_files_holding_the_inputs(tmp_path):
    pytest.importorskip("transformers")
    model, observer = tiny_llama(), InputObserver()
    inputs = Inputs(model)
    with torch.no_grad(), observer(model, stream_to=tmp_path / "run", store_n_calls=10):
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert any(p.name.startswith("segment-") for p in (tmp_path / "run" / "calls").iterdir())
    check_inputs(tmp_path / "run", inputs)


def test_a_saved_three_call_bundle_is_safetensors_files_holding_the_inputs(tmp_path):
    model, observer = torch.nn.Linear(4, 3), InputObserver()
    inputs = Inputs(model)
    with torch.no_grad(), observer(model):
        for n in (1, 2, 3):
            model(torch.randn(n, 4))
    observer.save(tmp_path / "run")
    assert [p.name for p in (tmp_path / "run" / "calls").iterdir()] == ["segment-000000.bin"]
    check_inputs(tmp_path / "run", inputs)


HEADER_EDITS = {  # an edit of the sealed header (parsed), and what the error says
    "dtype": (
        lambda h: h["call000000/args.0"].update(dtype="I32"),
        r"tensor 'call000000/args\.0' \(key 't0'\) is 'I32'",
    ),
    "stored shape": (lambda h: h["call000000/args.0"].update(shape=[8]), r"is 'F32' \[8\] in the file, F32 \[2, 4\]"),
    "offsets": (
        lambda h: h["call000000/outputs"].update(data_offsets=[0, 24]),
        r"tensor 'call000000/outputs' \(key 't1'\) starts at byte 0 of the data, the manifest says 32",
    ),
    "a key": (lambda h: h["__metadata__"].update({"call000000/args.0": "t9"}), r"key 't9' in __metadata__"),
    "a key not a string": (
        lambda h: h["__metadata__"].update({"call000000/args.0": ["t0"]}),
        r"tensor 'call000000/args\.0' of the header is named by no key",
    ),
    "a tensor too many": (
        lambda h: h.update({"extra": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}),
        r"tensor 'extra' of the header is named by no key",
    ),
    "a tensor missing": (lambda h: h.pop("call000000/outputs"), r"the header lists 1 tensors, the manifest 2"),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_a_segment_header_that_disagrees_with_the_manifest_is_refused_naming_the_file(edit, tmp_path):
    model, observer = torch.nn.Linear(4, 3), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
    observer.save(tmp_path / "run")
    segment = tmp_path / "run" / "calls" / "segment-000000.bin"
    data = bytearray(segment.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change, message = HEADER_EDITS[edit]
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    data[8 : 8 + n] = text + b" " * (n - len(text))  # the same region: only the header disagrees
    segment.write_bytes(bytes(data))
    b = load_bundle(tmp_path / "run")
    with pytest.raises(TensorFileError, match=r"calls/segment-000000\.bin: .*" + message):
        b.tensor(b.manifest.calls[0].args[0].key)
    assert any(
        "calls/segment-000000.bin" in p and re.search(message, p) for p in load_bundle(tmp_path / "run").verify()
    )


def test_a_segment_header_length_other_than_the_region_is_refused(tmp_path):
    model, observer = torch.nn.Linear(4, 3), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
    observer.save(tmp_path / "run")
    segment = tmp_path / "run" / "calls" / "segment-000000.bin"
    data = bytearray(segment.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[:8] = struct.pack("<Q", n - 8)  # still inside the file: it ends in the padding
    segment.write_bytes(bytes(data))
    b = load_bundle(tmp_path / "run")
    with pytest.raises(TensorFileError, match=r"calls/segment-000000\.bin: the header ends at byte 4088, but"):
        b.tensor(b.manifest.calls[0].args[0].key)


def _version(path: Path) -> int:
    """The format version of the golden bundle ``path`` (its manifest, or its journal's first line)."""
    member = path / ("manifest.json" if (path / "manifest.json").exists() else "journal.jsonl")
    return int(re.search(r'"format_version":\s*(\d+)', member.read_text("utf-8")).group(1))


OLDER = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir() and _version(p) < FORMAT_VERSION)


@pytest.mark.parametrize("name", OLDER)
def test_upgrade_brings_every_older_golden_bundle_to_the_newest_version(name, tmp_path):
    if name in ("llama_cache", "segments_model"):
        pytest.importorskip("transformers")
    old = load_bundle(GOLDEN / name)
    manifest = upgrade_bundle(GOLDEN / name, tmp_path / "new")
    new = load_bundle(tmp_path / "new")
    assert manifest.format_version == new.manifest.format_version == FORMAT_VERSION
    assert new.verify() == []
    assert [c.index for c in new.manifest.calls] == [c.index for c in old.manifest.calls]
    assert new.manifest.producer == old.manifest.producer
    assert new.manifest.model == old.manifest.model
    for key in old.manifest.tensors:
        assert raw(new.tensor(key)) == raw(old.tensor(key))
    check_recipe(tmp_path / "new")


def test_upgrade_finishes_a_killed_stream_and_never_writes_in_place(tmp_path, capsys):
    assert main(["upgrade", str(GOLDEN / "sealed_journal"), str(tmp_path / "done")]) == 0
    assert "format version 6" in capsys.readouterr().out
    check_recipe(tmp_path / "done")
    for target in (GOLDEN / "sealed_journal", GOLDEN / "sealed_journal" / "inside", GOLDEN):
        with pytest.raises(BundleWriteError, match="never rewritten in place"):
            upgrade_bundle(GOLDEN / "sealed_journal", target)


def test_a_segment_whose_seal_was_cut_short_still_reads_by_its_ranges(tmp_path):
    """Sealing writes the header, then its length: killed in between, the length reads 0 and the ranges stand."""
    model, observer = torch.nn.Linear(4, 3), InputObserver()
    with torch.no_grad(), observer(model):
        for n in (1, 2):
            model(torch.randn(n, 4))
    observer.save(tmp_path / "run")
    before = {k: raw(load_bundle(tmp_path / "run").tensor(k)) for k in load_bundle(tmp_path / "run").manifest.tensors}
    segment = tmp_path / "run" / "calls" / "segment-000000.bin"
    data = bytearray(segment.read_bytes())
    data[:8] = bytes(8)  # the header is there, its length not yet
    segment.write_bytes(bytes(data))
    b = load_bundle(tmp_path / "run")
    assert b.verify() == [] and {k: raw(b.tensor(k)) for k in b.manifest.tensors} == before


def test_a_complex128_tensor_keeps_its_call_file_so_the_segment_stays_readable(tmp_path):
    """The safetensors library has no C128: such a tensor goes to its call's own file, never to a segment."""

    class Twice(torch.nn.Module):
        def forward(self, x, z):
            return x * 2

    model, observer = Twice(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2), torch.zeros(2, dtype=torch.complex128))
    observer.save(tmp_path / "run")
    b = load_bundle(tmp_path / "run")
    assert {e.file for e in b.manifest.tensors.values() if e.dtype == "C128"} == {"calls/000000.safetensors"}
    with safetensors.safe_open(tmp_path / "run" / "calls" / "segment-000000.bin", framework="pt") as f:
        assert len(f.keys()) == 2


def test_an_upgrade_that_does_not_read_back_is_refused_and_removed(tmp_path, monkeypatch):
    """A written bundle whose tensors differ from the old one's (a writer bug, simulated) raises and is removed."""
    from iobundle.errors import IntegrityError
    from iobundle.observer import _upgrade

    monkeypatch.setattr(_upgrade, "_same", lambda a, b: False)
    with pytest.raises(IntegrityError, match=r"does not read back: tensor 't\d+' differs"):
        upgrade_bundle(GOLDEN / "compact_growing", tmp_path / "new")
    assert not (tmp_path / "new" / "manifest.json").exists() and not list((tmp_path / "new").rglob("*.bin"))
