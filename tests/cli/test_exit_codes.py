"""One exit code per condition, the same in every command; outputs through one resolver of paths and URLs.

Every command runs on the same damaged bundles (a truncated tensor file, a missing tensor file,
a bad manifest, a path that does not exist) and its code is compared with the exit-code table of docs/cli.md.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main
from iobundle.cli._exits import EXIT_CHECK_FAILED, EXIT_DAMAGED, EXIT_OK, EXIT_USAGE

pytest.importorskip("onnxruntime")

CLI_DOC = Path(__file__).parents[2] / "docs" / "cli.md"  # the exit-code table lives on the command-line page

WRONG_SHAPE = """

def wrong_shape():
    return torch.nn.Linear(5, 2)  # the recorded x is n x 4
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, factories_source: str) -> Iterator[Path]:
    """A directory (the CLI runs from it) with ``factories.py``, a bundle ``run.iobundle`` and its ``model.onnx``.

    The ONNX model is exported once, with ``-q`` and two ``--report`` files, which the tests below check.
    """
    root = tmp_path_factory.mktemp("exit_codes")
    (root / "factories.py").write_text(factories_source + WRONG_SHAPE)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.syspath_prepend(str(root))
        import factories

        model = factories.good()
        observer = InputObserver()
        with torch.no_grad(), observer(model):
            model(torch.randn(2, 4))
            model(torch.randn(3, 4))
        observer.save(root / "run.iobundle")
        sys.modules.pop("factories", None)
        argv = ["export", "run.iobundle", "--model", "factories:good", "-o", "model.onnx", "-q"]
        code = main([*argv, "--report", "a.json", "--report", "b.json"])
        assert code == EXIT_OK
        yield root
        sys.modules.pop("factories", None)


@pytest.fixture
def cwd(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    yield workdir
    sys.modules.pop("factories", None)


def _truncate(path: Path) -> None:
    first = sorted((path / "calls").iterdir())[0]
    first.write_bytes(first.read_bytes()[:-10])


def _remove(path: Path) -> None:
    sorted((path / "calls").iterdir())[0].unlink()


def _bad_manifest(path: Path) -> None:
    (path / "manifest.json").write_text("{not json", encoding="utf-8")


def _no_path(path: Path) -> None:
    shutil.rmtree(path)


DAMAGE: dict[str, tuple[Callable[[Path], None], int]] = {
    "truncated tensor file": (_truncate, EXIT_DAMAGED),
    "missing tensor file": (_remove, EXIT_DAMAGED),
    "bad manifest": (_bad_manifest, EXIT_DAMAGED),
    "missing path": (_no_path, EXIT_USAGE),
}

COMMANDS: dict[str, Callable[[str, Path], list[str]]] = {
    "inspect": lambda b, out: ["inspect", b],
    "shapes": lambda b, out: ["shapes", b],
    "verify": lambda b, out: ["verify", b],
    "export": lambda b, out: ["export", b, "--model", "factories:good", "-o", str(out / "e.onnx")],
    "validate": lambda b, out: ["validate", b, "model.onnx"],
    "run": lambda b, out: ["run", b, "--model", "factories:good"],
    "diff": lambda b, out: ["diff", "run.iobundle", b],
    "pack": lambda b, out: ["pack", b, "-o", str(out / "p.tar")],
    "redact": lambda b, out: ["redact", b, "-o", str(out / "r.iobundle")],
    "convert": lambda b, out: ["convert", b, "--to", "npz", str(out / "npz")],
}


@pytest.fixture(scope="module")
def damaged(workdir: Path) -> dict[str, str]:
    """One copy of the bundle per kind of damage (the commands only read them)."""
    paths = {}
    for kind, (damage, _) in DAMAGE.items():
        path = workdir / f"damaged-{kind.replace(' ', '-')}.iobundle"
        shutil.copytree(workdir / "run.iobundle", path)
        damage(path)
        paths[kind] = path.name
    return paths


def _readme_codes() -> dict[int, str]:
    text = CLI_DOC.read_text(encoding="utf-8")
    table = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    return {int(r[1]): r[2].strip() for r in rows}


def test_the_readme_table_lists_each_code_the_commands_use():
    codes = _readme_codes()
    assert sorted(codes) == [0, 1, 2, 3, 4, 5, 130]
    assert "damaged" in codes[EXIT_DAMAGED] and "truncated" in codes[EXIT_DAMAGED]
    assert "does not exist" in codes[EXIT_USAGE] and "optional dependency" in codes[EXIT_USAGE]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_command_exits_with_the_code_of_the_condition(cwd, damaged, tmp_path, capsys, kind):
    expected = DAMAGE[kind][1]
    assert expected in _readme_codes()
    codes = {}
    for name, argv in COMMANDS.items():
        out = tmp_path / name
        out.mkdir()
        codes[name] = main(argv(damaged[kind], out))
        err = capsys.readouterr().err
        if expected == EXIT_DAMAGED and name not in ("inspect", "verify"):  # those print the damage on stdout
            assert damaged[kind] in err.splitlines()[0], (name, err)  # the message says which bundle
        assert "Traceback" not in err
    assert codes == dict.fromkeys(COMMANDS, expected)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # nothing written from a damaged bundle


@pytest.mark.parametrize("kind", ["truncated tensor file", "missing tensor file"])
def test_pack_no_verify_still_refuses_missing_or_truncated_files(cwd, damaged, tmp_path, capsys, kind):
    packed = tmp_path / "d.tar"
    assert main(["pack", damaged[kind], "-o", str(packed), "--no-verify"]) == EXIT_DAMAGED
    assert damaged[kind] in capsys.readouterr().err and not packed.exists()


def test_pack_verifies_first_and_packs_nothing_from_a_changed_bundle(cwd, tmp_path, capsys):
    bundle = Path(shutil.copytree("run.iobundle", tmp_path / "b.iobundle"))
    target = sorted((bundle / "calls").iterdir())[-1]
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # same size: only a hash sees it
    target.write_bytes(bytes(data))
    assert main(["pack", str(bundle), "-o", str(tmp_path / "p.tar")]) == EXIT_DAMAGED
    assert "nothing packed" in capsys.readouterr().err and not (tmp_path / "p.tar").exists()
    assert main(["pack", str(bundle), "-o", str(tmp_path / "p.tar"), "--no-verify", "-q"]) == EXIT_OK
    members = sum(1 for p in bundle.rglob("*") if p.is_file())  # a format-4 bundle: manifest, segment, ...
    assert capsys.readouterr().out.splitlines()[0].startswith(f"packed {members} files")
    assert main(["unpack", str(tmp_path / "p.tar"), "-o", str(tmp_path / "u")]) == EXIT_DAMAGED


def test_shapes_dynamic_axis_out_of_range_is_a_usage_error_naming_the_input(cwd, capsys):
    assert main(["shapes", "run.iobundle", "--dynamic", "x:9"]) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --dynamic x:9: input 'x' has no axis 9") and "between 0 and 1" in err[0]
    assert err[1] == "hint: see 'iobundle shapes --help'"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["validate", "run.iobundle", "model.onnx", "--atol", "abc"], "is not a number"),
        (["validate", "run.iobundle", "model.onnx", "--report", "r.txt"], "extension picks the format"),
        (["export", "run.iobundle", "--model", "factories:good", "-o", "x.onnx", "--report", "e.txt"], "extension"),
        (["export", "run.iobundle", "--model", "factories:good", "-o", "x.onnx", "--atol", "logits=1"], "output"),
        (["shapes", "run.iobundle", "--batch", "nope"], "not an input"),
    ],
)
def test_bad_flag_values_exit_2_before_any_work(cwd, capsys, argv, message):
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert not Path("x.onnx").exists() and not Path("e.txt").exists()


