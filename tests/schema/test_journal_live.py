"""A live stream's journal is read as long as it was when opened: a writer appending meanwhile is no corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from iobundle._store import LocalStore
from iobundle.errors import ManifestError
from iobundle.schema._io import read_member


@pytest.fixture
def growing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A journal to which a line is appended between its open (its size taken) and its read."""
    journal = tmp_path / "journal.jsonl"
    journal.write_bytes(b'{"a": 1}\n')
    real_open = LocalStore.open

    def open_then_append(self: LocalStore, name: str, *args: Any, **kwargs: Any) -> Any:
        opened = real_open(self, name, *args, **kwargs)
        with open(journal, "ab") as f:
            f.write(b'{"b": 2}\n')
        return opened

    monkeypatch.setattr(LocalStore, "open", open_then_append)
    return journal


def test_a_journal_that_grows_while_read_gives_the_bytes_it_had(growing: Path) -> None:
    assert read_member(growing.parent, growing, appended=True) == b'{"a": 1}\n'


def test_a_manifest_that_grows_while_read_is_refused(growing: Path) -> None:
    with pytest.raises(ManifestError, match="it was changed"):
        read_member(growing.parent, growing)
