"""``iobundle export`` shows its work: each step's line when it ends (on a pipe too), a live indicator on a terminal, Ctrl-C keeps what was printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from iobundle import InputObserver

pytest.importorskip("onnxruntime")

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, factories_source: str) -> Path:
    root = tmp_path_factory.mktemp("show_the_work")
    (root / "factories.py").write_text(factories_source)
    namespace: dict[str, object] = {}
    exec(compile(factories_source, "factories.py", "exec"), namespace)
    model = namespace["good"]()  # type: ignore[operator]
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    observer.save(root / "run.iobundle")
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("IOBUNDLE_DEBUG", "NO_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    return env


# `python -m iobundle` with Ctrl-C delivered as a foreground terminal does: an ignored SIGINT is inherited (a
# background job's, or one a test of this xdist worker left), and Python then installs no KeyboardInterrupt
_FOREGROUND = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('iobundle', run_name='__main__', alter_sys=True)"
)


def test_on_a_pipe_each_step_shows_when_it_ends_and_ctrl_c_keeps_them(workdir):
    onnx = workdir / "piped.onnx"
    argv = ["export", "run.iobundle", "--model", "factories:good", "-o", onnx.name]
    proc = subprocess.Popen(
        [sys.executable, "-c", _FOREGROUND, *argv], cwd=workdir, env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    seen = []
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        seen.append((line.rstrip("\n"), onnx.exists(), proc.poll()))
        if line.startswith("check exported program"):
            proc.send_signal(signal.SIGINT)  # torch.onnx.export runs now, for seconds
            break
    rest = proc.stdout.read()
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert [s[0].split(":")[0] for s in seen] == ["torch.export", "check exported program"]
    assert re.fullmatch(r"torch\.export: done in [0-9.]+s", seen[0][0])
    assert seen[0][1:] == (False, None)  # the first line came while the command ran, before the ONNX file
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert rest == "" and not onnx.exists()
    assert "\x1b[" not in err and "torchvision" not in err  # no bar on a pipe, no torch log lines


def test_on_a_terminal_a_live_indicator_runs_during_torch_onnx_export(workdir, terminal):
    started = time.perf_counter()
    shown = terminal(["export", "run.iobundle", "--model", "factories:good", "-o", "tty.onnx"], workdir, _env())
    lines = [line.strip() for line in ANSI.sub("", shown).replace("\r", "\n").splitlines() if line.strip()]
    running = [line for line in lines if "torch.onnx.export" in line and "0/1" in line]
    assert running, shown[-2000:]  # the bar, drawn while the step ran
    assert any(frame in running[-1] for frame in "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")  # with its spinner
    assert re.search(r"0:00:\d\d", running[-1])  # and the time elapsed
    assert any(re.fullmatch(r"torch\.onnx\.export: done in [0-9.]+s", line) for line in lines)
    assert lines[-1].startswith("PASS: 2/2 recorded calls reproduced")
    assert (workdir / "tty.onnx").is_file() and time.perf_counter() - started < 120
