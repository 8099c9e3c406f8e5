"""The README's five-minute example runs as written, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def five_minute_snippets() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Five minutes", 1)[1].split("The same from the command line", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


def test_readme_five_minutes_runs(tmp_path):
    pytest.importorskip("onnxruntime")
    code = five_minute_snippets()
    assert "observer.save" in code and "check_discrepancies" in code
    code += '\nprint("RESULT", [r["SUCCESS"] for r in rows], ep.iobundle_report.ok)\n'
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'x': {0: DimHint(DYNAMIC)}, 'mask': {0: DimHint(DYNAMIC)}, 'scale': None}" in proc.stdout
    assert "RESULT [True, True] True" in proc.stdout
    assert (tmp_path / "run.iobundle" / "manifest.json").is_file()


def test_readme_cli_reference_is_current():
    """The reference is generated from the parsers: run `python tools/cli_reference.py` after changing one."""
    tool = README.parent / "tools" / "cli_reference.py"
    proc = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=120)
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip())  # argparse's layout differs between Python versions
    assert proc.returncode == 0, proc.stderr
    assert "### `iobundle validate`" in README.read_text(encoding="utf-8")
