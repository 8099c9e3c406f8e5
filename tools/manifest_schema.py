"""Generate ``iobundle/schema/manifest.schema.json``, the JSON Schema of ``manifest.json``, from the pydantic models.

    python tools/manifest_schema.py           # rewrite the shipped file (``make schema``)
    python tools/manifest_schema.py --check   # exit 1 when the shipped file is stale

One schema, two layouts: ``Manifest`` for format versions 1 and 2, ``CompactManifest`` for 3 to 6.
``tests/schema/test_manifest.py`` fails when the shipped file is stale: run this script after changing a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Union

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "iobundle" / "schema" / "manifest.schema.json"


def manifest_json_schema() -> str:
    """The JSON Schema of ``manifest.json``, as shipped."""
    sys.path.insert(0, str(ROOT))
    from pydantic import TypeAdapter

    from iobundle.schema import SUPPORTED_FORMAT_VERSIONS, CompactManifest, Manifest

    schema = TypeAdapter(Union[Manifest, CompactManifest]).json_schema()
    defs = schema["$defs"]
    # in memory a Manifest holds any version; as a file, its layout is that of versions 1 and 2 only
    defs["Manifest"]["properties"]["format_version"]["enum"] = [1, 2]
    defs["Manifest"]["properties"]["format_version"]["default"] = 2
    schema["title"] = "iobundle manifest, format_version " + ", ".join(map(str, SUPPORTED_FORMAT_VERSIONS))
    schema["description"] = (
        "Format versions 1 and 2: the Manifest layout (whole call trees, one entry per tensor and per file). "
        "Format versions 3 to 6: the CompactManifest layout (call structures stored once, a tensor table per file; "
        "version 4 adds segment files, whose ranges hold many calls' small tensors; version 5 adds each call's "
        "torch.autocast state, CallRecord.autocast; in version 6 a segment is a safetensors file, its ranges "
        "starting past its header region)."
    )
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = manifest_json_schema()
    if "--check" in argv:
        if SCHEMA_FILE.read_text("utf-8") != text:
            print(f"{SCHEMA_FILE} is stale: run `python tools/manifest_schema.py`.", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
