"""``iobundle pack | unpack | redact | convert``: exit codes, key lines, and every command on a packed bundle."""

from __future__ import annotations

import io
import tarfile
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
    assert "packed 3 files" in capsys.readouterr().out
    assert main(["pack", str(bundle), "-o", str(tmp_path / "b.tar")]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["pack", str(bundle), "-o", str(tmp_path / "b.tar"), "--overwrite"]) == 0


@pytest.mark.parametrize("command", [["inspect"], ["shapes", "--json"], ["verify"]])
def test_commands_read_a_packed_bundle_like_the_directory(bundle, packed, capsys, command):
    assert main([command[0], str(bundle), *command[1:]]) == 0
    from_dir = capsys.readouterr().out
    assert main([command[0], str(packed), *command[1:]]) == 0
    from_file = capsys.readouterr().out
    assert from_file.replace(str(packed), "B") == from_dir.replace(str(bundle), "B")


def test_unpack_round_trips(packed, bundle, tmp_path, capsys):
    assert main(["unpack", str(packed), "-o", str(tmp_path / "out")]) == 0
    assert "sizes and sha256 checked" in capsys.readouterr().out
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
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'calls/000000.safetensors' is a symbolic link" in err
    assert "Traceback" not in err
    assert main(["unpack", str(path), "-o", str(tmp_path / "out")]) == 2
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
