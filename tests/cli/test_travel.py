"""``iobundle pack | unpack | redact | convert``: exit codes, key lines, and every command on a packed bundle."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.cli import main


class Model(torch.nn.Module):
    def forward(self, x, cache=None):
        return x * 2


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3), cache=[torch.ones(2, 4)])
        model(torch.randn(2, 5), cache=[torch.ones(2, 4)])
    path = tmp_path_factory.mktemp("travel") / "run.iobundle"
    observer.save(path)
    return path


@pytest.fixture(scope="module")
def packed(bundle: Path) -> Path:
    path = bundle.parent / "run.iobundle.tar"
    assert main(["pack", str(bundle), "-o", str(path)]) == 0
    return path


def test_pack_prints_what_it_wrote(bundle, tmp_path, capsys):
    assert main(["pack", str(bundle), "-o", str(tmp_path / "b.tar")]) == 0
    assert "packed 2 files" in capsys.readouterr().out  # the manifest and the calls' segment
    assert main(["pack", str(bundle), "-o", str(tmp_path / "b.tar")]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["pack", str(bundle), "-o", str(tmp_path / "b.tar"), "--overwrite"]) == 0


@pytest.mark.parametrize("command", [["inspect"], ["shapes", "--json"], ["verify"]])
def test_commands_read_a_packed_bundle_like_the_directory(bundle, packed, capsys, command):
    assert main([command[0], str(bundle), *command[1:]]) == 0
    from_dir = capsys.readouterr().out
    assert main([command[0], str(packed), *command[1:]]) == 0
    from_file = capsys.readouterr().out

    def same(text: str) -> str:  # inspect says how each is stored: the one line that differs
        return "\n".join(line for line in text.splitlines() if not line.startswith("stored "))

    assert same(from_file.replace(str(packed), "B")) == same(from_dir.replace(str(bundle), "B"))


def _line(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label + " "))[len(label) :].strip()


def test_inspect_says_a_directory_or_a_packed_file_and_the_format_version(bundle, packed, capsys):
    version = load_bundle(bundle).manifest.format_version
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert _line(out, "stored") == "a directory"
    assert _line(out, "format") == f"iobundle, format_version {version}"
    assert main(["inspect", str(packed)]) == 0
    out = capsys.readouterr().out
    assert _line(out, "stored") == "packed: one file (iobundle pack), read in place"


@pytest.mark.parametrize("packed_at_url", [False, True])
def test_inspect_says_a_bundle_came_from_a_url(bundle, capsys, packed_at_url):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://inspect-{uuid.uuid4().hex}"
    try:
        if packed_at_url:
            assert main(["pack", str(bundle), "-o", url + "/run.iobundle.tar"]) == 0
            target, kind = url + "/run.iobundle.tar", "packed: one file (iobundle pack), read in place"
        else:
            fs = fsspec.filesystem("memory")
            fs.put(str(bundle), url.removeprefix("memory://") + "/run.iobundle", recursive=True)
            target, kind = url + "/run.iobundle", "a directory"
        capsys.readouterr()
        assert main(["inspect", target]) == 0
        assert _line(capsys.readouterr().out, "stored") == f"{kind}, at a URL (fsspec)"
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_inspect_says_whether_a_bundle_is_redacted_and_what_it_kept(bundle, tmp_path, capsys):
    assert main(["inspect", str(bundle)]) == 0
    assert _line(capsys.readouterr().out, "redacted") == "no (the recorded inputs are the real ones)"
    assert main(["redact", str(bundle), "-o", str(tmp_path / "bug"), "--seed", "7"]) == 0
    assert main(["redact", str(bundle), "-o", str(tmp_path / "kept"), "--keep-outputs"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "bug")]) == 0
    assert _line(capsys.readouterr().out, "redacted") == (
        "yes: inputs synthetic (seed 7), outputs dropped, model not kept"
    )
    assert main(["inspect", str(tmp_path / "kept")]) == 0
    assert "outputs kept (computed on the real inputs)" in _line(capsys.readouterr().out, "redacted")


def test_unpack_round_trips(packed, bundle, tmp_path, capsys):
    assert main(["unpack", str(packed), "-o", str(tmp_path / "out")]) == 0
    assert "sizes and hashes checked" in capsys.readouterr().out
    assert load_bundle(tmp_path / "out").manifest == load_bundle(bundle).manifest


def test_hostile_archive_is_one_error_line(bundle, tmp_path, capsys):
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        data = (bundle / "manifest.json").read_bytes()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("calls/000000.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert main(["inspect", str(path)]) == 5  # a damaged (hostile) archive
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'calls/000000.safetensors' is a symbolic link" in err
    assert "Traceback" not in err
    assert main(["unpack", str(path), "-o", str(tmp_path / "out")]) == 5
    assert not (tmp_path / "out").exists()


def test_redact_then_pack_makes_a_bug_report(packed, tmp_path, capsys):
    assert main(["redact", str(packed), "-o", str(tmp_path / "bug")]) == 0
    out = capsys.readouterr().out
    assert "redacted 2 calls" in out and "outputs dropped" in out
    assert load_bundle(tmp_path / "bug").manifest.redacted is not None
    assert main(["pack", str(tmp_path / "bug"), "-o", str(tmp_path / "bug.tar")]) == 0


def test_convert_npz(bundle, tmp_path, capsys):
    assert main(["convert", str(bundle), "--to", "npz", str(tmp_path / "arrays")]) == 0
    with np.load(tmp_path / "arrays" / "call_000001.npz") as data:
        assert sorted(data) == ["args.0", "kwargs.cache.0", "outputs"]


def test_convert_onnx_testdata_needs_a_model(bundle, tmp_path, capsys):
    assert main(["convert", str(bundle), "--to", "onnx-testdata", str(tmp_path / "td")]) == 2
    assert "needs --model MODEL.onnx" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pack", "unpack", "redact", "convert"])
def test_help_has_examples(command, capsys):
    assert main([command, "--help"]) == 0
    assert f"examples:\n  iobundle {command} " in capsys.readouterr().out


# --------------------------------------------------------------------------- progress bars

BAR = "━"  # rich's bar, drawn on stderr


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update(TERM="xterm-256color", COLUMNS="120", PYTHONPATH=os.pathsep.join(sys.path))
    return env


def _travel_commands(bundle: Path, packed: Path, out: Path) -> dict[str, list[str]]:
    return {
        "pack": ["pack", str(bundle), "-o", str(out / "b.tar")],
        "unpack": ["unpack", str(packed), "-o", str(out / "b")],
        "redact": ["redact", str(bundle), "-o", str(out / "r")],
        "convert": ["convert", str(bundle), "--to", "npz", str(out / "arrays")],
    }


@pytest.mark.parametrize("command", ["pack", "unpack", "redact", "convert"])
def test_a_terminal_shows_a_progress_bar(bundle, packed, tmp_path, terminal, command):
    argv = _travel_commands(bundle, packed, tmp_path)[command]
    text = terminal(argv, tmp_path, _env())
    assert BAR in text and command in text  # the bar and its task
    if command in ("pack", "unpack"):
        assert re.search(r"\d+(\.\d+)?/\d+(\.\d+)? (?:[kMG]?B\b|bytes)", text)  # counted in bytes, not in members
    assert "Traceback" not in text


def test_quiet_on_a_terminal_shows_no_bar(bundle, packed, tmp_path, terminal):
    text = terminal(["pack", "-q", str(bundle), "-o", str(tmp_path / "b.tar")], tmp_path, _env())
    assert BAR not in text and "\x1b[" not in text


@pytest.mark.parametrize("command", ["pack", "unpack", "redact", "convert"])
def test_a_pipe_shows_no_progress_bar(bundle, packed, tmp_path, command):
    argv = _travel_commands(bundle, packed, tmp_path)[command]
    done = subprocess.run(
        [sys.executable, "-m", "iobundle", *argv], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and BAR not in done.stdout and "\x1b[" not in done.stdout


def test_the_cli_reads_recorded_calls_through_public_api_only():
    import iobundle.cli

    sources = Path(iobundle.cli.__file__).parent.glob("*.py")
    assert [p.name for p in sources if "._recorded(" in p.read_text("utf-8")] == []
