"""One escaper per output kind: what each does to the strings a bundle supplies."""

from __future__ import annotations

import pytest

from iobundle._escape import csv_cell, html_text, markdown_code, markdown_code_block, markdown_text, visible_text


def _render(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(text)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),
        ("a\r\nb\tc", "a\\r\\nb\\tc"),
        ("\x9b2J \x85 \x7f", "\\x9b2J \\x85 \\x7f"),
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        ("\u202eevil", "\\u202eevil"),  # a bidi override no longer reorders what follows
        ("plain é ✓", "plain é ✓"),
    ],
)
def test_visible_text_shows_controls_as_escapes(text, shown):
    assert visible_text(text) == shown
    assert visible_text(shown) == shown  # escaping twice changes nothing


def test_visible_text_can_keep_line_breaks():
    assert visible_text("a\nb\x1b", keep_newlines=True) == "a\nb\\x1b"


@pytest.mark.parametrize(
    "text",
    [
        "<script>alert(1)</script>",
        "<img src=x onerror=alert(1)>",
        "[x](javascript:alert(1))",
        "![i](http://x)",
        "# heading",
        "**bold** _em_ ~~del~~ `code`",
        "1. item",
        "- item",
        "&amp; &#60;",
        "a | b",
        "$x$ :smile: @user",
    ],
)
def test_markdown_text_renders_as_itself(text):
    html = _render(markdown_text(text))
    assert html == f"<p>{html_text(text).replace('&#x27;', chr(39))}</p>\n"


def test_markdown_text_is_one_line():
    assert "\n" not in markdown_text("a\nb\rc\u2028d") and "\r" not in markdown_text("a\rb")


@pytest.mark.parametrize("text", ["a`b", "``x`", "`start", "end`", " spaced ", "a ```` b"])
def test_markdown_code_spans_hold_every_backtick(text):
    html = _render(markdown_code(text))
    assert html == f"<p><code>{html_text(text).replace('&#x27;', chr(39))}</code></p>\n"


def test_markdown_code_in_a_table_keeps_the_cell():
    table = "| a | b |\n|---|---|\n| " + markdown_code("x|y`z", table=True) + " | 2 |\n"
    assert "<td><code>x|y`z</code></td>\n<td>2</td>" in _render(table)


def test_markdown_code_block_fence_outlasts_the_text():
    block = markdown_code_block("a ```` b\nc")
    assert block.startswith("`````\n") and _render(block) == "<pre><code>a ```` b\\nc\n</code></pre>\n"


@pytest.mark.parametrize("cell", ["=cmd|' /C calc'!A0", "+1", "-1+2", "@SUM(1)", "\tx", "\rx"])
def test_csv_cells_a_spreadsheet_would_run_start_with_a_quote(cell):
    assert csv_cell(cell) == "'" + cell


@pytest.mark.parametrize("value", ["logits", "a=b", "", -1.5, 3, None])
def test_csv_leaves_other_cells_and_numbers_alone(value):
    assert csv_cell(value) == value


def test_html_text_escapes_markup_and_quotes():
    assert (
        html_text("<a href=\"x\" onclick='y'>&</a>")
        == "&lt;a href=&quot;x&quot; onclick=&#x27;y&#x27;&gt;&amp;&lt;/a&gt;"
    )