# --------------------------------------------------------------------------- export like the others


def test_export_quiet_prints_the_verdict_and_writes_every_report(workdir):
    reports = [json.loads((workdir / name).read_text()) for name in ("a.json", "b.json")]
    assert reports[0] == reports[1] and reports[0]["ok"] is True and reports[0]["output"] == "model.onnx"


def test_export_takes_per_output_tolerances_like_validate(cwd, tmp_path, capsys):
    argv = ["export", "run.iobundle", "--model", "factories:drifted", "-o", str(tmp_path / "d.onnx"), "-q"]
    assert main(argv) == EXIT_CHECK_FAILED  # off by 0.5 everywhere
    assert main([*argv, "--atol", "output=0.6", "--rtol", "0"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: 2/2 recorded calls reproduced")


def test_export_refuses_an_existing_output_before_tracing(cwd, capsys):
    before = Path("model.onnx").read_bytes()
    assert main(["export", "run.iobundle", "--model", "factories:good", "-o", "model.onnx"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""  # no step ran
    assert "the file exists. Pass --overwrite" in captured.err
    assert Path("model.onnx").read_bytes() == before


def test_export_refuses_an_unwritable_output_before_tracing(cwd, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    argv = ["export", "run.iobundle", "--model", "factories:good", "-o", str(tmp_path / "a-file" / "m.onnx")]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and "a-file is not a directory" in captured.err


def test_validate_writes_every_report(cwd, tmp_path, capsys):
    paths = [tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.csv"]
    argv = ["validate", "run.iobundle", "model.onnx"] + [a for p in paths for a in ("--report", str(p))]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert all(p.is_file() and f"report written to {p}" in out for p in paths)
    assert paths[0].read_text().startswith("#") and json.loads(paths[1].read_text())


def test_quiet_is_the_verdict_only_for_every_command(cwd, tmp_path, capsys):
    runs = {
        "verify": ["verify", "run.iobundle"],
        "validate": ["validate", "run.iobundle", "model.onnx"],
        "pack": ["pack", "run.iobundle", "-o", str(tmp_path / "p.tar")],
        "convert": ["convert", "run.iobundle", "--to", "npz", str(tmp_path / "npz")],
        "redact": ["redact", "run.iobundle", "-o", str(tmp_path / "r.iobundle")],
    }
    for name, argv in runs.items():
        assert main([*argv, "-q"]) == EXIT_OK, name
        out = capsys.readouterr().out
        assert len(out.splitlines()) == 1, (name, out)


# --------------------------------------------------------------------------- outputs at URLs


WRITERS: dict[str, Callable[[str], list[str]]] = {
    "pack": lambda out: ["pack", "run.iobundle", "-o", out],
    "redact": lambda out: ["redact", "run.iobundle", "-o", out],
    "unpack": lambda out: ["unpack", "packed.tar", "-o", out],
    "convert": lambda out: ["convert", "run.iobundle", "--to", "npz", out],
    "export": lambda out: ["export", "run.iobundle", "--model", "factories:good", "-o", out],
}


@pytest.fixture
def packed(cwd: Path) -> Path:
    if not Path("packed.tar").exists():
        assert main(["pack", "run.iobundle", "-o", "packed.tar", "-q"]) == EXIT_OK
    return cwd / "packed.tar"


@pytest.mark.parametrize("writer", list(WRITERS))
def test_an_unknown_protocol_is_a_usage_error_and_never_a_local_folder(packed, capsys, writer):
    assert main(WRITERS[writer]("foo://bucket/out")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "foo://bucket/out" in err.splitlines()[0] and "Traceback" not in err
    assert not Path("foo:").exists()
    if writer in ("pack", "redact"):  # they upload: the message says what to install
        assert "pip install 'iobundle[remote]'" in err


@pytest.mark.parametrize("writer", ["pack", "redact"])
def test_a_missing_filesystem_implementation_names_the_extra(packed, capsys, monkeypatch, writer):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    assert main(WRITERS[writer]("s3://bucket/out")) == EXIT_USAGE
    assert "pip install 'iobundle[s3]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "fsspec", None)  # and without fsspec at all
    assert main(WRITERS[writer]("memory://out")) == EXIT_USAGE
    assert "pip install 'iobundle[remote]'" in capsys.readouterr().err
    assert not Path("s3:").exists() and not Path("memory:").exists()


@pytest.mark.parametrize("writer", ["pack", "redact", "unpack", "convert"])
@pytest.mark.parametrize("prefix", ["file://", "file://localhost"])
def test_file_urls_mean_the_local_root(packed, tmp_path, capsys, writer, prefix):
    target = tmp_path / "out"
    assert main([*WRITERS[writer](prefix + str(target)), "-q"]) == EXIT_OK
    capsys.readouterr()
    assert target.exists() and not Path("localhost").exists()


@pytest.mark.parametrize("writer", ["pack", "redact"])
def test_pack_and_redact_upload_to_a_url(packed, capsys, writer):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://exit-codes/{writer}/out"
    assert main([*WRITERS[writer](url), "-q"]) == EXIT_OK
    capsys.readouterr()
    assert fsspec.filesystem("memory").exists(url.split("://", 1)[1])
    assert main(["verify", url, "-q"]) == EXIT_OK


# --------------------------------------------------------------------------- errors that help


class _Other(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_validate_against_another_bundles_model_says_the_mismatch_in_one_line(cwd, tmp_path, capsys):
    observer = InputObserver()
    model = _Other()
    with observer(model):
        model(torch.ones(2, 3, 4, dtype=torch.int64))
    observer.save(tmp_path / "other.iobundle")
    assert main(["validate", str(tmp_path / "other.iobundle"), "model.onnx"]) == EXIT_USAGE
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2 and captured.out == ""
    assert lines[0] == (
        "error: model.onnx does not fit the bundle: x takes float of rank 2, the bundle holds int64 of rank 3. "
        "Give the ONNX model exported from this bundle (iobundle export BUNDLE ...)."
    )
    assert "ONNXRuntimeError" not in captured.err and lines[1].startswith("hint: check MODULE:FACTORY")


def test_each_error_class_has_a_hint_that_says_what_to_do(cwd, damaged, capsys):
    hints = {}
    for argv in (
        ["verify", "nope.iobundle"],
        ["shapes", damaged["truncated tensor file"]],
        ["pack", "run.iobundle", "-o", "model.onnx"],
    ):
        main(argv)
        hints[argv[0]] = capsys.readouterr().err.splitlines()[-1]
    assert hints["verify"].startswith("hint: check the path")
    assert hints["shapes"].startswith("hint: run `iobundle verify BUNDLE`")
    assert hints["pack"].startswith("hint: pass --overwrite")


def test_third_party_log_lines_stay_off_stderr_unless_verbose(cwd, tmp_path, capfd):
    argv = ["export", "run.iobundle", "--model", "factories:wrong_shape", "-o", str(tmp_path / "w.onnx")]
    assert main(argv) == EXIT_CHECK_FAILED
    lines = capfd.readouterr().err.splitlines()
    assert lines[0].startswith("error: torch.export failed on recorded call 0") and lines[-1].startswith("hint: -v")
    assert not any(re.match(r"[EWI]\d{4} ", line) for line in lines)  # torch's own log lines
    assert not any("fake_tensor.py" in line or "Traceback" in line for line in lines)
    sys.modules.pop("factories", None)
    assert main([*argv, "-v"]) == EXIT_CHECK_FAILED
    assert "fake_tensor.py" in capfd.readouterr().err  # torch's own error lines, with -v
