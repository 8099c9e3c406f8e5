"""`iobundle validate|run|diff|export --report FILE`: Markdown, HTML (self-contained, checked in a real browser), JSON,
CSV; comparison flags; colour and progress bars only on a terminal."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pandas
import pytest
import torch

from iobundle import InputObserver
from iobundle.cli import main
from iobundle.schema import FORMAT_VERSION

pytest.importorskip("onnxruntime")

FACTORIES = textwrap.dedent(
    """
    import torch

    class Heads(torch.nn.Module):
        def __init__(self, shift=0.0):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 3)
            self.shift = shift

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y * 2 + self.shift, "hidden": y}

    def good():
        return Heads()

    def shifted():
        return Heads(shift=1e-3)
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A bundle of Heads() (3 calls), good.onnx and shifted.onnx (logits off by 1e-3), factories.py."""
    tmp = tmp_path_factory.mktemp("reports")
    (tmp / "factories.py").write_text(FACTORIES)
    sys.path.insert(0, str(tmp))
    try:
        import factories

        model = factories.good().eval()
        observer = InputObserver()
        with torch.no_grad(), observer(model):
            for n in (2, 3, 5):
                model(torch.randn(n, 4))
        observer.save(tmp / "run.iobundle")
        observer.to_onnx(model, tmp / "good.onnx")
        observer.to_onnx(factories.shifted().eval(), tmp / "shifted.onnx", check=False)
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("factories", None)
    return tmp


@pytest.fixture
def cwd(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    yield workdir
    sys.modules.pop("factories", None)


def markdown_html(text: str) -> str:
    """``text`` rendered by a CommonMark parser with GitHub tables and strikethrough (markdown-it-py, which rich uses)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(text)


