"""Bundle strings drawn as text: one escaping function per output kind.

Every string a bundle supplies (qualnames, keys and output names, constants, error messages,
the producer's versions and devices, stored model names) is untrusted: a renderer never puts one
into its output as it is, but through the function of its output kind.

- :func:`visible_text`: control characters (C0, DEL, C1), line and paragraph separators and
  bidirectional controls become visible escapes (``\\x1b``, ``\\n``, ``\\u2028``), so a string
  never starts an escape sequence, sets a window title, adds a line or reorders what follows it.
- :func:`terminal_text`: the terminal. :func:`visible_text`; rich never parses markup in it (the
  CLI draws every string as rich ``Text``, markup off).
- :func:`markdown_text` and :func:`markdown_code`: Markdown (CommonMark and GitHub tables): text
  with every character that has a meaning somewhere backslash-escaped (``\\ ` * _ { } [ ] < > ( ) #
  + - . ! | ~ : @ & = $``: no emphasis, link, image, autolink, heading, list, raw HTML, entity,
  math or table cell comes out of it; ``, ; ' " ? % / ^`` mean nothing and stay), or a code span
  (:func:`markdown_code_block`: a fenced block) whose backtick fence is longer than any backtick
  run inside; all on one line.
- :func:`csv_cell`: CSV. A cell a spreadsheet would take as a formula (starting with ``=``, ``+``,
  ``-``, ``@``, a tab or a carriage return) gets a leading ``'``, as OWASP recommends; the csv
  module quotes the rest.
- :func:`html_text`: HTML text and attribute values (``&``, ``<``, ``>``, ``"``, ``'``).

JSON needs none of these: ``json.dumps`` writes every string as data (control characters as ``\\uXXXX``).
"""

from __future__ import annotations

import html
import re
from typing import Any

__all__ = [
    "csv_cell",
    "html_text",
    "markdown_code",
    "markdown_code_block",
    "markdown_text",
    "terminal_text",
    "visible_text",
]

_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_MARKUP = re.compile(r"([\\`*_{}\[\]<>()#+\-.!|~:@&=$])")
_BACKTICKS = re.compile("`+")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible_text(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters, line separators and bidi controls as visible escapes.

    With ``keep_newlines`` a ``\\n`` stays a line break (messages of several lines).
    """
    if keep_newlines:
        return "\n".join(_INVISIBLE.sub(_visible, line) for line in text.split("\n"))
    return _INVISIBLE.sub(_visible, text)


def terminal_text(text: Any, *, keep_newlines: bool = False) -> str:
    """``str(text)`` safe to write to a terminal (see :func:`visible_text`)."""
    return visible_text(str(text), keep_newlines=keep_newlines)


def markdown_text(text: Any) -> str:
    """``str(text)`` as Markdown text that renders as itself: on one line, every character with a meaning escaped."""
    return _MARKUP.sub(r"\\\1", visible_text(str(text)))


def markdown_code(text: Any, *, table: bool = False) -> str:
    """``str(text)`` as a Markdown code span, on one line; ``table=True`` inside a GitHub table cell (``|`` escaped).

    The fence has one backtick more than the longest run of backticks inside; content that starts
    or ends with a backtick or a space is padded with one space on each side (CommonMark strips them).
    """
    body = visible_text(str(text))
    if not body:
        return ""
    if table:
        body = body.replace("|", "\\|")
    fence = "`" * (max((len(m) for m in _BACKTICKS.findall(body)), default=0) + 1)
    if body[0] in "` " or body[-1] in "` ":
        body = f" {body} "
    return f"{fence}{body}{fence}"


def markdown_code_block(text: Any) -> str:
    """``str(text)``, on one line, as a fenced code block whose fence (three backticks or more) no run inside can close."""
    body = visible_text(str(text))
    fence = "`" * max(3, max((len(m) for m in _BACKTICKS.findall(body)), default=0) + 1)
    return f"{fence}\n{body}\n{fence}"


def csv_cell(value: Any) -> Any:
    """``value`` for a CSV cell: a string a spreadsheet would run as a formula gets a leading ``'``; others as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def html_text(value: Any) -> str:
    """``str(value)`` escaped for HTML text and quoted attribute values."""
    return html.escape(str(value), quote=True)
