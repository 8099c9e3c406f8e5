"""The README, the front page: its five-minute example runs as written, and its links lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


def five_minute_snippets(path: Path = README) -> str:
    text = path.read_text(encoding="utf-8")
    section = text.split("## Five minutes", 1)[1].split("The same from the command line", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


def test_readme_five_minutes_runs(tmp_path):
    pytest.importorskip("onnxruntime")
    code = five_minute_snippets()
    assert "observer.save" in code and "check_discrepancies" in code
    code += '\nprint("RESULT", [r["SUCCESS"] for r in rows], exported.report.ok)\n'
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'x': {0: DimHint(DYNAMIC)}, 'mask': {0: DimHint(DYNAMIC)}, 'scale': None}" in proc.stdout
    assert "RESULT [True, True] True" in proc.stdout
    assert (tmp_path / "run.iobundle" / "manifest.json").is_file()


def test_docs_home_page_shows_the_same_five_minutes():
    """docs/index.md repeats the README's example for the site: the one the test above runs."""
    assert five_minute_snippets(ROOT / "docs" / "index.md") == five_minute_snippets()


def _anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as mkdocs (and GitHub) spell them."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in headings}


def test_readme_links_lead_to_files_and_headings_of_the_repository():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(#[^)]*)?\)", text)
    local = [(path, anchor[1:]) for path, anchor in links if "://" not in path]
    assert ("docs/cli.md", "") in local and "docs/design.md" in {path for path, _ in local}
    assert [path for path, _ in local if not (ROOT / path).is_file()] == []
    assert [(p, a) for p, a in local if a and a not in _anchors(ROOT / p)] == []


def test_readme_names_the_extra_that_brings_transformers():
    """--from-bundle and demo --llama need transformers, which a bare install lacks."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["optional-dependencies"]
    text = README.read_text(encoding="utf-8")
    for extra in ("transformers", "remote", "s3", "docs"):
        assert extra in extras, extra
        assert f"| `{extra}` |" in text, extra
    assert any(d.startswith("transformers") for d in extras["transformers"])
    assert "pip install -e '.[transformers]'" in text