def validate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["validate", "run.iobundle", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- formats


def test_markdown_report_is_ready_for_an_issue(cwd, capsys):
    code, out, _ = validate(capsys, "shifted.onnx", "--rtol", "0", "--report", "r.md")
    assert code == 1 and "report written to r.md" in out
    text = (cwd / "r.md").read_text("utf-8")
    assert text.startswith("## iobundle validate\\: shifted\\.onnx\n")  # Markdown escapes, rendered as typed
    assert "❌ **FAIL\\: 0/3 calls within atol\\=0\\.0001 rtol\\=0**" in text
    assert "<h2>iobundle validate: shifted.onnx</h2>" in markdown_html(text)
    assert "iobundle validate run.iobundle shifted.onnx --rtol 0 --report r.md" in text  # the command, as run
    assert f"**Bundle.** `run.iobundle` \\(iobundle v{FORMAT_VERSION}\\) holds 3 recorded calls of `" in text
    assert re.search(r"\*\*Environment\.\*\* python [\d.]+, .*torch [\d.]+.*onnxruntime [\d.]+", text)
    calls = text.split("### Calls", 1)[1].split("###", 1)[0]
    assert calls.count("| FAIL\\: mismatch |") == 3 and "| logits |" in calls  # the terminal's wording
    worst = text.split("### Worst outputs", 1)[1].split("###", 1)[0]
    first = [line for line in worst.splitlines() if line.startswith("| ")][1]  # after the header
    assert (
        re.search(r"`logits( \([^)]*\))?`", first) and re.search(r"\| [235]x3 \| float32 \|", first) and "FAIL" in first
    )
    assert "### Absolute error histogram" in text and "| (0.0001, 0.001] |" in text


def test_json_and_csv_hold_the_same_rows_for_pandas(cwd, capsys):
    assert validate(capsys, "shifted.onnx", "--report", "r.json")[0] == 0  # within rtol=0.1
    assert validate(capsys, "shifted.onnx", "--report", "r.csv")[0] == 0
    from_json = pandas.read_json(cwd / "r.json")
    from_csv = pandas.read_csv(cwd / "r.csv")
    assert list(from_json.columns) == list(from_csv.columns)
    assert {"index", "SUCCESS", "status", "abs", "rel", "mean_abs", "quantile_abs", "worst_output"} <= set(
        from_csv.columns
    )
    assert from_json["index"].tolist() == from_csv["index"].tolist() == [0, 1, 2]
    assert from_csv["SUCCESS"].tolist() == [True, True, True] and from_csv["worst_output"].tolist() == ["logits"] * 3
    assert from_json["abs"].tolist() == pytest.approx(from_csv["abs"].tolist())
    assert from_json["quantile_abs"].notna().all()  # a report requests the quantiles (computed on request)
    json.loads((cwd / "r.json").read_text("utf-8"))  # strict JSON: no NaN


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_html_report_is_self_contained_with_charts(cwd, capsys):
    assert validate(capsys, "shifted.onnx", "--rtol", "0", "--atol", "hidden=1e-3", "--report", "r.html")[0] == 1
    text = (cwd / "r.html").read_text("utf-8")
    parser = _Elements()
    parser.feed(text)
    tags = [t for t, _ in parser.tags]
    assert "script" not in tags and "link" not in tags and "img" not in tags and "iframe" not in tags
    assert not any(k in ("src", "href") for _, attrs in parser.tags for k in attrs)
    assert "url(" not in text and "@import" not in text and "http" not in text  # nothing to fetch
    assert tags.count("svg") == 3  # error per call, per output, histogram
    per_call = text.split("<h2>Error per call</h2>", 1)[1].split("</svg>", 1)[0]
    assert per_call.count('class="bar"') == 3 and "atol 0.0001" in per_call
    per_output = text.split("<h2>Error per output</h2>", 1)[1].split("</svg>", 1)[0]
    assert ">logits</text>" in per_output and ">hidden</text>" in per_output
    assert (
        'id="verdict">FAIL: 0/3 calls' in text and "<h2>Environment</h2>" in text and "<h2>Worst outputs</h2>" in text
    )


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_report_renders_in_a_headless_browser(cwd, capsys, tmp_path):
    browser = _browser()
    if browser is None:  # .ci/run installs chromium: CI never skips this test
        message = "needs a headless chromium (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run this test: {message}")
        pytest.skip(message)
    assert validate(capsys, "shifted.onnx", "--rtol", "0", "--report", "r.html")[0] == 1
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    url = (cwd / "r.html").as_uri()
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert dom.count("<svg") == 3 and dom.count('class="bar"') >= 3 + 2
    assert dom.count("<tr") >= 3 + 1  # the calls table was parsed as a table
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1000,1400", url],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a page with content, not a blank one


# --------------------------------------------------------------------------- export --report

EXPORT_REPORTS = ("e.md", "e.html", "e.csv", "e.json")


@pytest.fixture(scope="module")
def exported(workdir):
    """``iobundle export`` of Heads() with one ``--report`` per format (all four written by one run), its stdout."""
    out = workdir / "export"
    out.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(out)
        mp.syspath_prepend(str(workdir))
        argv = ["export", "../run.iobundle", "--model", "factories:good", "-o", "heads.onnx", "--atol", "logits=1e-3"]
        reports = [a for name in EXPORT_REPORTS for a in ("--report", name)]
        import contextlib
        import io

        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = main([*argv, *reports])
        sys.modules.pop("factories", None)
    assert code == 0, stdout.getvalue()
    return out, stdout.getvalue()


def test_export_writes_every_report_it_is_given(exported):
    out, stdout = exported
    for name in EXPORT_REPORTS:
        assert (out / name).is_file() and f"report written to {name}" in stdout
    assert "PASS: 3/3 recorded calls reproduced; written to heads.onnx" in stdout


