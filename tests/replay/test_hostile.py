"""Hostile bundles: every one must fail with a specific IobundleError that names the file or field.

Bundles are attached to bug reports, so loading a stranger's bundle must never crash the
process, import or call code it names, or read outside its directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import iobundle.calls._tensorfile_read as replay_tensorfile
import iobundle.calls._tensorfile_write as capture_tensorfile
import iobundle.schema._io as schema_io
from iobundle import InputObserver, load_bundle
from iobundle.errors import (
    AlignmentError,
    BundleNotFoundError,
    IntegrityError,
    IobundleError,
    ManifestError,
    TensorFileError,
    UnsafeBundleError,
    UnsupportedFormatVersionError,
)
from iobundle.schema import load_manifest

# every test runs through both ways of opening a tensor file (small files read whole, large ones mapped)
pytestmark = pytest.mark.usefixtures("tensor_file_paths", "own_files")  # own files: the tests edit them

FILE0 = "calls/000000.safetensors"
FILE1 = "calls/000001.safetensors"


class Model(torch.nn.Module):
    def forward(self, x, d=None):
        return x * 2


def make_bundle(path: Path) -> Path:
    model, observer = Model(), InputObserver()
    with observer(model):
        model(torch.randn(2, 3))
        model(torch.randn(4, 3), d={"w": torch.ones(2)})
    observer.save(path)
    return path


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return make_bundle(tmp_path / "bundle")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest as format-version-2 JSON, the layout these edits address (one entry per tensor, whole trees).

    The writer writes version 6 (tested in tests/schema/test_compact.py); a reader reads every version.
    """
    manifest = json.loads((path / "manifest.json").read_text("utf-8"))
    if manifest.get("format_version") in (3, 4, 5, 6):
        parsed = load_manifest(path).model_copy(update={"format_version": 2})
        manifest = json.loads(parsed.model_dump_json())
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest), "utf-8")


def edit_manifest(path: Path, edit) -> None:
    manifest = read_manifest(path)
    edit(manifest)
    write_manifest(path, manifest)


def replace_tensor_file(path: Path, name: str, data: bytes, *, resync: bool = True) -> None:
    """Overwrite a tensor file; with ``resync`` the manifest records its new size and hash."""
    (path / name).write_bytes(data)
    if resync:

        def edit(m: dict[str, Any]) -> None:
            m["files"][name] = {"size": len(data), "hash": "xxh3-128", "digest": xxhash.xxh3_128_hexdigest(data)}

        edit_manifest(path, edit)


