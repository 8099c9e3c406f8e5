"""`iobundle export`, `validate` and `demo`: exit codes, tables, reports, no tracebacks."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main

pytest.importorskip("onnxruntime")


@pytest.fixture
def workdir(tmp_path, factories):
    """A directory holding `factories.py` and a bundle of Scale(); the CLI runs from there."""
    model = factories.good()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    observer.save(tmp_path / "run.iobundle")
    sys.modules.pop("factories", None)  # the CLI imports it itself, as a user's run would
    yield tmp_path


@pytest.fixture(scope="module")
def good_onnx(tmp_path_factory: pytest.TempPathFactory, factories_source: str) -> Path:
    """Scale() exported once by ``iobundle export``, for the tests of what validate and convert make of an ONNX file."""
    root = tmp_path_factory.mktemp("good_onnx")
    (root / "factories.py").write_text(factories_source)
    namespace: dict[str, object] = {}
    exec(compile(factories_source, "factories.py", "exec"), namespace)
    model, observer = namespace["good"](), InputObserver()  # type: ignore[operator]
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    observer.save(root / "run.iobundle")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.syspath_prepend(str(root))
        assert main(["export", "run.iobundle", "--model", "factories:good", "-o", "good.onnx"]) == 0
    sys.modules.pop("factories", None)
    return root / "good.onnx"


def test_export_then_validate_pass(workdir, capsys):
    assert main(["export", "run.iobundle", "--model", "factories:good", "-o", "good.onnx"]) == 0
    out = capsys.readouterr().out
    assert "checked on 2 recorded calls" in out and "good.onnx" in out
    assert (workdir / "good.onnx").is_file()
    assert main(["validate", "run.iobundle", "good.onnx"]) == 0
    out = capsys.readouterr().out
    assert "PASS: 2/2 calls" in out


def test_wrong_model_exits_1(workdir, capsys):
    assert main(["export", "run.iobundle", "--model", "factories:drifted", "-o", "drifted.onnx"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "does not reproduce" in captured.err
    assert "Traceback" not in captured.err
    assert not (workdir / "drifted.onnx").exists()
    # --no-check writes the file anyway; validating it fails on every call
    assert main(["export", "run.iobundle", "--model", "factories:drifted", "-o", "drifted.onnx", "--no-check"]) == 1
    assert (workdir / "drifted.onnx").is_file()
    capsys.readouterr()
    assert main(["validate", "run.iobundle", "drifted.onnx"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 0/2 calls" in out
    assert out.count("FAIL: mismatch") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export", "missing.iobundle", "--model", "factories:good"], "does not exist"),
        (["export", "run.iobundle", "--model", "factories"], "expected MODULE:FACTORY"),
        (["export", "run.iobundle", "--model", "nosuchmodule:build"], "cannot import 'nosuchmodule'"),
        (["export", "run.iobundle", "--model", "factories:missing"], "has no attribute"),
        (["export", "run.iobundle", "--model", "factories:not_a_model"], "not a torch.nn.Module"),
        (["validate", "missing.iobundle", "good.onnx"], "does not exist"),
        (["validate", "run.iobundle", "missing.onnx"], "does not exist"),
        (["validate", "run.iobundle", "factories.py"], "cannot load the model"),
        (["validate", "run.iobundle", "x.onnx", "--report", "r.txt"], "--report r.txt"),
    ],
)
def test_unreadable_inputs_exit_2_with_one_line(workdir, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("error: ") and "Traceback" not in err


def test_missing_bundle_in_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "iobundle", "validate", str(tmp_path / "nope"), str(tmp_path / "m.onnx")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")


@pytest.mark.parametrize("suffix", [".json", ".csv", ".md", ".html"])
def test_validate_report_formats(workdir, good_onnx, capsys, suffix):
    shutil.copy(good_onnx, workdir / "good.onnx")
    report = workdir / f"report{suffix}"
    assert main(["validate", "run.iobundle", "good.onnx", "--report", str(report)]) == 0
    text = report.read_text()
    if suffix == ".html":
        assert text.startswith("<!DOCTYPE html>") and "<svg" in text
    elif suffix == ".json":
        rows = json.loads(text)
        assert [r["SUCCESS"] for r in rows] == [True, True]
    elif suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        assert [r["SUCCESS"] for r in rows] == ["True", "True"]
    else:
        assert text.startswith("## iobundle validate\\: good\\.onnx")  # Markdown-escaped
        assert "**PASS\\: 2/2 calls within atol\\=0\\.0001 rtol\\=0\\.1**" in text
        assert "| call | status | max abs |" in text


# What the `iobundle` console script runs: its own folder, not the current one, first on sys.path.
CONSOLE_SCRIPT = "import sys; del sys.path[0]; from iobundle.cli import main; sys.exit(main())"


@pytest.mark.slow
def test_demo_end_to_end_runs_again_from_a_folder_named_like_the_package(tmp_path):
    (tmp_path / "iobundle").mkdir()  # e.g. the folder above a clone: `python -m iobundle` would import it
    (tmp_path / "iobundle" / "__init__.py").write_text("")  # ahead of any install, editable or not
    for _ in range(2):  # the second run replaces the demo's own outputs
        proc = subprocess.run(
            [sys.executable, "-c", CONSOLE_SCRIPT, "demo", "demo"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "captured 6 calls" in proc.stdout
        assert "PASS: 6/6 calls" in proc.stdout
        assert "Traceback" not in proc.stderr
    assert (tmp_path / "demo" / "model.onnx").is_file()
    assert (tmp_path / "demo" / "demo.iobundle" / "manifest.json").is_file()


@pytest.mark.slow
def test_llama_demo_exports_from_the_bundle_alone(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "iobundle", "demo", "--llama", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "captured 6 calls of LlamaForCausalLM.forward" in proc.stdout
    assert "--from-bundle" in proc.stdout
    assert "patch: sdpa_without_is_causal" in proc.stdout and "patch: layout_copies" in proc.stdout
    assert "PASS: 6/6 calls" in proc.stdout
    manifest = json.loads((tmp_path / "demo" / "llama.iobundle" / "manifest.json").read_text())
    assert manifest["model"]["class_name"] == "LlamaForCausalLM"


def test_export_needs_exactly_one_model_source(workdir, capsys):
    assert main(["export", "run.iobundle"]) == 2
    assert "one of the arguments --model --from-bundle is required" in capsys.readouterr().err
    assert main(["export", "run.iobundle", "--model", "factories:good", "--from-bundle"]) == 2
    # a bundle saved without include_model cannot rebuild its model
    assert main(["export", "run.iobundle", "--from-bundle"]) == 2
    assert "include_model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("iobundle.input_slots", "{not json", "'iobundle.input_slots' is not JSON"),
        ("iobundle.input_slots", '["x"]', "'iobundle.input_slots' is a JSON list"),
        ("iobundle.input_slots", '{"x": "zero"}', "maps ['x'] to ['zero']"),
        ("iobundle.input_slots", '{"x": 7}', "not to slots 0..0"),
        ("iobundle.output_names", "[oops", "'iobundle.output_names' is not JSON"),
        ("iobundle.output_names", '{"a": 1}', "'iobundle.output_names' is not a JSON list"),
        ("iobundle.output_paths", '["output"]', "'iobundle.output_paths' is not a JSON object"),
        ("iobundle.output_paths", '{"a": "output", "b": "output"}', "names the recorded outputs ['output'] more"),
    ],
)
def test_corrupt_iobundle_metadata_exits_2_naming_the_model_and_key(workdir, good_onnx, capsys, key, value, message):
    import onnx

    proto = onnx.load(good_onnx)
    assert {p.key for p in proto.metadata_props} >= {"iobundle.input_slots", "iobundle.output_names", "iobundle.output_paths"}
    for p in proto.metadata_props:
        if p.key == key:
            p.value = value
    onnx.save(proto, "corrupt.onnx")
    capsys.readouterr()
    for argv in (["validate", "run.iobundle", "corrupt.onnx"], ["convert", "run.iobundle", "--to", "onnx-testdata", "td", "--model", "corrupt.onnx"]):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ONNX model 'corrupt.onnx'") and message in err and "Traceback" not in err