def test_export_markdown_report_has_the_verdict_and_a_row_per_call(exported):
    out, _ = exported
    text = (out / "e.md").read_text("utf-8")
    rendered = markdown_html(text)
    assert "<h2>iobundle export: heads.onnx</h2>" in rendered
    assert "<strong>PASS: 3/3 recorded calls reproduced; written to heads.onnx</strong>" in rendered
    calls = rendered.split("<h3>Calls</h3>", 1)[1].split("<h3>", 1)[0]
    rows = re.findall(r"<tr>\s*<td[^>]*>(\d+)</td>\s*<td[^>]*>([^<]*)</td>", calls)
    assert rows == [("0", "ok"), ("1", "ok"), ("2", "ok")]
    assert "<th>compared with</th>" in calls and calls.count(">recorded</td>") == 3
    notes = rendered.split("<h3>Notes</h3>", 1)[1].split("<h3>", 1)[0]
    assert "traced call" in notes and "torch.export" in notes
    assert "(logits: atol=0.001)" in text.replace("\\", "")  # the criterion, per-output atol included


class _Table(HTMLParser):
    """The cells of every ``<tr>`` after the ``<h2>`` named ``section``."""

    def __init__(self, section: str) -> None:
        super().__init__()
        self.section, self.inside, self.heading = section, False, False
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h2":
            self.heading, self.inside = True, False
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2":
            self.heading = False
        elif tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.heading:
            self.inside = data == self.section
        elif self.cell is not None:
            self.cell.append(data)


def test_export_html_report_has_the_verdict_and_a_row_per_call(exported):
    out, _ = exported
    text = (out / "e.html").read_text("utf-8")
    assert 'id="verdict">PASS: 3/3 recorded calls reproduced; written to heads.onnx</p>' in text
    assert '<p class="verdict pass"' in text and "<h2>Notes</h2>" in text
    table = _Table("Calls")
    table.feed(text)
    header, *rows = table.rows
    assert header[:2] == ["call", "status"] and "compared with" in header
    assert [(r[0], r[1]) for r in rows] == [("0", "ok"), ("1", "ok"), ("2", "ok")]
    elements = _Elements()
    elements.feed(text)
    assert "script" not in [t for t, _ in elements.tags] and text.count("<svg") == 1  # the error per call


def test_export_csv_report_is_one_row_per_call_for_pandas(exported):
    out, _ = exported
    frame = pandas.read_csv(out / "e.csv")
    assert frame["index"].tolist() == [0, 1, 2]
    assert frame["SUCCESS"].tolist() == [True, True, True] and frame["status"].tolist() == ["ok"] * 3
    assert frame["reference"].tolist() == ["recorded"] * 3
    assert (frame["abs"] <= 1e-4).all() and (frame["duration_program"] > 0).all()


def test_export_json_report_keeps_its_programs_form(exported):
    out, _ = exported
    data = json.loads((out / "e.json").read_text("utf-8"))
    assert data["ok"] is True and data["output"] == "heads.onnx"
    assert [c["index"] for c in data["programs"][0]["checks"]] == [0, 1, 2]


