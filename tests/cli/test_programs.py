"""`iobundle export` writing one program per phase and their index; `iobundle validate` on the index."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main

pytest.importorskip("onnxruntime")

FACTORIES = textwrap.dedent(
    """
    import torch

    class Memory(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, memory=None):
            if memory is None:
                return self.lin(x) * 2.0 + 1.0
            return self.lin(x) + memory.mean(dim=1, keepdim=True)

    def memory():
        return Memory().eval()
    """
)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "phase_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import phase_factories

    model = phase_factories.memory()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(2, 4), memory=torch.randn(2, 3))
        model(torch.randn(2, 4), memory=torch.randn(2, 5))
    observer.save(tmp_path / "run.iobundle")
    sys.modules.pop("phase_factories", None)
    return tmp_path


def test_export_per_phase_then_validate_the_index(workdir, capsys):
    argv = ["export", "run.iobundle", "--model", "phase_factories:memory", "-o", "m.onnx", "--batch-all"]
    assert main([*argv, "--report", "export.json"]) == 0
    out = capsys.readouterr().out
    assert "2 programs, one per phase of the calls" in out
    assert "program p0: calls 0 (memory absent)" in out and "program p1: calls 1, 2 (every input present)" in out
    assert "beyond the recorded calls: batch 1 (call 0 cut from batch 2): ok" in out
    assert "program index written to m.programs.json" in out
    report = json.loads((workdir / "export.json").read_text())
    assert [p["file"] for p in report["programs"]] == ["m.p0.onnx", "m.p1.onnx"]
    assert all(c["success"] for p in report["programs"] for c in p["checks"])
    assert main(["validate", "run.iobundle", "m.programs.json"]) == 0
    out = capsys.readouterr().out
    assert "program" in out.splitlines()[0] and "PASS: 3/3 calls" in out


def test_export_programs_one_keeps_a_single_file(workdir, capsys):
    assert (
        main(["export", "run.iobundle", "--model", "phase_factories:memory", "-o", "one.onnx", "--programs", "one"])
        == 0
    )
    assert (workdir / "one.onnx").is_file() and not (workdir / "one.programs.json").exists()
    assert "not checked" in capsys.readouterr().out


def test_validate_a_broken_index_exits_2(workdir, capsys):
    (workdir / "bad.programs.json").write_text('{"format": "iobundle.programs", "programs": []}')
    assert main(["validate", "run.iobundle", "bad.programs.json"]) == 2
    assert "invalid program index" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("programs", "field"),
    [
        ([{"file": "loop.programs.json"}], "programs[0].file"),
        ([{}, {"file": "n.onnx", "calls": [1]}], "programs[1].name"),
        ([{"calls": [0, -1]}], "programs[0].calls"),
    ],
)
def test_validate_an_index_breaking_its_rules_exits_2_naming_the_field(workdir, capsys, programs, field):
    entry = {"name": "p0", "file": "m.onnx", "calls": [0], "traced_call": 0, "inputs": {"x": "present"}}
    data = {"format": "iobundle.programs", "format_version": 1, "programs": [{**entry, **p} for p in programs]}
    (workdir / "loop.programs.json").write_text(json.dumps(data))
    assert main(["validate", "run.iobundle", "loop.programs.json"]) == 2
    err = capsys.readouterr().err
    assert f"loop.programs.json: {field}" in err and "Traceback" not in err
