"""The commands on s3:// bundles, against a real S3 API on localhost (moto's server, see ``tests/conftest.py``).

Each command is run on a bundle uploaded to a bucket and on the same bundle on the disk, and
must say the same thing (but where it says how the bundle is stored); writing commands write
to the bucket. The endpoint comes from the environment (``FSSPEC_S3_ENDPOINT_URL``), as it
would for a user: one test runs the command in a fresh process with nothing else set up.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from iobundle import InputObserver, load_bundle
from iobundle.cli import main

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("onnxruntime")

# one worker starts the server for all of them; the calls in their own files, which the tests name
pytestmark = [pytest.mark.xdist_group("s3"), pytest.mark.usefixtures("own_files")]


@pytest.fixture
def bundles(s3, tmp_path, factories):
    """``(local, url)``: a bundle of ``factories.good()`` (two calls) on the disk and its upload to a new bucket."""
    model, observer = factories.good(), InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    local, url = tmp_path / "run.iobundle", s3.bucket() + "/runs/run.iobundle"
    observer.save(local)
    observer.save(url)
    sys.modules.pop("factories", None)  # the CLI imports it itself (--model factories:good)
    return local, url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def same(text: str, *locations: object) -> str:
    """``text`` with each location replaced by ``B`` and without the ``stored`` line of inspect."""
    for location in locations:
        text = text.replace(str(location), "B")
    return "\n".join(line for line in text.splitlines() if not line.startswith("stored "))


def _key(url: str) -> str:
    return url.removeprefix("s3://")


@pytest.mark.parametrize("command", [["inspect"], ["shapes", "--json"], ["verify"]])
def test_reading_commands_say_the_same_of_s3_and_of_the_disk(bundles, capsys, command):
    local, url = bundles
    code, from_disk, _ = run(capsys, command[0], str(local), *command[1:])
    assert code == 0
    code, from_s3, err = run(capsys, command[0], url, *command[1:])
    assert code == 0, err
    assert same(from_s3, url) == same(from_disk, local)


def stored(out: str) -> str:
    """What inspect's ``stored`` line says."""
    return next(line for line in out.splitlines() if line.startswith("stored ")).split(None, 1)[1]


def test_inspect_says_the_bundle_is_at_a_url(bundles, capsys):
    code, out, _ = run(capsys, "inspect", bundles[1])
    assert code == 0
    assert stored(out) == "a directory, at a URL (fsspec)"


def test_verify_finds_a_damaged_object_as_it_finds_a_damaged_file(bundles, capsys):
    local, url = bundles
    name = "calls/000001.safetensors"
    fs = fsspec.filesystem("s3")
    data = bytearray(fs.cat_file(_key(url) + "/" + name))
    data[-1] ^= 0xFF
    fs.pipe_file(_key(url) + "/" + name, bytes(data))
    (local / name).write_bytes(bytes(data))
    disk_code, disk_out, disk_err = run(capsys, "verify", str(local))
    s3_code, s3_out, s3_err = run(capsys, "verify", url)
    assert disk_code != 0 and s3_code == disk_code
    assert name in s3_out + s3_err
    assert same(s3_out + s3_err, url) == same(disk_out + disk_err, local)


def test_pack_to_s3_then_every_command_reads_it_and_unpack_restores_it(bundles, capsys, tmp_path):
    local, url = bundles
    packed = url.rsplit("/", 1)[0] + "/run.iobundle.tar"
    code, out, err = run(capsys, "pack", str(local), "-o", packed)
    assert code == 0, err
    assert "packed 3 files" in out
    code, _, err = run(capsys, "pack", str(local), "-o", packed)
    assert code != 0 and "overwrite" in err
    assert run(capsys, "pack", str(local), "-o", packed, "--overwrite")[0] == 0
    code, out, _ = run(capsys, "inspect", packed)
    assert code == 0
    assert stored(out) == "packed: one file (iobundle pack), read in place, at a URL (fsspec)"
    assert run(capsys, "verify", packed)[0] == 0
    code, out, err = run(capsys, "unpack", packed, "-o", str(tmp_path / "out"))
    assert code == 0, err
    assert load_bundle(tmp_path / "out").manifest == load_bundle(local).manifest


def test_redact_from_s3_to_s3(bundles, capsys):
    local, url = bundles
    target = url.rsplit("/", 1)[0] + "/bug.iobundle"
    code, out, err = run(capsys, "redact", url, "-o", target, "--seed", "3")
    assert code == 0, err
    assert "redacted 2 calls" in out
    redacted, original = load_bundle(target), load_bundle(local)
    assert redacted.verify() == []
    assert redacted.infer_dynamic_shapes() == original.infer_dynamic_shapes()
    assert [c.outputs for c in redacted.manifest.calls] == [None, None]


def test_convert_an_s3_bundle_to_npz(bundles, capsys, tmp_path):
    local, url = bundles
    assert run(capsys, "convert", str(local), "--to", "npz", str(tmp_path / "disk.npz"))[0] == 0
    code, _, err = run(capsys, "convert", url, "--to", "npz", str(tmp_path / "s3.npz"))
    assert code == 0, err
    with np.load(tmp_path / "disk.npz") as disk, np.load(tmp_path / "s3.npz") as remote:
        assert sorted(disk.files) == sorted(remote.files) and disk.files
        for key in disk.files:
            np.testing.assert_array_equal(disk[key], remote[key])


def test_export_and_validate_an_s3_bundle(bundles, capsys, tmp_path):
    _, url = bundles
    onnx_path = tmp_path / "good.onnx"
    code, out, err = run(capsys, "export", url, "--model", "factories:good", "-o", str(onnx_path))
    assert code == 0, err
    assert "checked on 2 recorded calls" in out and onnx_path.is_file()
    code, out, err = run(capsys, "validate", url, str(onnx_path))
    assert code == 0, err
    assert "PASS: 2/2 calls" in out


def test_a_fresh_process_finds_the_endpoint_in_the_environment(bundles, s3, tmp_path):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))} | s3.env
    proc = subprocess.run(
        [sys.executable, "-m", "iobundle", "verify", bundles[1]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: 2 files") and "hashes match" in proc.stdout
    assert not any(cwd.iterdir()), "an s3:// URL was taken for a local path"