def split_tensor_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_tensor_file(header: dict[str, Any], body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def edit_tensor_header(path: Path, name: str, edit) -> None:
    header, body = split_tensor_file((path / name).read_bytes())
    edit(header)
    replace_tensor_file(path, name, join_tensor_file(header, body))


def exercise(path: Path, *, verify: bool = True) -> None:
    """Load, infer and read everything; the way a user touches a bundle."""
    b = load_bundle(path, verify=verify)
    b.infer_dynamic_shapes()
    for i in range(b.num_obs()):
        b.infer_arguments(i)
    for key in b.manifest.tensors:
        b.tensor(key)


def run_isolated(cases: list[tuple[Path, bool]], *, timeout: float = 120) -> list[str]:
    """Load, infer and read each ``(bundle, verify)`` in one fresh process; return one outcome per case.

    An outcome is ``"ok"`` or ``"<ErrorClass>: <message>"``. A crash of the reader (SIGBUS,
    SIGSEGV) or a hang fails the test instead of killing pytest.
    """
    code = textwrap.dedent(
        """
        import json, sys
        from iobundle import IobundleError, load_bundle
        for path, verify in json.loads(sys.argv[1]):
            try:
                b = load_bundle(path, verify=verify)
                b.infer_dynamic_shapes()
                for i in range(b.num_obs()):
                    b.infer_arguments(i)
                for key in b.manifest.tensors:
                    b.tensor(key)
            except IobundleError as exc:
                print(json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
            else:
                print(json.dumps("ok"), flush=True)
        """
    )
    arg = json.dumps([[str(path), verify] for path, verify in cases])
    proc = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"the reader died (return code {proc.returncode}): {proc.stderr[-2000:]}"
    outcomes = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(outcomes) == len(cases), proc.stdout
    return outcomes


# --------------------------------------------------------------------------- manifest.json


class TestManifestText:
    def test_garbage(self, bundle):
        (bundle / "manifest.json").write_bytes(b"\x00\xff\xfegarbage{[")
        with pytest.raises(ManifestError, match=r"manifest\.json: not valid JSON"):
            load_bundle(bundle)

    def test_truncated(self, bundle):
        text = (bundle / "manifest.json").read_bytes()
        (bundle / "manifest.json").write_bytes(text[: len(text) // 2])
        with pytest.raises(ManifestError, match=r"manifest\.json: not valid JSON"):
            load_bundle(bundle)

    def test_empty(self, bundle):
        (bundle / "manifest.json").write_bytes(b"")
        with pytest.raises(ManifestError, match=r"manifest\.json"):
            load_bundle(bundle)

    @pytest.mark.parametrize("text", ["[]", "null", "3", '"iobundle"'])
    def test_not_an_object(self, bundle, text):
        (bundle / "manifest.json").write_text(text)
        with pytest.raises(ManifestError, match=r"manifest\.json: expected a JSON object"):
            load_bundle(bundle)

    def test_unknown_field(self, bundle):
        edit_manifest(bundle, lambda m: m["calls"][0].update(evil=1))
        with pytest.raises(ManifestError, match=r"calls\[0\]\.evil: Extra inputs are not permitted"):
            load_bundle(bundle)

    def test_wrong_type_names_the_field(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(dtype="F33"))
        with pytest.raises(ManifestError, match=r"tensors\.t0\.dtype"):
            load_bundle(bundle)

    def test_no_manifest(self, bundle):
        (bundle / "manifest.json").unlink()
        with pytest.raises(BundleNotFoundError, match=r"No manifest\.json"):
            load_bundle(bundle)

    def test_a_path_that_does_not_exist(self, tmp_path):
        with pytest.raises(BundleNotFoundError, match="nope' does not exist"):
            load_bundle(tmp_path / "nope")

    def test_manifest_is_a_directory(self, bundle):
        (bundle / "manifest.json").unlink()
        (bundle / "manifest.json").mkdir()
        with pytest.raises(ManifestError, match=r"manifest\.json"):
            load_bundle(bundle)

    @pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
    def test_manifest_is_a_fifo(self, bundle):
        (bundle / "manifest.json").unlink()
        os.mkfifo(bundle / "manifest.json")
        (out,) = run_isolated([(bundle, True)], timeout=60)  # a blocking read would time out
        assert out.startswith("ManifestError: ") and "manifest.json: not a regular file" in out

    def test_manifest_symlink_outside(self, bundle, tmp_path):
        outside = tmp_path / "outside.json"
        shutil.copy(bundle / "manifest.json", outside)
        (bundle / "manifest.json").unlink()
        (bundle / "manifest.json").symlink_to(outside)
        with pytest.raises(UnsafeBundleError, match=r"manifest\.json' is a symbolic link"):
            load_bundle(bundle)


class TestFormatMarker:
    @pytest.mark.parametrize("value", ["onnx", "", None, 1, ["iobundle"]])
    def test_unknown_format(self, bundle, value):
        edit_manifest(bundle, lambda m: m.update(format=value))
        with pytest.raises(
            UnsupportedFormatVersionError, match=r"manifest\.json: format is .*expected 'iobundle'"
        ) as info:
            load_bundle(bundle)
        assert info.value.found == value
        assert info.value.supported == "iobundle"

    def test_missing_format(self, bundle):
        edit_manifest(bundle, lambda m: m.pop("format"))
        with pytest.raises(UnsupportedFormatVersionError, match="format is None"):
            load_bundle(bundle)

    def test_newer_version(self, bundle):
        edit_manifest(bundle, lambda m: m.update(format_version=7))
        with pytest.raises(UnsupportedFormatVersionError) as info:
            load_bundle(bundle)
        message = str(info.value)
        assert "manifest.json" in message
        assert "format_version 7 is not supported" in message
        assert "reads format_version 1, 2, 3, 4, 5, 6" in message
        assert "Upgrade iobundle" in message
        assert info.value.found == 7
        assert info.value.supported == (1, 2, 3, 4, 5, 6)

    @pytest.mark.parametrize("value", [0, -1, "1", 1.5, True, None, [1], 10**100])
    def test_bad_version(self, bundle, value):
        edit_manifest(bundle, lambda m: m.update(format_version=value))
        with pytest.raises(
            UnsupportedFormatVersionError, match=r"format_version .* is not supported.*reads format_version 1, 2, 3"
        ):
            load_bundle(bundle)


# --------------------------------------------------------------------------- file names


class TestFileNames:
    @pytest.mark.parametrize(
        "name",
        [
            "/etc/passwd",
            "../outside.safetensors",
            "calls/../../outside.safetensors",
            "calls/..",
            "..",
            "C:\\Windows\\win.ini",
            "calls\\..\\..\\x",
            "c:x",
            "",
            "calls/a\x00b",
            "calls/\ud800",
            "calls/\n",
        ],
    )
    def test_unsafe_name_in_files(self, bundle, name):
        def edit(m):
            m["files"][name] = m["files"].pop(FILE0)
            for t in m["tensors"].values():
                if t["file"] == FILE0:
                    t["file"] = name

        edit_manifest(bundle, edit)
        with pytest.raises(UnsafeBundleError, match=r"File name|File .* leads outside") as info:
            load_bundle(bundle)
        assert repr(name) in str(info.value)

    def test_tensor_file_not_listed(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(file="/etc/passwd"))
        with pytest.raises(UnsafeBundleError, match=r"tensors\['t0'\]\.file: '/etc/passwd' is not listed"):
            load_bundle(bundle)

    def test_symlink_to_file_outside(self, bundle, tmp_path):
        outside = tmp_path / "stolen.safetensors"
        shutil.copy(bundle / FILE0, outside)  # same bytes: size and sha256 would pass
        (bundle / FILE0).unlink()
        (bundle / FILE0).symlink_to(outside)
        with pytest.raises(UnsafeBundleError, match=f"File '{FILE0}': '.*{FILE0}' is a symbolic link"):
            load_bundle(bundle)

    def test_symlink_dir_outside(self, bundle, tmp_path):
        shutil.copytree(bundle / "calls", tmp_path / "elsewhere")
        shutil.rmtree(bundle / "calls")
        (bundle / "calls").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(UnsafeBundleError, match=r"bundle/calls' is a symbolic link"):
            load_bundle(bundle)

    def test_dangling_symlink_outside(self, bundle):
        (bundle / FILE0).unlink()
        (bundle / FILE0).symlink_to("/nonexistent/iobundle-test")
        with pytest.raises(UnsafeBundleError, match="is a symbolic link"):
            load_bundle(bundle)

    def test_a_symlink_inside_is_refused_too(self, bundle):
        """A link is refused wherever it points: the bundle holds only its own files."""
        (bundle / "calls" / "real.safetensors").write_bytes((bundle / FILE0).read_bytes())
        (bundle / FILE0).unlink()
        (bundle / FILE0).symlink_to("real.safetensors")
        with pytest.raises(UnsafeBundleError, match=f"{FILE0}' is a symbolic link"):
            load_bundle(bundle)

    def test_a_symlinked_calls_dir_inside_is_refused_too(self, bundle):
        (bundle / "calls").rename(bundle / "real-calls")
        (bundle / "calls").symlink_to("real-calls")
        with pytest.raises(UnsafeBundleError, match="calls' is a symbolic link"):
            load_bundle(bundle)

    def test_a_symlink_swapped_in_after_the_open_is_not_followed(self, bundle, tmp_path):
        """The checks run at load; a file replaced by a link afterwards is still refused when it is read."""
        b = load_bundle(bundle)
        outside = tmp_path / "stolen.safetensors"
        shutil.copy(bundle / FILE1, outside)
        (bundle / FILE1).unlink()
        (bundle / FILE1).symlink_to(outside)
        with pytest.raises(UnsafeBundleError, match="is a symbolic link"):
            b.tensor("t2")

    def test_each_folder_is_listed_once_per_bundle(self, bundle, monkeypatch):
        listed = []
        real = os.scandir
        monkeypatch.setattr(os, "scandir", lambda p=".": listed.append(p) or real(p))
        resolved = []
        real_realpath = os.path.realpath
        monkeypatch.setattr(
            os.path, "realpath", lambda p, *a, **k: resolved.append(str(p)) or real_realpath(p, *a, **k)
        )
        exercise(bundle)
        assert load_bundle(bundle).verify() == []
        # one listing of calls/ per bundle (two bundles here), none per file, and verify()'s one listing of the
        # root and of calls/ for the files the manifest does not list; no realpath at all
        assert len(listed) == 4
        assert not resolved


# --------------------------------------------------------------------------- tensor files


class TestTensorFiles:
    def test_missing_file(self, bundle):
        (bundle / FILE1).unlink()
        b = load_bundle(bundle)  # lazily: reading fails, not loading
        b.tensor("t0")
        with pytest.raises(TensorFileError, match=f"{FILE1}: missing from the bundle"):
            b.tensor("t2")
        with pytest.raises(TensorFileError, match=FILE1):
            b.infer_arguments(1)

    def test_truncated_file_does_not_crash(self, tmp_path):
        """Truncated tensor files, read in a child process: an error, never a SIGBUS.

        With the manifest unchanged the size check refuses the file; with a manifest that agrees
        with the truncated file (size and sha256 updated) only the header checks stand between
        the reader and a mapping past the end of the file.
        """
        cases, expected = [], []
        for cut in (1, 10, 12, 100, 200):
            for resync in (False, True):
                for verify in (True, False):
                    path = make_bundle(tmp_path / f"cut{cut}-{resync}-{verify}")
                    data = (path / FILE1).read_bytes()
                    replace_tensor_file(path, FILE1, data[: len(data) - cut], resync=resync)
                    cases.append((path, verify))
                    expected.append("TensorFileError" if resync else "IntegrityError")
        for outcome, want, (path, _) in zip(run_isolated(cases), expected, cases):
            assert outcome.startswith(f"{want}: {FILE1}: "), (path.name, outcome)

    def test_truncated_to_nothing(self, bundle):
        replace_tensor_file(bundle, FILE0, b"\x01\x02")
        with pytest.raises(
            UnsafeBundleError, match=f"tensors\\['t0'\\]: F32 \\[2, 3\\] needs 24 bytes but its file '{FILE0}' has 2"
        ):
            load_bundle(bundle)

    def test_too_short_for_a_header(self, bundle):
        replace_tensor_file(bundle, FILE0, b"\x01\x02")
        edit_manifest(bundle, lambda m: [m["tensors"][k].update(shape=[0, 3]) for k in ("t0", "t1")])
        with pytest.raises(TensorFileError, match=f"{FILE0}: 2 bytes, too short for a safetensors header"):
            load_bundle(bundle).tensor("t0")

    def test_file_is_a_directory(self, bundle):
        (bundle / FILE0).unlink()
        (bundle / FILE0).mkdir()
        with pytest.raises(TensorFileError, match=f"{FILE0}: not a regular file"):
            exercise(bundle)

    @pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
    def test_file_is_a_fifo(self, bundle):
        (bundle / FILE0).unlink()
        os.mkfifo(bundle / FILE0)
        outcomes = run_isolated([(bundle, True), (bundle, False)], timeout=60)  # a blocking open would time out
        for out in outcomes:
            assert out.startswith(f"TensorFileError: {FILE0}: not a regular file"), out

    @pytest.mark.parametrize("header_len", [2**64 - 1, 2**63, 10**12, 101 * 1024**2])
    def test_absurd_header_length(self, bundle, header_len):
        data = (bundle / FILE0).read_bytes()
        replace_tensor_file(bundle, FILE0, struct.pack("<Q", header_len) + data[8:])
        with pytest.raises(TensorFileError, match=f"{FILE0}: header length {header_len} is past the end"):
            exercise(bundle)

    def test_header_length_past_eof(self, bundle):
        data = (bundle / FILE0).read_bytes()
        replace_tensor_file(bundle, FILE0, struct.pack("<Q", len(data) - 7) + data[8:])
        with pytest.raises(TensorFileError, match=f"{FILE0}: header length {len(data) - 7} is past the end"):
            exercise(bundle)

    def test_header_over_limit(self, bundle, monkeypatch):
        monkeypatch.setattr(capture_tensorfile, "MAX_HEADER_BYTES", 16)
        with pytest.raises(TensorFileError, match=f"{FILE0}: header length .* over the limit of 16 bytes"):
            exercise(bundle)

    @pytest.mark.parametrize(
        ("header", "message"),
        [
            (b"\xff\xfe not json", "not valid JSON"),
            (b"[1, 2, 3]", "not a JSON object"),
            (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        ],
    )
    def test_header_not_a_json_object(self, bundle, header, message):
        _, body = split_tensor_file((bundle / FILE0).read_bytes())
        replace_tensor_file(bundle, FILE0, struct.pack("<Q", len(header)) + header + body)
        with pytest.raises(TensorFileError, match=f"{FILE0}: the safetensors header is {message}"):
            exercise(bundle)

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("dtype", "F16"),
            ("dtype", "I32"),
            ("dtype", None),
            ("shape", [3, 2]),
            ("shape", [6]),
            ("shape", [2, 3, 1]),
            ("shape", [2.0, 3.0]),
            ("shape", [2, -3]),
            ("shape", "2,3"),
        ],
    )
    def test_header_disagrees_with_manifest(self, bundle, field, value):
        edit_tensor_header(bundle, FILE0, lambda h: h["t0"].update({field: value}))
        with pytest.raises(
            TensorFileError,
            match=f"{FILE0}: tensor 't0' \\(key 't0'\\) is .* in the file, F32 \\[2, 3\\] in the manifest",
        ):
            exercise(bundle)

    @pytest.mark.parametrize(
        "offsets",
        [
            [0, 20],
            [0, 28],
            [-24, 0],
            [24, 0],
            [100, 124],
            [0, 2**70],
            [0.0, 24.0],
            [0],
            [0, 24, 48],
            "0-24",
            None,
            [True, 24],
        ],
    )
    def test_bad_data_offsets(self, bundle, offsets):
        edit_tensor_header(bundle, FILE0, lambda h: h["t0"].update(data_offsets=offsets))
        with pytest.raises(
            TensorFileError, match=f"{FILE0}: tensor 't0' \\(key 't0'\\) (spans bytes|has invalid data_offsets)"
        ):
            exercise(bundle)

    def test_tensor_missing_from_file(self, bundle):
        edit_tensor_header(bundle, FILE0, lambda h: h.pop("t0"))
        with pytest.raises(TensorFileError, match=f"{FILE0}: tensor 't0' \\(key 't0'\\) is not in the file"):
            exercise(bundle)

    def test_manifest_names_a_key_the_file_lacks(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(name="nope"))
        with pytest.raises(TensorFileError, match=f"{FILE0}: tensor 'nope' \\(key 't0'\\) is not in the file"):
            exercise(bundle)

    def test_manifest_names_the_metadata(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(name="__metadata__"))
        with pytest.raises(TensorFileError, match="'__metadata__' \\(key 't0'\\) is not in the file"):
            exercise(bundle)

    @pytest.mark.parametrize(
        ("field", "value"), [("dtype", "I32"), ("dtype", "F16"), ("shape", [3, 2]), ("shape", [1, 2, 3])]
    )
    def test_manifest_disagrees_with_header(self, bundle, field, value):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update({field: value}))
        b = load_bundle(bundle)
        for read in (lambda: b.tensor("t0"), lambda: b.tensor("t1")):  # any tensor of the file
            with pytest.raises(
                TensorFileError, match=f"{FILE0}: tensor 't0' \\(key 't0'\\) is 'F32' \\[2, 3\\] in the file"
            ):
                read()

    def test_manifest_shape_larger_than_file(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(shape=[1000, 1000]))
        with pytest.raises(
            UnsafeBundleError,
            match=f"tensors\\['t0'\\]: F32 \\[1000, 1000\\] needs 4000000 bytes but its file '{FILE0}'",
        ):
            load_bundle(bundle)


# --------------------------------------------------------------------------- node types

FORBIDDEN_TYPES = [
    "os.system",
    "subprocess.Popen",
    "pytree:os.system",
    "pytree:subprocess.Popen",
    "builtins.eval",
    "pytree:builtins.exec",
    "torch.load",
    "pickle.loads",
    "importlib.import_module",
]


@pytest.fixture
def forbid_code_execution(monkeypatch):
    """Make every way to run a program raise, and record the calls."""
    calls = []

    def forbidden(name):
        def raiser(*args, **kwargs):
            calls.append((name, args))
            raise AssertionError(f"{name} was called with {args!r}")

        return raiser

    for module, names in [
        (os, ["system", "popen", "execv", "execve", "execvp", "execl", "spawnv", "spawnve", "posix_spawn", "fork"]),
        (subprocess, ["Popen", "run", "call", "check_call", "check_output", "getoutput"]),
    ]:
        for name in names:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden(f"{module.__name__}.{name}"))
    return calls


