"""Bundle strings drawn as text by every renderer: terminal (inspect, diff, validate, errors), Markdown, HTML, CSV, JSON.

The same hostile strings go through every field that carries bundle text (the qualname, input keys,
output names, constants, an error message, the producer, the stored model's names) and each
rendered output is read back: by a CommonMark parser with GitHub tables, by an HTML parser, by
the csv module and the json module, and as the bytes a terminal receives.
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import safetensors.torch
import torch

from iobundle import InputObserver
from iobundle.cli import main

ESCAPES = "\x1b]0;title\x07 \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ \x1b[2J\x1b[H \x9b31m \x85"
BREAKS = "a\rb\nc\u2028d\u2029e"
MARKUP = (
    "| ``x` <script>alert(1)</script> <img src=x onerror=alert(1)> [x](javascript:alert(1)) "
    "![i](http://x) **b** [bold red]m[/bold red]"
)
HOSTILE = f"# heading {ESCAPES} {BREAKS} {MARKUP}"
FORMULA = "=cmd|' /C calc'!A0 " + HOSTILE  # an output name: first column of nothing, a CSV cell
AT_SUM = "@SUM(1) " + HOSTILE
MODEL_CLASS = "# C\x1b]0;t\x07 <img src=x onerror=alert(1)> [bold]m[/bold]"  # under ModelEntry's 200 characters

CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")  # a line break (\n) is the renderer's own
OWN = re.compile(r"\x1b\[(?:[0-9;]*m|\?25[lh]|2K|[0-9]*[AB])|\r")  # what rich draws: colours, progress redraws


class Heads(torch.nn.Module):
    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)
        self.shift = shift

    def forward(self, x, extra=None, mode="plain"):
        y = self.lin(x) + self.shift
        return {FORMULA: y, AT_SUM: y * 2}


def _record(path: Path, shift: float, mode: str) -> Path:
    model, observer = Heads(shift), InputObserver()
    with torch.no_grad(), observer(model):
        for n in (2, 3):
            model(torch.randn(n, 4), extra={HOSTILE: torch.ones(1)}, mode=mode)
    observer.save(path)
    return path


def _edit(path: Path, **fields: object) -> None:
    manifest = path / "manifest.json"
    raw = json.loads(manifest.read_text("utf-8"))
    for name, value in fields.items():
        if name == "failed_call":
            raw["calls"][1].update(status="failed", error=value)
        else:
            head, key = name.split("__")
            raw[head][key] = value
    manifest.write_text(json.dumps(raw), "utf-8")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    """``a`` and ``b`` (outputs apart, constants differ), ``c`` (a with a failed call and a stored model), ``d`` (c
    with a class transformers registers, so that its config is read)."""
    tmp = tmp_path_factory.mktemp("hostile_text")
    _record(tmp / "a", 0.0, "mode " + HOSTILE)
    _record(tmp / "b", 0.5, "other")
    _edit(tmp / "a", producer__torch=HOSTILE, producer__devices=[HOSTILE], signature__qualname=HOSTILE)
    shutil.copytree(tmp / "a", tmp / "c")
    config = json.dumps({"model_type": HOSTILE, "architectures": [HOSTILE]}).encode()
    (tmp / "c" / "model").mkdir()
    (tmp / "c" / "model" / "config.json").write_bytes(config)
    weights = safetensors.torch.save({"w": torch.zeros(1)})  # listed files are checked by inspect: a real one
    (tmp / "c" / "model" / "weights.safetensors").write_bytes(weights)
    files = {
        "model/config.json": {"size": len(config), "sha256": hashlib.sha256(config).hexdigest()},
        "model/weights.safetensors": {"size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()},
    }
    _edit(tmp / "c", failed_call="ValueError: " + HOSTILE)
    raw = json.loads((tmp / "c" / "manifest.json").read_text("utf-8"))
    raw["model"] = {"class_name": MODEL_CLASS, "attn_implementation": HOSTILE, "files": files}
    (tmp / "c" / "manifest.json").write_text(json.dumps(raw), "utf-8")
    shutil.copytree(tmp / "c", tmp / "d")  # a class transformers has: its config's strings are read
    raw["model"].update(class_name="LlamaForCausalLM", attn_implementation=None)
    (tmp / "d" / "manifest.json").write_text(json.dumps(raw), "utf-8")
    return tmp


@pytest.fixture
def cwd(bundles, monkeypatch):
    monkeypatch.chdir(bundles)
    monkeypatch.setenv("NO_COLOR", "1")
    return bundles


# --------------------------------------------------------------------------- checks per output kind


def check_terminal(text: str) -> None:
    """No control character reaches the terminal but line breaks and rich's own colours; markup shows as typed."""
    text = OWN.sub("", text)
    assert not CONTROL.search(text), repr(CONTROL.search(text))
    assert "\\x1b]0;title\\x07" in text or "\\x1b]0;t\\x07" in text  # shown, as a visible escape
    assert "[bold" in text  # rich markup drawn as text


