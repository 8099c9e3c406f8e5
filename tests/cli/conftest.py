"""Shared by the CLI tests: a module of model factories for ``--model``, and running ``iobundle`` on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for the plain helper module tiny_models.py beside the tests

FACTORIES = textwrap.dedent(
    """
    import torch

    class Scale(torch.nn.Module):
        def __init__(self, offset=0.0):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 2)
            self.offset = offset

        def forward(self, x):
            return self.lin(x) + self.offset

    def good():
        return Scale()

    def drifted():
        return Scale(offset=0.5)

    def not_a_model():
        return 42
    """
)


@pytest.fixture(scope="session")
def factories_source() -> str:
    """The text of ``factories.py``, for module-scoped fixtures that write it themselves."""
    return FACTORIES


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``factories.py`` in ``tmp_path`` (the CLI runs from there), imported: ``good``, ``drifted``, ``not_a_model``."""
    (tmp_path / "factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import factories as module

    yield module
    sys.modules.pop("factories", None)  # the CLI imports it again (--model factories:...): no stale module for others


RunInTerminal = Callable[[list[str], Path, dict[str, str]], str]


def run_in_terminal(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run ``iobundle ARGV`` with stdout and stderr on a pseudo-terminal; return what it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iobundle", *argv], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
        cwd=cwd, env=env,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture
def terminal() -> RunInTerminal:
    """:func:`run_in_terminal`, for tests that check what a terminal shows (colour, progress bars)."""
    return run_in_terminal


@pytest.fixture(scope="module")
def model_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-NeoX observed on one forward call, saved with its model (include_model=True)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from iobundle import InputObserver

    config = transformers.GPTNeoXConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=64, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    observer = InputObserver()
    with torch.no_grad(), observer(model):
        model(torch.tensor([[3, 4, 5]]))
    path = tmp_path_factory.mktemp("bundles") / "neox.iobundle"
    observer.save(path, include_model=True)
    return path
