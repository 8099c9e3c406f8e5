"""A mkdocs hook (``hooks:`` in mkdocs.yml): draw the Sphinx roles and notes of iobundle's docstrings.

The docstrings keep the Sphinx spellings that read well in ``help()`` (``:class:`Bundle```,
``.. versionadded:: 0.2``); mkdocstrings renders them as Markdown, where the role stays as text
before the code span. This hook drops the role and turns the version notes into one sentence.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):(?=<code>)")
VERSION_NOTE = re.compile(r"<p>\.\. version(added|changed):: ([\w.]+)\s*")
NOTE_WORDS = {"added": "New in version", "changed": "Changed in version"}


def render(html: str) -> str:
    """``html`` with roles before code spans removed and version notes written out."""
    html = ROLE.sub("", html)
    return VERSION_NOTE.sub(lambda m: f"<p><em>{NOTE_WORDS[m[1]]} {m[2]}.</em> ", html)


def on_page_content(html: str, **kwargs: Any) -> str:
    return render(html)
