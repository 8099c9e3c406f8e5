"""The documentation under docs/: it builds in strict mode, stays true to the code, and points nowhere outside."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
DOC_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_doc_packages() -> list[str]:
    missing = []
    for name in DOC_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site `make docs` builds (strict mode), in a temporary folder."""
    missing = _missing_doc_packages()
    if missing and not os.environ.get("CI"):
        pytest.skip(f"{', '.join(missing)} not installed: pip install -c constraints.txt -e '.[docs]'")
    assert not missing, f"CI must build the docs: {missing} not installed (the Makefile installs the docs extra)"
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return site


def test_docs_build_in_strict_mode(site):
    """`make docs` in a temporary site dir: a broken link, a missing page or a bad docstring fails it."""
    for page in ("index.html", "cli/index.html", "design/index.html", "api/replay/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "replay" / "index.html").read_text("utf-8")
    assert "load_bundle" in api and "check_discrepancies" in api  # documented from the docstrings
    assert ":class:" not in api and ".. versionchanged::" not in api  # tools/docs_hooks.py drew them
    assert "results:begin" in (site / "benchmarks" / "index.html").read_text("utf-8")  # BENCHMARKS.md included


def _signature(page: str, anchor: str) -> str:
    """The text of the rendered signature of the object ``anchor`` on ``page`` (tags dropped)."""
    text = page.split(f'id="{anchor}"', 1)[1]
    block = text.split('class="doc-signature', 1)[1].split("</code>", 1)[0]
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", block)))


@pytest.mark.parametrize(
    ("page", "anchor"),
    [
        ("replay", "iobundle.replay.check_discrepancies"),
        ("replay", "iobundle.replay.validate_onnx"),
        ("replay", "iobundle.replay.export_onnx"),
        ("replay", "iobundle.replay.RecordedCallsAPI.check_discrepancies"),
        ("replay", "iobundle.replay.RecordedCallsAPI.to_onnx"),
    ],
)
def test_api_pages_show_the_tolerance_keywords(site, page, anchor):
    """The tolerance keywords are parameters of the functions that take them: the pages show them."""
    text = (site / "api" / page / "index.html").read_text("utf-8")
    signature = _signature(text, anchor)
    for keyword in ("atol: float = 0.0001", "rtol: float = 0.1", "output_atol", "tolerances: Tolerances | None = None"):
        assert keyword in signature, (anchor, signature)
    if anchor == "iobundle.replay.check_discrepancies":
        section = text.split(f'id="{anchor}"', 1)[1].split("doc-signature", 2)[:2][-1]
        assert "The absolute tolerance of every output" in section


def test_cli_reference_is_current():
    """The reference in docs/cli.md is generated from the parsers: run `python tools/cli_reference.py` after changing one."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cli_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip())  # argparse's layout differs between Python versions
    assert proc.returncode == 0, proc.stderr
    assert "### `iobundle validate`" in (DOCS / "cli.md").read_text("utf-8")


def test_exit_code_table_has_every_code_the_help_lists():
    proc = subprocess.run([sys.executable, "-m", "iobundle", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"^exit codes[^\n]*:\n(.*?)(?:\n\n|\Z)", proc.stdout, flags=re.M | re.S)
    assert match, proc.stdout
    in_help = set(re.findall(r"^ {2}(\d+) +", match.group(1), flags=re.M))
    page = (DOCS / "cli.md").read_text("utf-8")
    table = page.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    in_table = set(re.findall(r"^\| (\d+) \|", table, flags=re.M))
    assert in_help and in_help <= in_table, (in_help, in_table)


def _layout_block() -> str:
    text = (DOCS / "design.md").read_text("utf-8")
    return text.split("## Architecture", 1)[1].split("```", 2)[1]


def _documented_layout() -> tuple[set[str], set[str]]:
    """The folders (``replay/infer``) and file names of ``iobundle/`` that design.md's layout names."""
    folders: set[str] = set()
    files: set[str] = set()
    stack: list[tuple[int, str]] = []
    inside = False
    for line in _layout_block().splitlines():
        if line.startswith("iobundle/"):
            inside = True
            continue
        if not inside or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # tests/, benchmarks/, ...: past iobundle/
        names = []
        for token in line.split():
            if not re.fullmatch(r"[\w.]+/?", token) or not (token.endswith("/") or token.endswith(".py")):
                break
            names.append(token)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] + "/" if stack else ""
        for name in names:
            if name.endswith(".py"):
                files.add(parent + name)
            else:
                folders.add(parent + name.rstrip("/"))
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, parent + names[0].rstrip("/")))
    return folders, files


def test_design_layout_names_every_package_and_top_level_module():
    """docs/design.md draws the package: every sub-package and top-level module of iobundle/ is in it."""
    folders, files = _documented_layout()
    assert {"schema", "calls", "capture", "replay", "replay/infer", "observer", "cli"} <= folders
    package = ROOT / "iobundle"
    packages = {p.parent.relative_to(package).as_posix() for p in package.rglob("__init__.py")} - {"."}
    modules = {p.name for p in package.glob("*.py")}
    assert sorted(packages - folders) == []
    assert sorted(modules - files) == []


def _tracked_files() -> list[Path]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if proc.returncode == 0:
        return [ROOT / name for name in proc.stdout.decode().split("\0") if name]
    skip = {".git", ".venv", "site", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_nothing_refers_outside_the_repository():
    """A clone stands alone: no file points at the team's notes beside the repository."""
    outside = [b"../" + b"shared", b"shared/" + b"DESIGN"]  # spelt in two parts so this file does not match itself
    found = [
        str(path.relative_to(ROOT))
        for path in _tracked_files()
        if path.is_file() and any(needle in path.read_bytes() for needle in outside)
    ]
    assert found == []
