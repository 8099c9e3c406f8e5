"""The one rule for names that stay inside the bundle (``iobundle.schema.is_member_name``)."""

from __future__ import annotations

import pytest

from iobundle.schema import call_file_name, is_member_name, is_writer_file, temporary_name


@pytest.mark.parametrize("name", ["manifest.json", "calls/000000.safetensors", "model/config.json", "a..b/c"])
def test_a_plain_relative_name_stays_inside(name):
    assert is_member_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/etc/passwd",
        "../outside",
        "calls/../../outside",
        "calls\\000000.safetensors",
        "C:calls",
        "./calls/000000.safetensors",
        "calls//000000.safetensors",
        "calls/.",
        "calls/",
        "calls/\x1b[2J.safetensors",
        "calls/a\nb",
        "calls/\x7f",
        "calls/\x85",
        "calls/\ud800",
        None,
        3,
    ],
)
def test_a_name_that_leaves_the_bundle_or_holds_a_control_character_is_refused(name):
    assert not is_member_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "manifest.json",
        "journal.jsonl",
        ".manifest.json.tmp",
        ".journal.jsonl.tmp",
        "calls/value_if_missing.safetensors",
        "calls/.value_if_missing.safetensors.tmp",
        "calls/000000.safetensors",
        "calls/1234567.safetensors",
        "calls/.000003.safetensors.tmp",
        "calls/segment-000001.bin",
    ],
)
def test_the_names_writers_give_are_writer_files(name):
    assert is_writer_file(name)


@pytest.mark.parametrize(
    "name",
    [
        "notes.txt",
        "calls/notes.txt",
        "calls/0.safetensors",
        "calls/0000000.safetensors",  # seven digits with a leading zero: no writer gives it
        "calls/000000.safetensors.bak",
        "calls/my-000000.safetensors",
        "calls/.000003.safetensors.tmp.old",
        "calls/.segment-000001.bin.tmp",  # segments are appended in place, never renamed
        "calls/segment-1.bin",
        "000000.safetensors",  # beside calls/, not in it
        ".000000.safetensors.tmp",
        "model/config.json",  # the manifest lists it; no writer leaves it unlisted
        "other/manifest.json",
        "calls/sub/000000.safetensors",
        "calls/manifest.json",
    ],
)
def test_other_names_are_not_writer_files(name):
    assert not is_writer_file(name)


def test_a_temporary_name_is_a_dot_name_in_the_same_folder():
    assert temporary_name("calls/000004.safetensors") == "calls/.000004.safetensors.tmp"
    assert temporary_name("manifest.json") == ".manifest.json.tmp"
    assert is_writer_file(temporary_name(call_file_name(12)))
