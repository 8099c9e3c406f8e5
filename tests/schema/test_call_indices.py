"""A manifest's call numbers are unique, in every format version and in journals: a repeated one is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from iobundle.errors import ManifestError
from iobundle.schema import parse_journal, parse_manifest

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"
MATCH = r"calls\[1\]\.index: 0 is also the index of calls\[0\]"


@pytest.mark.parametrize(("name", "version"), [("plain", 1), ("growing", 2), ("compact_nested", 3)])
def test_a_repeated_call_index_is_refused_naming_the_field(name, version):
    raw = json.loads((GOLDEN / name / "manifest.json").read_text("utf-8"))
    assert raw["format_version"] == version
    raw["calls"][1]["index"] = raw["calls"][0]["index"]
    with pytest.raises(ManifestError, match=MATCH):
        parse_manifest(json.dumps(raw), source="manifest.json")


@pytest.mark.parametrize(("name", "version"), [("journal", 2), ("compact_journal", 3)])
def test_a_journal_repeating_a_call_index_is_refused(name, version):
    lines = (GOLDEN / name / "journal.jsonl").read_bytes().splitlines(keepends=True)
    assert json.loads(lines[0])["format_version"] == version
    second = json.loads(lines[2])
    second["call"]["index"] = json.loads(lines[1])["call"]["index"]
    lines[2] = json.dumps(second).encode() + b"\n"
    with pytest.raises(ManifestError, match=r"journal\.jsonl: " + MATCH):
        parse_journal(b"".join(lines), source="journal.jsonl")


def test_loading_and_converting_a_bundle_with_a_repeated_index_exits_as_damaged(tmp_path, capsys):
    pytest.importorskip("onnx")
    from iobundle.cli import main

    bundle = tmp_path / "dup.iobundle"
    shutil.copytree(GOLDEN / "plain", bundle)
    raw = json.loads((bundle / "manifest.json").read_text("utf-8"))
    raw["calls"][1]["index"] = 0
    (bundle / "manifest.json").write_text(json.dumps(raw))
    assert main(["convert", str(bundle), "--to", "npz", str(tmp_path / "out.npz")]) == 5  # a damaged bundle
    assert "calls[1].index" in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()
