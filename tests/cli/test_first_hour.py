"""What a newcomer meets in the first hour: no user file replaced unasked, each hint written for its condition."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(3, 3))
    path = tmp_path / "run.iobundle"
    observer.save(path)
    return path


def _error(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """The error line and the hint line a failed command printed."""
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and err[1].startswith("hint: "), err
    return err[0], err[1]


# --------------------------------------------------------------------------- an output over its input


@pytest.mark.parametrize("where", ["itself", "inside", "holding"])
@pytest.mark.parametrize("command", ["redact", "pack", "unpack", "convert"])
def test_every_writing_command_refuses_an_output_over_its_input(bundle, tmp_path, capsys, command, where):
    source = bundle
    if command == "unpack":
        source = tmp_path / "run.iobundle.tar"
        assert main(["pack", str(bundle), "-o", str(source)]) == 0
        capsys.readouterr()
    output = {"itself": source, "inside": source / "out", "holding": tmp_path}[where]
    argv = {
        "redact": ["redact", str(source), "-o", str(output)],
        "pack": ["pack", str(source), "-o", str(output)],
        "unpack": ["unpack", str(source), "-o", str(output)],
        "convert": ["convert", str(source), "--to", "npz", str(output)],
    }[command]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main([*argv, "--overwrite"]) == 2
    error, hint = _error(capsys)
    assert "would destroy what is read" in error
    assert "choose an output outside the input" in hint and "--overwrite" not in hint
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_redact_onto_its_input_keeps_the_real_bundle(bundle, capsys):
    assert main(["redact", str(bundle), "-o", str(bundle), "--overwrite"]) == 2
    assert main(["inspect", str(bundle)]) == 0
    assert "redacted   no" in capsys.readouterr().out


# --------------------------------------------------------------------------- one hint per condition


def test_validate_of_a_missing_onnx_file_says_to_check_its_path(bundle, tmp_path, capsys):
    assert main(["validate", str(bundle), str(tmp_path / "missing.onnx")]) == 2
    error, hint = _error(capsys)
    assert "missing.onnx' does not exist" in error
    assert "path of the ONNX model" in hint and "MODULE:FACTORY" not in hint


def test_overwrite_of_a_folder_iobundle_never_replaces_does_not_hint_overwrite(bundle, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["redact", str(bundle), "-o", str(mine), "--overwrite"]) == 2
    error, hint = _error(capsys)
    assert "is not a bundle" in error
    assert "pass --overwrite" not in hint and "remove it yourself" in hint
    assert (mine / "notes.txt").read_text() == "mine"
    assert main(["redact", str(bundle), "-o", str(tmp_path / "red.iobundle")]) == 0  # without it: the usual hint
    assert main(["redact", str(bundle), "-o", str(tmp_path / "red.iobundle")]) == 2
    assert "pass --overwrite" in _error(capsys)[1]


def test_export_into_a_directory_hints_a_file_name(bundle, tmp_path, capsys):
    assert main(["export", str(bundle), "--model", "tests:nothing", "-o", str(tmp_path)]) == 2
    error, hint = _error(capsys)
    assert "a directory is there" in error
    assert f"e.g. {tmp_path / 'model.onnx'}" in hint and "--overwrite" not in hint


def test_convert_onto_an_existing_file_says_so_once(bundle, tmp_path, capsys):
    (tmp_path / "all.npz").write_bytes(b"mine")
    assert main(["convert", str(bundle), "--to", "npz", str(tmp_path / "all.npz")]) == 2
    error, hint = _error(capsys)
    assert error.endswith("choose another path.") and "Cannot write" not in error
    assert "disk" not in hint
    assert (tmp_path / "all.npz").read_bytes() == b"mine"


def test_export_from_a_redacted_bundle_names_keep_model(bundle, tmp_path, capsys):
    assert main(["redact", str(bundle), "-o", str(tmp_path / "red.iobundle")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "red.iobundle"), "--from-bundle", "-o", str(tmp_path / "m.onnx")]) == 2
    error, hint = _error(capsys)
    assert "stores no model: `iobundle redact` dropped it" in error
    assert "--keep-model" in hint and "MODULE:FACTORY" in hint
    assert main(["export", str(bundle), "--from-bundle", "-o", str(tmp_path / "m.onnx")]) == 2
    error, hint = _error(capsys)
    assert "`iobundle redact`" not in error and "--keep-model" not in hint and "include_model=True" in hint


def test_llama_demo_without_transformers_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what Python does when it is not installed
    assert main(["demo", "--llama", str(tmp_path / "demo")]) == 2
    error, hint = _error(capsys)
    assert "pip install 'iobundle[transformers]'" in error
    assert hint.startswith("hint: install what the message names")
    assert not (tmp_path / "demo").exists()


# --------------------------------------------------------------------------- export -o, checked before tracing


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("/proc/nowhere/m.onnx", "the folder /proc/nowhere does not exist"),
        ("{tmp}/no-such-folder/m.onnx", "no-such-folder does not exist (iobundle does not create it)"),
        ("/proc/m.onnx", "cannot write into /proc"),
    ],
)
def test_export_refuses_an_output_folder_it_cannot_write_before_tracing(bundle, tmp_path, capsys, output, message):
    output = output.format(tmp=tmp_path)
    # the factory does not exist: reaching it would fail with another message, after the check
    assert main(["export", str(bundle), "--model", "no_such_module:build", "-o", output]) == 2
    error, hint = _error(capsys)
    assert message in error, error
    assert "folder" in hint and "--overwrite" not in hint
    assert not (tmp_path / "no-such-folder").exists()


# --------------------------------------------------------------------------- the demo's own outputs


def test_demo_never_replaces_a_bundle_it_did_not_write(bundle, tmp_path, capsys):
    directory = tmp_path / "demo"
    directory.mkdir()
    shutil.copytree(bundle, directory / "demo.iobundle")
    before = sorted(p.name for p in (directory / "demo.iobundle").rglob("*"))
    assert main(["demo", str(directory)]) == 2
    error, hint = _error(capsys)
    assert "demo.iobundle' is there and an earlier `iobundle demo` did not write it" in error
    assert "pass --overwrite" in hint
    assert sorted(p.name for p in (directory / "demo.iobundle").rglob("*")) == before
    assert main(["inspect", str(directory / "demo.iobundle")]) == 0
    assert "Model.forward(x)" in capsys.readouterr().out


def test_tolerance_help_gives_the_defaults_by_dtype_instead_of_a_docs_page():
    from iobundle.cli._checks import tolerance_help
    from iobundle.replay.check import DTYPE_TOLERANCES

    for i, what in enumerate(("absolute", "relative")):
        text = tolerance_help(what)
        half, bfloat = DTYPE_TOLERANCES["float16"][i], DTYPE_TOLERANCES["bfloat16"][i]
        assert f"float16 outputs get {half:g}, bfloat16 outputs {bfloat:g}" in text and "docs" not in text


# --------------------------------------------------------------------------- numbers that do not confuse


class Scaled(torch.nn.Module):
    def __init__(self, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.scale, self.dtype = scale, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).to(self.dtype)


def _record(path: Path, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> Path:
    observer = InputObserver()
    with observer(model):
        for n in (2, 3):
            model(torch.ones(n, 3, dtype=dtype))
    observer.save(path)
    return path


def test_diff_of_a_bf16_copy_names_the_dtype_and_keeps_the_table_narrow(tmp_path, capsys):
    a = _record(tmp_path / "a.iobundle", Scaled())
    b = _record(tmp_path / "b.iobundle", Scaled(dtype=torch.bfloat16), torch.bfloat16)
    assert main(["diff", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "FAIL: dtype float32 in A, bfloat16 in B" in lines[2]
    assert len(lines[1]) < 100 and set(lines[1]) == {"─"}  # the rule under the header
    assert "call 0: x: dtype float32 in A, bfloat16 in B; output: dtype float32 in A, bfloat16 in B" in lines


def test_a_passing_row_with_a_huge_relative_error_says_how_it_is_computed(tmp_path, capsys):
    a = _record(tmp_path / "a.iobundle", Scaled(1e-12))  # expected values near 0
    b = _record(tmp_path / "b.iobundle", Scaled(3e-12))
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "2.00e+00" in out and "max rel is |actual - expected| / |expected|" in out
    assert main(["diff", str(a), str(a)]) == 0
    assert "max rel is" not in capsys.readouterr().out


def test_one_file_is_one_file_and_inspect_q_is_quieter(bundle, capsys):
    assert main(["verify", str(bundle)]) == 0
    assert capsys.readouterr().out.startswith("OK: 1 file, ")
    assert main(["inspect", str(bundle)]) == 0
    full = capsys.readouterr().out
    assert main(["inspect", "-q", str(bundle)]) == 0
    quiet = capsys.readouterr().out
    assert "in 1 file," in quiet and "latency" in full and "latency" not in quiet
    assert len(quiet.splitlines()) < len(full.splitlines())


@pytest.mark.parametrize(("command", "stale"), [("unpack", "sha256"), ("run", "the bundle directory")])
def test_help_says_what_the_command_does_today(capsys, command, stale):
    assert main([command, "--help"]) == 0
    assert stale not in " ".join(capsys.readouterr().out.split())