def markdown_html(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(text)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.rows: list[int] = []  # cells per table row
        self.code: list[str] = []
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag == "tr":
            self.rows.append(0)
        elif tag in ("td", "th") and self.rows:
            self.rows[-1] += 1
        elif tag == "code":
            self._in_code = True
            self.code.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "code":
            self._in_code = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._in_code:
            self.code[-1] += data


def _parsed(text: str) -> _Tags:
    parser = _Tags()
    parser.feed(text)
    return parser


def check_no_active_html(parsed: _Tags) -> None:
    names = {tag for tag, _ in parsed.tags}
    assert not names & {"script", "img", "a", "iframe", "h1", "h4", "h5", "h6", "em", "del", "ol"}
    assert not [k for _, attrs in parsed.tags for k in attrs if k.startswith("on") or k in ("href", "src")]


def check_markdown(text: str) -> None:
    assert not CONTROL.search(text)
    parsed = _parsed(markdown_html(text))
    check_no_active_html(parsed)
    headings = re.findall(r"<h([1-6])>(.*?)</h\1>", markdown_html(text))
    assert all(
        t.startswith(("iobundle ", "Calls", "Worst outputs", "Absolute error", "Differences")) for _, t in headings
    )
    shown = "".join(parsed.text)
    for piece in ("<script>alert(1)</script>", "[x](javascript:alert(1))", "![i](http://x)", "**b**", "# heading"):
        assert piece in shown
    assert "\\x1b]0;title\\x07" in shown


def check_tables_keep_their_columns(text: str) -> None:
    """Each Markdown table: every row has the header's number of cells."""
    html_text = markdown_html(text)
    for table in re.findall(r"<table>.*?</table>", html_text, flags=re.S):
        counts = [len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr>.*?</tr>", table, flags=re.S)]
        assert len(set(counts)) == 1, counts


def check_html(text: str) -> None:
    parsed = _parsed(text)
    names = {tag for tag, _ in parsed.tags}
    assert not names & {"script", "img", "a", "iframe"}
    assert not [k for _, attrs in parsed.tags for k in attrs if k.startswith("on") or k in ("href", "src")]
    shown = html.unescape("".join(parsed.text))
    assert "<script>alert(1)</script>" in shown and "<img src=x onerror=alert(1)>" in shown


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def check_csv(text: str) -> list[list[str]]:
    rows = list(csv.reader(io.StringIO(text)))
    cells = [c for row in rows for c in row if not _number(c)]
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    return rows


# --------------------------------------------------------------------------- terminal


def test_inspect_draws_every_bundle_string_as_text(cwd, capsys):
    assert main(["inspect", "c"]) == 0
    out = capsys.readouterr().out
    check_terminal(out)
    assert "\\x1b]8;;http://x" in out  # the OSC 8 link, shown
    assert (
        "model      # C\\x1b]0;t\\x07 <img src=x onerror=alert(1)> [bold]m[/bold] (model_type ?, attention # heading"
        in out
    )
    assert "call 1 failed: ValueError: # heading \\x1b]0;title\\x07" in out  # its error message
    for line in out.splitlines():  # the qualname's line break stayed in its line
        assert not line.startswith("# heading")
    assert main(["inspect", "d"]) == 0
    out = capsys.readouterr().out
    check_terminal(out)
    assert "(model_type # heading \\x1b]0;title\\x07" in out  # a string of the stored config


def test_diff_and_validate_on_the_terminal_draw_bundle_strings_as_text(cwd, capsys):
    assert main(["diff", "a", "b"]) == 1
    captured = capsys.readouterr()
    check_terminal(captured.out)
    assert "[bold red]m[/bold red]" in captured.out
    from iobundle import load_bundle
    from iobundle.cli._render import format_validation

    check_terminal(format_validation(_validation(load_bundle("a"))))


def test_errors_draw_names_as_text(cwd, capsys):
    assert main(["inspect", "missing \x1b]0;t\x07 \x9b2J"]) == 2
    err = capsys.readouterr().err
    assert not CONTROL.search(err) and "\\x1b]0;t\\x07" in err and "\\x9b2J" in err


def test_log_records_draw_names_as_text(cwd, capsys):
    import logging

    from iobundle.cli._render import PlainLogFormatter

    record = logging.LogRecord("iobundle.replay", logging.WARNING, __file__, 1, "key %s", (HOSTILE,), None)
    text = PlainLogFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert not CONTROL.search(text) and "\\x1b]0;title\\x07" in text and "\\n" in text


@pytest.mark.parametrize("no_color", [False, True])
def test_a_real_terminal_receives_no_escape_sequence_from_the_bundle(bundles, terminal, no_color):
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update(TERM="xterm-256color", COLUMNS="200", PYTHONPATH=os.pathsep.join(sys.path))
    if no_color:
        env["NO_COLOR"] = "1"
    check_terminal(terminal(["inspect", "c"], bundles, env))
    check_terminal(terminal(["diff", "a", "b"], bundles, env))


# --------------------------------------------------------------------------- report files


def _validation(bundle):
    from iobundle.replay import ValidationReport

    rows = [
        {"SUCCESS": False, "error": FORMULA, "abs": 1.0, "rel": 1.0, "n": 4, "index": 0, "worst_output": AT_SUM},
        {"SUCCESS": None, "abs": 0.5, "rel": 0.1, "n": 4, "index": 1, "absent_inputs": HOSTILE},
    ]
    return ValidationReport(rows=rows, seconds=0.5, subject=HOSTILE)


def test_markdown_reports_draw_bundle_strings_as_text(cwd, capsys):
    from iobundle import load_bundle
    from iobundle.cli._reports import render_report
    from iobundle.replay import build_report

    assert main(["diff", "a", "b", "--report", "r.md"]) == 1
    diff = (cwd / "r.md").read_text("utf-8")
    check_markdown(diff)
    check_tables_keep_their_columns(diff)
    code = _parsed(markdown_html(diff)).code
    assert FORMULA.replace("\x1b", "\\x1b").split(" ")[0] in " ".join(code)  # the name in a code span
    assert any("``x`" in c for c in code)  # a fence longer than the name's backtick run
    validate = render_report(build_report(_validation(load_bundle("a")), [load_bundle("a")]), "markdown")
    check_markdown(validate)
    check_tables_keep_their_columns(validate)


def test_html_reports_draw_bundle_strings_as_text(cwd, capsys):
    from iobundle import load_bundle
    from iobundle.cli._reports import render_report
    from iobundle.replay import build_report

    assert main(["diff", "a", "b", "--report", "r.html"]) == 1
    check_html((cwd / "r.html").read_text("utf-8"))
    check_html(render_report(build_report(_validation(load_bundle("a")), [load_bundle("a")]), "html"))


def test_csv_reports_neutralise_formulas(cwd, capsys):
    from iobundle import load_bundle
    from iobundle.cli._reports import render_report
    from iobundle.replay import build_report

    assert main(["diff", "a", "b", "--report", "r.csv"]) == 1
    rows = check_csv((cwd / "r.csv").read_bytes().decode("utf-8"))
    column = rows[0].index("worst_output")
    assert {r[column] for r in rows[1:]} <= {"'" + FORMULA, "'" + AT_SUM}
    rows = check_csv(render_report(build_report(_validation(load_bundle("a")), [load_bundle("a")]), "csv"))
    assert rows[1][rows[0].index("error")] == "'" + FORMULA


def test_json_reports_keep_bundle_strings_as_data(cwd, capsys):
    assert main(["diff", "a", "b", "--report", "r.json"]) == 1
    text = (cwd / "r.json").read_text("utf-8")
    assert not CONTROL.search(text.replace("\n", ""))
    assert {r["worst_output"] for r in json.loads(text)} <= {FORMULA, AT_SUM}  # exactly as recorded


class Keywords(torch.nn.Module):
    def forward(self, x, **kwargs):
        return x * 2


def test_keyword_groups_draw_keyword_names_as_text(tmp_path, capsys, monkeypatch):
    """Calls passing different keyword names: inspect and shapes name each group's keywords as text, JSON as data."""
    monkeypatch.setenv("NO_COLOR", "1")
    model, observer = Keywords(), InputObserver()
    with observer(model):
        model(torch.ones(2, 3), **{HOSTILE: torch.ones(2)})
        for n in (4, 5):
            model(torch.ones(2, n), **{"state " + ESCAPES: torch.ones(2)})
    observer.save(tmp_path / "g")
    for argv in (["inspect", str(tmp_path / "g")], ["shapes", str(tmp_path / "g")]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        check_terminal(out)
        assert "# call 0: passes # heading \\x1b]0;title\\x07" in out
        assert "# calls 1-2: pass state \\x1b]0;title\\x07" in out
    assert main(["shapes", str(tmp_path / "g"), "--json"]) == 0
    text = capsys.readouterr().out
    assert not CONTROL.search(text.replace("\n", ""))
    groups = json.loads(text)["$groups"]
    assert [g["keywords"] for g in groups] == [[HOSTILE], ["state " + ESCAPES]]  # exactly as recorded
