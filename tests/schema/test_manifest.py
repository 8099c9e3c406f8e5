"""The manifest format: the shipped JSON Schema is current, manifests round-trip, and schema needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import iobundle.schema
from iobundle.errors import ManifestError
from iobundle.schema import FORMAT, FORMAT_VERSION, Manifest, dump_manifest, parse_manifest

GOLDEN = Path(__file__).parents[1] / "data" / "bundles"
SCHEMA_FILE = Path(iobundle.schema.__file__).with_name("manifest.schema.json")


def golden_manifests() -> list[Path]:
    return sorted(GOLDEN.glob("*/manifest.json"))


def test_shipped_schema_is_current():
    """tools/manifest_schema.py writes the schema from the pydantic models (``make schema``); the shipped one is its output."""
    tool = Path(__file__).parents[2] / "tools" / "manifest_schema.py"
    proc = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_schema_describes_every_format_version():
    """One schema, two layouts: versions 1 and 2 (whole trees), versions 3 to 6 (compact)."""
    schema = json.loads(SCHEMA_FILE.read_text("utf-8"))
    layouts = [schema["$defs"][ref["$ref"].rsplit("/", 1)[1]] for ref in schema["anyOf"]]
    versions = [layout["properties"]["format_version"] for layout in layouts]
    assert [v.get("enum", [v.get("const")]) for v in versions] == [[1, 2], [3, 4, 5, 6]]
    old, compact = layouts
    for layout in layouts:
        assert layout["type"] == "object" and layout["additionalProperties"] is False
    assert {"format", "format_version", "calls", "tensors", "files"} <= set(old["properties"])
    assert {"format", "format_version", "structures", "calls", "files", "hash"} <= set(compact["properties"])
    assert "tensors" not in compact["properties"]  # listed per file
    assert str(FORMAT_VERSION) in schema["title"] and "1, 2, 3, 4, 5, 6" in schema["title"]


@pytest.fixture(scope="module")
def written_manifest(tmp_path_factory) -> str:
    torch = pytest.importorskip("torch")
    from iobundle import InputObserver

    class Model(torch.nn.Module):
        def forward(self, x, cache=None, *, flag: bool = False):
            return {"y": x * 2, "n": None}

    model, observer = Model(), InputObserver(value_if_missing={"cache": [torch.zeros(1, 0)]})
    with observer(model):
        model(torch.randn(2, 3), flag=True)
        model(torch.randn(4, 3), cache=[torch.ones(1, 2)], flag=True)
    path = tmp_path_factory.mktemp("m") / "b"
    observer.save(path)
    return (path / "manifest.json").read_text("utf-8")


def test_written_manifest_round_trips(written_manifest):
    manifest = parse_manifest(written_manifest)
    assert manifest.format == FORMAT and manifest.format_version == FORMAT_VERSION
    assert dump_manifest(manifest) == written_manifest  # what we write is what we would write again
    assert parse_manifest(dump_manifest(manifest)) == manifest
    assert Manifest.model_validate(manifest.model_dump(mode="json")) == manifest


def same_content(a: Manifest, b: Manifest) -> bool:
    """Equal but for the format version and how a file's hash is spelled (version 1: ``sha256``)."""

    def files(m: Manifest) -> dict[str, tuple[int, str, str]]:
        return {n: (f.size, f.algorithm, f.hexdigest) for n, f in m.files.items()}

    rest = {"format_version": 0, "files": {}}
    return files(a) == files(b) and a.model_copy(update=rest) == b.model_copy(update=rest)


@pytest.mark.parametrize("path", golden_manifests(), ids=lambda p: p.parent.name)
def test_golden_manifest_round_trips(path):
    """Every version read is written as version 6 (5 when its segments have no header region: versions 4 and 5),
    which reads back the same, and writes the same text again."""
    text = path.read_text("utf-8")
    manifest = parse_manifest(text)
    again = parse_manifest(dump_manifest(manifest))
    headerless = any(f.ranges and f.ranges[0][1] == 0 for f in manifest.files.values())
    assert again.format_version == (5 if headerless else FORMAT_VERSION) and FORMAT_VERSION == 6
    assert same_content(again, manifest)
    assert dump_manifest(again) == dump_manifest(manifest)
    # Not byte-equal to the file itself for versions 1 to 3: they are written as version 4.


def test_round_trip_keeps_non_finite_floats():
    manifest = {
        "format": "iobundle",
        "format_version": 1,
        "producer": {"iobundle": "0", "torch": "0", "python": "3"},
        "signature": {"method": "forward", "parameters": [{"name": "x", "kind": "POSITIONAL_OR_KEYWORD"}]},
        "calls": [
            {"index": 0, "args": [{"kind": "const", "value": float("nan")}], "kwargs": {}, "latency": float("inf")}
        ],
        "tensors": {},
        "files": {},
    }
    parsed = parse_manifest(json.dumps(manifest))
    again = parse_manifest(dump_manifest(parsed))
    assert again.calls[0].latency == float("inf")
    assert again.calls[0].args[0].value != again.calls[0].args[0].value  # NaN


def test_parse_errors_are_manifest_errors():
    with pytest.raises(ManifestError, match=r"custom\.json: not valid JSON"):
        parse_manifest(b"{", source="custom.json")


def test_schema_package_does_not_need_torch(written_manifest, tmp_path):
    """Import the schema and validate a real manifest in a process where torch cannot be imported."""
    (tmp_path / "manifest.json").write_text(written_manifest, "utf-8")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import iobundle.schema as schema
        from iobundle.schema import load_manifest
        manifest = load_manifest({str(tmp_path)!r})
        assert manifest.calls, manifest
        assert "torch" not in [name for name, module in sys.modules.items() if module is not None]
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
