"""Time the manifest parse alone: ``load_manifest`` and ``parse_journal`` of a many-call bundle.

The bundle is figure 8's (``run.py --only 8``): decoder-step calls of a 2-layer cache growing by
one position per call, saved. The same manifest is also written in format version 2 (indented, whole
trees, as iobundle wrote it before version 3) and as a version-3 journal, and each is parsed
``--reps`` times; the result of each parse stays alive until its time is taken.

    .venv/bin/python benchmarks/manifest_parse.py [--calls 1000] [--reps 21]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def record(path: Path, calls: int) -> None:
    import torch

    from iobundle import InputObserver

    class Step(torch.nn.Module):
        def forward(self, input_ids, past, attention_mask, cache_position):
            return {"logits": input_ids.float(), "past": [torch.cat([p, p[:, :, -1:]], dim=2) for p in past]}

    torch.manual_seed(0)
    model, observer = Step(), InputObserver()
    past = [torch.randn(1, 2, 4, 8) for _ in range(4)]
    with observer(model, store_n_calls=calls):
        for i in range(calls):
            past = model(torch.tensor([[i]]), past, torch.ones(1, 4 + i), torch.tensor([4 + i]))["past"]
    observer.save(path)


def journal_of(manifest: Any) -> bytes:
    """The journal a stream of ``manifest``'s calls writes: head, then one line per call."""
    from iobundle.schema import journal_call_line, journal_head_line

    lines = [journal_head_line(manifest.model_copy(update={"calls": [], "tensors": {}, "files": {}}))]
    by_file: dict[str, dict[str, Any]] = {}
    for key, entry in manifest.tensors.items():
        by_file.setdefault(entry.file, {})[key] = entry
    for call in manifest.calls:
        file = f"calls/{call.index:06d}.safetensors"
        lines.append(journal_call_line(call, by_file.get(file, {}), {file: manifest.files[file]}))
    return b"".join(lines)


def median_ms(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - begin)
        del result
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args()

    from iobundle.schema import load_manifest, parse_journal, parse_manifest

    work = Path(tempfile.mkdtemp(prefix="iobundle-parse-"))
    try:
        bundle = work / "many.iobundle"
        record(bundle, args.calls)
        manifest = load_manifest(bundle)
        v3 = (bundle / "manifest.json").read_bytes()
        v2 = manifest.model_copy(update={"format_version": 2}).model_dump_json(indent=1).encode()
        journal = journal_of(manifest)
        assert parse_manifest(v2).calls == manifest.calls and parse_journal(journal) == manifest
        rows = [
            ("load_manifest, format 3 (manifest.json)", lambda: load_manifest(bundle), len(v3)),
            ("parse_manifest, format 2 (the same calls)", lambda: parse_manifest(v2), len(v2)),
            ("parse_journal, format 3 (killed stream)", lambda: parse_journal(journal), len(journal)),
        ]
        print(f"{args.calls} calls, {len(manifest.tensors)} tensors, {len(manifest.files)} files; {args.reps} runs each")
        for label, fn, size in rows:
            med, best = median_ms(fn, args.reps)
            print(f"  {label:44s} {size / 1024:8.0f} KiB  median {med:6.1f} ms  (min {best:.1f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
