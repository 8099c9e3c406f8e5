"""pyproject.toml: the metadata setuptools reads without deprecation warnings, and pins for every dependency."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).parents[1]


def test_license_is_an_spdx_string_with_its_file() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    assert project["license"] == "MIT"  # a table ({text = ...}) is deprecated by setuptools >= 77
    assert all((ROOT / name).is_file() for name in project["license-files"])


def test_every_dependency_is_pinned_in_constraints() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    pinned = {
        line.split("==")[0].lower()
        for line in (ROOT / "constraints.txt").read_text("utf-8").splitlines()
        if "==" in line
    }
    names = [re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert [n for n in names if n not in pinned] == []
