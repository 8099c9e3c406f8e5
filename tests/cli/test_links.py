"""Links are refused on every component, by every command that reads or overwrites a bundle.

A symlinked ``calls/`` folder, a symlinked tensor file, a symlinked manifest, a program index
entry that is a link or lies in a symlinked folder, an overwrite target whose ``calls/`` is a link:
each is an error naming the link, and the files the link points to keep their bytes and times.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main

FILE0 = "calls/segment-000000.bin"  # the calls' tensors (a segment: every call here is small)


class Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, observer = Twice(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(4, 3))
    path = tmp_path_factory.mktemp("links") / "clean.iobundle"
    observer.save(path)
    return path


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (links not followed): its bytes and modification time."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(folder))] = (path.read_bytes(), path.stat().st_mtime_ns)
    return found


def plant(bundle: Path, outside: Path, how: str) -> str:
    """Make ``bundle`` reach ``outside`` (a copy of what it replaces) through a link; return the link's name."""
    outside.mkdir()
    if how == "calls folder":
        shutil.copytree(bundle / "calls", outside / "calls")
        shutil.rmtree(bundle / "calls")
        (bundle / "calls").symlink_to(outside / "calls")
        return "calls"
    if how == "tensor file":
        shutil.copy(bundle / FILE0, outside / "stolen.safetensors")  # same bytes: size and hash would pass
        (bundle / FILE0).unlink()
        (bundle / FILE0).symlink_to(outside / "stolen.safetensors")
        return FILE0
    assert how == "manifest"
    shutil.copy(bundle / "manifest.json", outside / "manifest.json")
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").symlink_to(outside / "manifest.json")
    return "manifest.json"


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


READERS = {
    "inspect": lambda b, c, out: ["inspect", b],
    "verify": lambda b, c, out: ["verify", b],
    "shapes": lambda b, c, out: ["shapes", b],
    "diff": lambda b, c, out: ["diff", c, b],
    "convert": lambda b, c, out: ["convert", b, "--to", "npz", out],
    "redact": lambda b, c, out: ["redact", b, "-o", out],
    "pack": lambda b, c, out: ["pack", b, "-o", out.with_suffix(".tar")],
}


@pytest.mark.parametrize("how", ["calls folder", "tensor file", "manifest"])
@pytest.mark.parametrize("command", sorted(READERS))
def test_a_command_refuses_a_bundle_reaching_outside_through_a_link(clean, tmp_path, capsys, command, how):
    bundle = Path(shutil.copytree(clean, tmp_path / "run.iobundle"))
    outside = tmp_path / "outside"
    link = plant(bundle, outside, how)
    before = snapshot(outside)
    code, err = run(capsys, *READERS[command](bundle, clean, tmp_path / "out"))
    assert code == 5, err  # an unsafe bundle
    assert f"{bundle / link}' is a symbolic link" in err.splitlines()[0]
    assert "Traceback" not in err
    assert snapshot(outside) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tar").exists()


@pytest.mark.parametrize("how", ["calls folder", "tensor file"])
def test_a_link_inside_the_bundle_is_refused_too(clean, tmp_path, capsys, how):
    """Wherever it points: a bundle holds only its own files."""
    bundle = Path(shutil.copytree(clean, tmp_path / "run.iobundle"))
    if how == "calls folder":
        (bundle / "calls").rename(bundle / "real-calls")
        (bundle / "calls").symlink_to("real-calls")
    else:
        (bundle / FILE0).rename(bundle / "calls" / "real.safetensors")
        (bundle / FILE0).symlink_to("real.safetensors")
    code, err = run(capsys, "verify", bundle)
    assert code == 5 and "is a symbolic link" in err


# --------------------------------------------------------------------------- overwriting