def test_export_refuses_an_unknown_report_extension_before_tracing(cwd, capsys):
    argv = ["export", "run.iobundle", "--model", "factories:good", "-o", "never.onnx", "--report", "e.pdf"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "--report e.pdf: use a .md, .html, .json or .csv file name" in captured.err and captured.out == ""
    assert not (cwd / "never.onnx").exists()


def test_unknown_extension_is_refused_before_the_work(cwd, capsys):
    code, out, err = validate(capsys, "good.onnx", "--report", "r.pdf")
    assert code == 2 and out == ""
    assert "--report r.pdf: use a .md, .html, .json or .csv file name" in err


# --------------------------------------------------------------------------- comparison flags


def test_per_output_atol_on_the_command_line(cwd, capsys):
    code, out, _ = validate(capsys, "shifted.onnx", "--rtol", "0", "--atol", "logits=1e-2", "--atol", "1e-4")
    assert code == 0, out
    assert "PASS: 3/3 calls within atol=0.0001 rtol=0 (logits: atol=0.01)" in out


def test_failing_outputs_are_listed_by_name(cwd, capsys):
    code, out, _ = validate(capsys, "shifted.onnx", "--rtol", "0")
    assert code == 1
    table = out.split("outputs out of tolerance (worst first):", 1)[1]
    assert "logits" in table and "hidden" not in table and "5x3" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--atol", "logits=big"], "--atol logits=big: 'big' is not a number"),
        (["--rtol", "=1"], "--rtol =1: the output name before '=' is empty"),
        (["--atol", "-1"], "a tolerance cannot be negative"),
        (["--atol", "logit=1"], "'logit' matches no output"),
        (["--error-quantile", "2"], "--error-quantile 2: give a quantile between 0 and 1"),
    ],
)
def test_bad_comparison_flags_exit_2(cwd, capsys, argv, message):
    code, _, err = validate(capsys, "good.onnx", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_check_error_stat_on_the_command_line(cwd, capsys):
    code, out, _ = validate(capsys, "shifted.onnx", "--rtol", "0", "--atol", "2e-3", "--check-error-stat", "median")
    assert code == 0 and "on the median error" in out
    assert main(["validate", "run.iobundle", "good.onnx", "--check-error-stat", "p99"]) == 2


# --------------------------------------------------------------------------- terminal


def test_no_colour_when_stdout_is_not_a_terminal(cwd, capsys):
    _, out, err = validate(capsys, "shifted.onnx", "--rtol", "0")
    assert "\x1b[" not in out and "\x1b[" not in err


COLOUR = re.compile(r"\x1b\[[0-9;]*(?:3[0-7]|9[0-7])[0-9;]*m")


@pytest.mark.parametrize("no_color", [False, True])
def test_colour_and_progress_on_a_terminal_unless_no_color(cwd, no_color, terminal):
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update(TERM="xterm-256color", COLUMNS="120", PYTHONPATH=os.pathsep.join(sys.path))
    if no_color:
        env["NO_COLOR"] = "1"
    text = terminal(["validate", "run.iobundle", "shifted.onnx", "--rtol", "0"], cwd, env)
    assert "FAIL: 0/3 calls" in text
    assert bool(COLOUR.search(text)) is not no_color
    assert "validate" in text  # the progress bar's task, drawn on the terminal (stderr)


def test_quiet_prints_only_the_verdict(cwd, terminal):
    env = dict(os.environ, TERM="xterm", PYTHONPATH=os.pathsep.join(sys.path))
    text = terminal(["validate", "-q", "run.iobundle", "shifted.onnx", "--rtol", "0"], cwd, env)
    lines = [line for line in text.replace("\r", "").splitlines() if line.strip()]
    assert len(lines) == 1 and "FAIL: 0/3 calls" in lines[0]


@pytest.mark.parametrize("fmt", ["markdown", "html", "json", "csv"])
def test_calls_that_failed_to_run_render_in_every_format(fmt):
    from iobundle.cli._reports import render_report
    from iobundle.replay import ValidationReport, build_report

    nan = float("nan")
    rows = [
        {"SUCCESS": False, "error": "onnxruntime: bad input", "abs": nan, "rel": nan, "n": 0, "index": 0},
        {"SUCCESS": None, "abs": 0.5, "rel": 0.1, "n": 4, "index": 1, "absent_inputs": "mask"},
    ]
    result = ValidationReport(rows=rows, seconds=0.5, subject="m.onnx")
    text = render_report(build_report(result, []), fmt)
    if fmt == "markdown":
        text = html.unescape(re.sub(r"<[^>]+>", "", markdown_html(text)))
    assert "onnxruntime: bad input" in text
    if fmt == "json":
        assert json.loads(text)[0]["abs"] is None
    if fmt in ("markdown", "html"):
        assert "not checked (absent at capture: mask)" in text and "FAIL: 0/2 calls" in text
