"""The one rule for names that stay inside the bundle (``iobundle.schema.is_member_name``)."""

from __future__ import annotations

import pytest

from iobundle.schema import is_member_name


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