def old_bundle_reaching_outside(clean: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A bundle directory whose ``calls/`` is a link to a folder of the user's (holding files of the same names)."""
    target = Path(shutil.copytree(clean, tmp_path / "target.iobundle"))
    outside = tmp_path / "users-data"
    shutil.copytree(target / "calls", outside)
    (outside / "notes.txt").write_text("mine")
    shutil.rmtree(target / "calls")
    (target / "calls").symlink_to(outside)
    return target, outside


def test_unpack_overwrite_never_removes_through_a_linked_calls_folder(clean, tmp_path, capsys):
    assert main(["pack", str(clean), "-o", str(tmp_path / "b.tar")]) == 0
    target, outside = old_bundle_reaching_outside(clean, tmp_path)
    before = snapshot(outside)
    code, err = run(capsys, "unpack", tmp_path / "b.tar", "-o", target, "--overwrite")
    assert code == 2, err
    assert f"{target / 'calls'}' is a symbolic link" in err
    assert snapshot(outside) == before
    assert (target / "manifest.json").is_file()  # refused before anything was removed


def test_redact_overwrite_never_removes_through_a_linked_calls_folder(clean, tmp_path, capsys):
    target, outside = old_bundle_reaching_outside(clean, tmp_path)
    before = snapshot(outside)
    code, err = run(capsys, "redact", clean, "-o", target, "--overwrite")
    assert code == 2, err
    assert f"{target / 'calls'}' is a symbolic link" in err
    assert snapshot(outside) == before
    assert (target / "manifest.json").is_file()


def test_a_listed_file_that_is_a_link_stops_the_overwrite_before_anything_is_removed(clean, tmp_path, capsys):
    target = Path(shutil.copytree(clean, tmp_path / "target.iobundle"))
    outside = tmp_path / "users-data"
    outside.mkdir()
    (outside / "precious.safetensors").write_bytes(b"mine")
    (target / FILE0).unlink()
    (target / FILE0).symlink_to(outside / "precious.safetensors")
    before = snapshot(outside)
    code, err = run(capsys, "redact", clean, "-o", target, "--overwrite")
    assert code == 2 and f"{target / FILE0}' is a symbolic link" in err
    assert snapshot(outside) == before
    assert (target / "manifest.json").is_file() and (target / FILE0).is_symlink()  # nothing removed


def test_saving_into_a_folder_whose_calls_is_a_link_is_refused(clean, tmp_path):
    from iobundle.errors import BundleExistsError

    target, outside = old_bundle_reaching_outside(clean, tmp_path)
    before = snapshot(outside)
    model, observer = Twice(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
    with pytest.raises(BundleExistsError, match="calls' is a symbolic link"):
        observer.save(target, overwrite=True)
    assert snapshot(outside) == before


@pytest.mark.parametrize("left", ["a bundle", "a killed stream"])
def test_streaming_into_a_folder_whose_calls_is_a_link_is_refused(clean, tmp_path, left):
    from iobundle.errors import BundleExistsError

    target, outside = old_bundle_reaching_outside(clean, tmp_path)
    if left == "a killed stream":  # its journal, no manifest: the writer would empty calls/
        (target / "manifest.json").rename(target / "journal.jsonl")
    before = snapshot(outside)
    model, observer = Twice(), InputObserver()
    with (
        pytest.raises(BundleExistsError, match="calls' is a symbolic link"),
        observer(model, stream_to=target, overwrite=True),
    ):
        model(torch.randn(2, 3))
    assert snapshot(outside) == before


def test_convert_overwrite_never_writes_through_a_linked_npz_file(clean, tmp_path, capsys):
    outside = tmp_path / "users.npz"
    outside.write_bytes(b"mine")
    (tmp_path / "arrays.npz").symlink_to(outside)
    before = outside.read_bytes(), outside.stat().st_mtime_ns
    code, err = run(capsys, "convert", clean, "--to", "npz", tmp_path / "arrays.npz", "--overwrite")
    assert code == 2 and "is a symbolic link" in err
    assert (outside.read_bytes(), outside.stat().st_mtime_ns) == before


# --------------------------------------------------------------------------- program indexes and export

FACTORIES = textwrap.dedent(
    """
    import torch

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    def twice():
        return Twice()
    """
)


@pytest.fixture(scope="module")
def exported(clean: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``good.onnx``, exported from the bundle, and the factories that made it."""
    pytest.importorskip("onnxruntime")
    folder = tmp_path_factory.mktemp("onnx")
    (folder / "link_factories.py").write_text(FACTORIES)
    sys.path.insert(0, str(folder))
    try:
        assert main(["export", str(clean), "--model", "link_factories:twice", "-o", str(folder / "good.onnx")]) == 0
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("link_factories", None)
    return folder


def write_index(path: Path, file: str) -> Path:
    index = {
        "format": "iobundle.programs",
        "programs": [{"name": "p0", "file": file, "calls": [0, 1], "traced_call": 0, "inputs": {"x": "present"}}],
    }
    path.write_text(json.dumps(index))
    return path


def test_validate_runs_an_index_of_plain_files(clean, exported, tmp_path, capsys):
    shutil.copy(exported / "good.onnx", tmp_path / "m.p0.onnx")
    index = write_index(tmp_path / "m.programs.json", "m.p0.onnx")
    code, err = run(capsys, "validate", clean, index)
    assert code == 0, err


@pytest.mark.parametrize("how", ["file", "folder"])
def test_validate_refuses_an_index_entry_reached_through_a_link(clean, exported, tmp_path, capsys, how):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(exported / "good.onnx", outside / "m.p0.onnx")  # a model that would PASS
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    if how == "file":
        (index_dir / "m.p0.onnx").symlink_to(outside / "m.p0.onnx")
        name, link = "m.p0.onnx", index_dir / "m.p0.onnx"
    else:
        (index_dir / "sub").symlink_to(outside)
        name, link = "sub/m.p0.onnx", index_dir / "sub"
    index = write_index(index_dir / "m.programs.json", name)
    before = snapshot(outside)
    code = main(["validate", str(clean), str(index)])
    out, err = capsys.readouterr()
    assert code == 2, err  # a bad index, as for every rule of the index
    assert "programs[0].file" in err and f"{link}' is a symbolic link" in err
    assert "PASS" not in out
    assert snapshot(outside) == before


def test_save_onnx_never_writes_through_a_linked_external_data_file(clean, exported, tmp_path):
    from iobundle import load_bundle
    from iobundle.errors import BundleExistsError

    outside = tmp_path / "users.bin"
    outside.write_bytes(b"mine")
    (tmp_path / "model.onnx.data").symlink_to(outside)
    with pytest.raises(BundleExistsError, match=r"model\.onnx\.data' is a symbolic link"):
        load_bundle(clean).to_onnx(Twice(), tmp_path / "model.onnx")
    assert outside.read_bytes() == b"mine" and not (tmp_path / "model.onnx").exists()


def test_export_overwrite_never_writes_through_a_linked_output(clean, exported, tmp_path, capsys, monkeypatch):
    outside = tmp_path / "users.onnx"
    shutil.copy(exported / "good.onnx", outside)
    (tmp_path / "model.onnx").symlink_to(outside)
    before = snapshot(tmp_path)
    monkeypatch.syspath_prepend(str(exported))
    code, err = run(
        capsys, "export", clean, "--model", "link_factories:twice", "-o", tmp_path / "model.onnx", "--overwrite"
    )
    sys.modules.pop("link_factories", None)
    assert code == 2 and "a symbolic link is there" in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("link", ["model", "model/weights.safetensors", "model/config.json"])
def test_export_from_bundle_refuses_a_stored_model_reached_through_a_link(model_bundle, tmp_path, capsys, link):
    bundle = Path(shutil.copytree(model_bundle, tmp_path / "neox.iobundle"))
    outside = tmp_path / "elsewhere"
    source = bundle / link
    if source.is_dir():
        shutil.copytree(source, outside)
        shutil.rmtree(source)
    else:
        outside.mkdir()
        outside = outside / source.name
        shutil.copy(source, outside)
        source.unlink()
    source.symlink_to(outside)
    before = snapshot(tmp_path / "elsewhere")
    code, err = run(capsys, "export", bundle, "--from-bundle", "-o", tmp_path / "model.onnx")
    assert code == 5, err
    assert f"{bundle / link}' is a symbolic link" in err
    assert not (tmp_path / "model.onnx").exists()
    assert snapshot(tmp_path / "elsewhere") == before


def test_the_archive_the_user_names_may_be_a_link(clean, tmp_path, capsys):
    """Links the user chose (the path given on the command line) are followed; only what a bundle holds is checked."""
    assert main(["pack", str(clean), "-o", str(tmp_path / "b.tar")]) == 0
    (tmp_path / "alias.tar").symlink_to(tmp_path / "b.tar")
    (tmp_path / "alias.iobundle").symlink_to(clean)
    assert main(["verify", str(tmp_path / "alias.tar")]) == 0
    assert main(["verify", str(tmp_path / "alias.iobundle")]) == 0
    assert main(["unpack", str(tmp_path / "alias.tar"), "-o", str(tmp_path / "out")]) == 0