class TestNodeTypes:
    @pytest.fixture(autouse=True)
    def _warm_up(self, tmp_path_factory):
        # Import lazily loaded modules once, so a fresh import during the test is the bundle's doing.
        exercise(make_bundle(tmp_path_factory.mktemp("warm") / "b"))

    @pytest.mark.parametrize("type_name", FORBIDDEN_TYPES)
    @pytest.mark.parametrize("where", ["args", "outputs"])
    def test_unknown_node_type(self, bundle, forbid_code_execution, type_name, where):
        def wrap(node):
            return {"kind": "node", "type": type_name, "version": 0, "context": ["echo pwned"], "items": [node]}

        def edit(m):
            for call in m["calls"]:
                if where == "args":
                    call["args"][0] = wrap(call["args"][0])
                else:
                    call["outputs"] = wrap(call["outputs"])

        edit_manifest(bundle, edit)
        modules = set(sys.modules)
        b = load_bundle(bundle)
        if where == "args":
            b.infer_dynamic_shapes()  # structure only: nothing is rebuilt, nothing is refused yet
            for i in range(b.num_obs()):
                with pytest.raises(
                    UnsafeBundleError, match=f"args\\[0\\]: (node type|class) '{type_name.removeprefix('pytree:')}'"
                ):
                    b.infer_arguments(i)
        else:
            for i in range(b.num_obs()):
                with pytest.raises(UnsafeBundleError, match=f"(node type|class) '{type_name.removeprefix('pytree:')}'"):
                    b.outputs(i)
        assert forbid_code_execution == []
        assert set(sys.modules) - modules == set()

    def test_opaque_node_is_refused(self, bundle):
        def edit(m):
            for call in m["calls"]:
                call["args"][0] = {"kind": "opaque", "type": "os.system", "reason": "hostile"}

        edit_manifest(bundle, edit)
        with pytest.raises(AlignmentError, match=r"a os\.system was not recorded"):
            load_bundle(bundle).infer_arguments(0)

    def test_dangling_tensor_reference(self, bundle):
        edit_manifest(
            bundle, lambda m: m["calls"][1]["kwargs"]["d"]["items"].__setitem__(0, {"kind": "tensor", "key": "t99"})
        )
        with pytest.raises(UnsafeBundleError, match=r"calls\[1\]\.kwargs\['d'\] refers to tensor 't99'"):
            load_bundle(bundle)

    def test_dict_keys_and_items_disagree(self, bundle):
        edit_manifest(bundle, lambda m: m["calls"][1]["kwargs"]["d"].update(keys=["w", "v"]))
        with pytest.raises(ManifestError, match=r"calls\[1\]\.kwargs\['d'\] is a dict with 2 keys but 1 items"):
            load_bundle(bundle)

    def test_dict_repeated_key(self, bundle):
        def edit(m):
            d = m["calls"][1]["kwargs"]["d"]
            d["keys"] = ["w", "w"]
            d["items"] = d["items"] * 2

        edit_manifest(bundle, edit)
        with pytest.raises(ManifestError, match=r"calls\[1\]\.kwargs\['d'\] is a dict with a repeated key"):
            load_bundle(bundle)


# --------------------------------------------------------------------------- limits and numbers


class TestLimits:
    def test_limits_are_documented(self):
        doc = schema_io.__doc__
        for name in [
            "MAX_MANIFEST_BYTES",
            "MAX_NESTING_DEPTH",
            "MAX_CALLS",
            "MAX_TENSORS",
            "MAX_TENSOR_RANK",
            "MAX_TENSOR_ELEMENTS",
        ]:
            assert name in doc, name
        assert "MAX_HEADER_BYTES" in replay_tensorfile.__doc__

    def test_manifest_over_byte_limit(self, bundle, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_MANIFEST_BYTES", 1000)
        with pytest.raises(UnsafeBundleError, match=r"manifest\.json: \d+ bytes, over the limit of 1000 bytes"):
            load_bundle(bundle)

    def test_parse_over_byte_limit(self, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_MANIFEST_BYTES", 10)
        with pytest.raises(UnsafeBundleError, match="over the limit of 10 bytes"):
            schema_io.parse_manifest(b"{" + b" " * 20 + b"}")

    def test_nesting_beyond_limit(self, bundle):
        def edit(m):
            node = m["calls"][0]["args"][0]
            for _ in range(schema_io.MAX_NESTING_DEPTH):
                node = {"kind": "list", "items": [node]}
            m["calls"][0]["args"][0] = node

        edit_manifest(bundle, edit)
        with pytest.raises(
            UnsafeBundleError, match=f"manifest\\.json: JSON nesting deeper than {schema_io.MAX_NESTING_DEPTH} levels"
        ):
            load_bundle(bundle)

    def test_nesting_beyond_parser(self, bundle):
        text = (bundle / "manifest.json").read_text()
        assert '"value_if_missing":[]' in text
        text = text.replace('"value_if_missing":[]', '"value_if_missing":' + "[" * 200_000 + "]" * 200_000)
        (bundle / "manifest.json").write_text(text)
        with pytest.raises(UnsafeBundleError, match=r"manifest\.json: JSON nesting"):
            load_bundle(bundle)

    def test_nesting_within_limit_is_fine(self, bundle):
        def edit(m):
            for call in m["calls"]:
                node = call["args"][0]
                for _ in range(40):
                    node = {"kind": "list", "items": [node]}
                call["args"][0] = node

        edit_manifest(bundle, edit)
        exercise(bundle)

    def test_too_many_calls(self, bundle, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_CALLS", 1)
        with pytest.raises(UnsafeBundleError, match=r"manifest\.json: calls holds 2 entries, over the limit of 1"):
            load_bundle(bundle)

    def test_too_many_tensors(self, bundle, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_TENSORS", 4)
        with pytest.raises(UnsafeBundleError, match=r"manifest\.json: tensors holds 5 entries, over the limit of 4"):
            load_bundle(bundle)

    def test_too_many_dimensions(self, bundle):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(shape=[1] * 65))
        with pytest.raises(UnsafeBundleError, match=r"tensors\['t0'\]\.shape has 65 dimensions, over the limit of 64"):
            load_bundle(bundle)

    @pytest.mark.parametrize("shape", [[10**30], [0, 10**30], [2**62, 3], [0, 2**40, 2**40], [2**64]])
    def test_huge_shape(self, bundle, shape):
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(shape=shape))
        with pytest.raises(UnsafeBundleError, match=r"tensors\['t0'\]\.shape .* is too large"):
            load_bundle(bundle)

    def test_zero_dim_huge_shape_within_limit_is_refused_by_file_check(self, bundle):
        # 0 elements, so it fits any file, but the file header says [2, 3].
        edit_manifest(bundle, lambda m: m["tensors"]["t0"].update(shape=[0, 2**30]))
        with pytest.raises(TensorFileError, match=f"{FILE0}: tensor 't0'"):
            exercise(bundle)

    @pytest.mark.parametrize(
        "literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1", "2.5", "1" * 5000, "null", "[2]", '"two"', "{}"]
    )
    def test_non_integer_shape(self, bundle, literal):
        manifest = read_manifest(bundle)
        manifest["tensors"]["t0"]["shape"] = ["__SHAPE__", 3]
        (bundle / "manifest.json").write_text(json.dumps(manifest).replace('"__SHAPE__"', literal))
        with pytest.raises(ManifestError, match=r"manifest\.json") as info:
            load_bundle(bundle)
        if len(literal) < 100:
            assert "tensors.t0.shape[0]" in str(info.value)

    @pytest.mark.parametrize(
        ("field", "value"), [("size", -1), ("size", "NaN"), ("size", 1.5), ("sha256", "0" * 63), ("sha256", "../")]
    )
    def test_bad_file_entry(self, bundle, field, value):
        edit_manifest(bundle, lambda m: m["files"][FILE0].update({field: value}))
        with pytest.raises(ManifestError, match=f"files\\.{FILE0}\\.{field}"):
            load_bundle(bundle)

    def test_huge_file_size(self, bundle):
        edit_manifest(bundle, lambda m: m["files"][FILE0].update(size=10**30))
        with pytest.raises(IntegrityError, match=f"{FILE0}: \\d+ bytes, the manifest says {10**30}"):
            exercise(bundle)

    @pytest.mark.parametrize("value", [-1, -(2**70)])
    def test_negative_call_index(self, bundle, value):
        edit_manifest(bundle, lambda m: m["calls"][0].update(index=value))
        with pytest.raises(ManifestError, match=r"calls\[0\]\.index"):
            load_bundle(bundle)

    @pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400"])
    def test_non_finite_numbers_elsewhere_are_data(self, bundle, value):
        """NaN and inf latency or constants are legal values: they load, nothing crashes."""
        manifest = read_manifest(bundle)
        manifest["calls"][0]["latency"] = "__X__"
        (bundle / "manifest.json").write_text(json.dumps(manifest).replace('"__X__"', value))
        exercise(bundle)


# --------------------------------------------------------------------------- format 2: extensions


class Growing(torch.nn.Module):
    def forward(self, x, past):
        return x * 2


def make_growing(path: Path) -> Path:
    """Three calls whose cache grows by one position: t1 extends t0... (format version 2)."""
    model, observer = Growing(), InputObserver()
    full = torch.randn(1, 2, 6, 4)
    with observer(model, store_n_calls=3):
        for n in (3, 4, 5):
            model(torch.randn(2), full[:, :, :n].clone())
    observer.save(path)
    return path


@pytest.fixture
def growing(tmp_path: Path) -> Path:
    return make_growing(tmp_path / "growing")


def extension_keys(path: Path) -> list[str]:
    return [k for k, e in read_manifest(path)["tensors"].items() if "extends" in e]


class TestExtensions:
    def test_seed_has_chained_extensions(self, growing):
        keys = extension_keys(growing)
        tensors = read_manifest(growing)["tensors"]
        assert len(keys) == 2 and tensors[keys[1]]["extends"]["key"] == keys[0]
        exercise(growing)

    def test_cycle_is_refused(self, growing):
        a, b = extension_keys(growing)
        edit_manifest(growing, lambda m: m["tensors"][a].update(extends={"key": b, "dim": 2}))
        with pytest.raises(UnsafeBundleError, match=rf"tensors\['{a}'\]\.extends: tensor '{b}' is listed after it"):
            load_bundle(growing)

    def test_self_reference_is_refused(self, growing):
        a = extension_keys(growing)[0]
        edit_manifest(growing, lambda m: m["tensors"][a].update(extends={"key": a, "dim": 2}))
        with pytest.raises(UnsafeBundleError, match="is listed after it \\(or is itself\\)"):
            load_bundle(growing)

    def test_unknown_base_is_refused(self, growing):
        a = extension_keys(growing)[0]
        edit_manifest(growing, lambda m: m["tensors"][a].update(extends={"key": "nowhere", "dim": 2}))
        with pytest.raises(UnsafeBundleError, match="tensor 'nowhere' is not listed"):
            load_bundle(growing)

    @pytest.mark.parametrize("dim", [0, 3, 4, 99])
    def test_dim_out_of_range_or_not_the_growing_one(self, growing, dim):
        a = extension_keys(growing)[0]
        edit_manifest(growing, lambda m: m["tensors"][a]["extends"].update(dim=dim))
        with pytest.raises(UnsafeBundleError, match=rf"tensors\['{a}'\]\.extends"):
            load_bundle(growing)

    @pytest.mark.parametrize("dim", [-1, "2", 2.0, None, True])
    def test_dim_of_the_wrong_type(self, growing, dim):
        a = extension_keys(growing)[0]
        edit_manifest(growing, lambda m: m["tensors"][a]["extends"].update(dim=dim))
        with pytest.raises(ManifestError, match=r"extends\.dim"):
            load_bundle(growing)

    def test_wrong_dtype_is_refused(self, growing):
        a = extension_keys(growing)[0]
        base = read_manifest(growing)["tensors"][a]["extends"]["key"]
        edit_manifest(growing, lambda m: m["tensors"][base].update(dtype="F16"))
        with pytest.raises(UnsafeBundleError, match=rf"F32 \[1, 2, 4, 4\] cannot extend '{base}' \(F16"):
            load_bundle(growing)

    def test_base_longer_than_the_tensor_is_refused(self, growing):
        a = extension_keys(growing)[0]
        base = read_manifest(growing)["tensors"][a]["extends"]["key"]
        edit_manifest(growing, lambda m: m["tensors"][base].update(shape=[1, 2, 9, 4]))
        with pytest.raises(UnsafeBundleError, match="does not extend"):
            load_bundle(growing)

    def test_stored_part_disagreeing_with_the_header_is_an_error(self, growing):
        """The header holds the new part's shape: a manifest lying about the full shape is caught."""
        a = extension_keys(growing)[0]
        edit_manifest(growing, lambda m: m["tensors"][a].update(shape=[1, 2, 5, 4]))
        with pytest.raises(IobundleError, match=a):
            exercise(growing)

    def test_extends_in_a_version_1_manifest_is_refused(self, growing):
        def edit(m):
            m["format_version"] = 1
            for f in m["files"].values():
                f["sha256"] = "0" * 64
                del f["hash"], f["digest"]

        edit_manifest(growing, edit)
        with pytest.raises(ManifestError, match="extends is a format_version 2 field"):
            load_bundle(growing)

    def test_sha256_in_a_version_2_manifest_is_checked(self, growing):
        """Version 2 may name a file's hash sha256 (the version-1 spelling): it is checked as such."""
        data = (growing / FILE0).read_bytes()

        def edit(m, digest):
            f = m["files"][FILE0]
            f.pop("hash", None), f.pop("digest", None)
            f["sha256"] = digest

        edit_manifest(growing, lambda m: edit(m, hashlib.sha256(data).hexdigest()))
        assert load_bundle(growing).verify() == []
        edit_manifest(growing, lambda m: edit(m, "0" * 64))
        with pytest.raises(IntegrityError, match=f"{FILE0}: sha256"):
            load_bundle(growing).tensor(extension_keys(growing)[0])

    def test_hash_and_digest_must_agree(self, growing):
        edit_manifest(growing, lambda m: m["files"][FILE0].update(digest="0" * 64))
        with pytest.raises(ManifestError, match="xxh3-128 digest has 32 hex digits"):
            load_bundle(growing)

    @pytest.mark.parametrize("algorithm", ["md5", "blake3", "", None])
    def test_unknown_hash_algorithm(self, growing, algorithm):
        edit_manifest(growing, lambda m: m["files"][FILE0].update(hash=algorithm))
        with pytest.raises(ManifestError, match="hash"):
            load_bundle(growing)

    def test_chain_over_the_limit_is_refused(self, growing, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_EXTENSION_DEPTH", 1)
        with pytest.raises(UnsafeBundleError, match="a chain of more than 1 extensions"):
            load_bundle(growing)

    def test_long_chain_is_refused_before_reading(self, tmp_path, monkeypatch):
        """Tensors each extending the previous one, past the limit: refused when the manifest is read."""
        monkeypatch.setattr(schema_io, "MAX_EXTENSION_DEPTH", 1000)
        path = make_growing(tmp_path / "huge")
        manifest = read_manifest(path)
        first = next(iter(manifest["tensors"].values()))
        tensors = {"r": {**first, "shape": [1, 0]}}
        tensors["r"].pop("extends", None)
        for i in range(3000):
            tensors[f"c{i}"] = {
                **tensors["r"],
                "shape": [1, i + 1],
                "extends": {"key": "r" if i == 0 else f"c{i - 1}", "dim": 1},
            }
        manifest["tensors"] = tensors
        write_manifest(path, manifest)
        with pytest.raises(UnsafeBundleError, match="chain of more than 1000 extensions"):
            load_bundle(path)


# --------------------------------------------------------------------------- format 2: the journal


def make_journal_bundle(path: Path) -> Path:
    """A stream as a killed writer leaves it: journal.jsonl and no manifest.json."""
    model, observer = Growing(), InputObserver()
    full = torch.randn(1, 2, 6, 4)
    copy = path.with_name(path.name + ".open")
    with observer(model, store_n_calls=3, stream_to=copy):
        for n in (3, 4, 5):
            model(torch.randn(2), full[:, :, :n].clone())
        while len(load_manifest(copy).calls) < 3:  # the writer appends the last call's line
            time.sleep(0.01)
        shutil.copytree(copy, path)
    return path


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    return make_journal_bundle(tmp_path / "journal")


class TestJournal:
    def test_seed_opens_from_its_journal(self, journal):
        assert not (journal / "manifest.json").exists()
        b = load_bundle(journal)
        assert b.num_obs() == 3 and b.verify() == []
        exercise(journal)

    def test_a_torn_last_line_is_ignored(self, journal):
        data = (journal / "journal.jsonl").read_bytes()
        (journal / "journal.jsonl").write_bytes(data[:-40])
        assert load_bundle(journal).num_obs() == 2

    def test_a_bad_line_in_the_middle_is_an_error(self, journal):
        lines = (journal / "journal.jsonl").read_bytes().split(b"\n")
        lines[1] = lines[1][:-5]
        (journal / "journal.jsonl").write_bytes(b"\n".join(lines))
        with pytest.raises(ManifestError, match=r"journal\.jsonl: line 2 is not valid JSON"):
            load_bundle(journal)

    def test_no_complete_head(self, journal):
        (journal / "journal.jsonl").write_bytes(b'{"journal": 1, "format": "iob')
        with pytest.raises(ManifestError, match="no complete first line"):
            load_bundle(journal)

    def test_head_without_marker(self, journal):
        lines = (journal / "journal.jsonl").read_bytes().split(b"\n")
        lines[0] = lines[0].replace(b'"journal":1,', b"")
        (journal / "journal.jsonl").write_bytes(b"\n".join(lines))
        with pytest.raises(ManifestError, match="line 1 is not a journal head"):
            load_bundle(journal)

    @pytest.mark.parametrize("record", [b"[]", b"{}", b'{"call": {}, "tensors": [], "files": {}}', b"1"])
    def test_record_of_the_wrong_shape(self, journal, record):
        with open(journal / "journal.jsonl", "ab") as f:
            f.write(record + b"\n")
        with pytest.raises(ManifestError, match="is not a call record"):
            load_bundle(journal)

    def test_a_tensor_added_twice(self, journal):
        lines = (journal / "journal.jsonl").read_bytes().split(b"\n")
        (journal / "journal.jsonl").write_bytes(b"\n".join([*lines[:-1], lines[1], b""]))
        with pytest.raises(ManifestError, match="a second time"):
            load_bundle(journal)

    def test_future_version_in_the_head(self, journal):
        lines = (journal / "journal.jsonl").read_bytes().split(b"\n")
        assert b'"format_version":6' in lines[0]
        lines[0] = lines[0].replace(b'"format_version":6', b'"format_version":9')
        (journal / "journal.jsonl").write_bytes(b"\n".join(lines))
        with pytest.raises(UnsupportedFormatVersionError, match="format_version 9 is not supported"):
            load_bundle(journal)

    def test_journal_over_the_byte_limit(self, journal, monkeypatch):
        monkeypatch.setattr(schema_io, "MAX_MANIFEST_BYTES", 100)
        with pytest.raises(UnsafeBundleError, match=r"journal\.jsonl: \d+ bytes, over the limit"):
            load_bundle(journal)

    def test_journal_symlinked_outside(self, journal, tmp_path):
        outside = tmp_path / "elsewhere.jsonl"
        outside.write_bytes((journal / "journal.jsonl").read_bytes())
        (journal / "journal.jsonl").unlink()
        (journal / "journal.jsonl").symlink_to(outside)
        with pytest.raises(UnsafeBundleError, match=r"journal\.jsonl' is a symbolic link"):
            load_bundle(journal)

    def test_journal_is_a_fifo(self, journal):
        (journal / "journal.jsonl").unlink()
        os.mkfifo(journal / "journal.jsonl")
        with pytest.raises(ManifestError, match="not a regular file"):
            load_bundle(journal)

    def test_manifest_wins_over_the_journal(self, journal):
        b = load_bundle(journal)
        schema_io.write_manifest(journal, b.manifest.model_copy(update={"calls": b.manifest.calls[:1]}))
        assert load_bundle(journal).num_obs() == 1


def test_every_error_is_an_iobundle_error():
    for cls in (ManifestError, UnsupportedFormatVersionError, UnsafeBundleError, TensorFileError, IntegrityError):
        assert issubclass(cls, IobundleError)
