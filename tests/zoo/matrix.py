"""Run the model zoo and write its support matrix into docs/llm.md (``make zoo``).

Usage::

    python tests/zoo/matrix.py                  # every family; docs/llm.md between the zoo markers
    python tests/zoo/matrix.py llama gemma2     # some families; docs/llm.md untouched
    python tests/zoo/matrix.py --json out.json  # also every result as JSON
    python tests/zoo/matrix.py --from-results DIR   # measure nothing: the matrix of a test run
                                                    # (IOBUNDLE_ZOO_RESULTS=DIR make test); docs/llm.md updated

The matrix has one row per bundle: where the model's code comes from (transformers, diffusers, plain
torch), the classes of model behaviour of issue 28 it exercises (``families.CLASSES``), the dtype the model ran in, the cache class and layer kinds
the bundle holds (read from its manifest), calls recorded, programs exported, patches applied (and
the remedies that served the check beyond the recorded calls, marked ``(remedy)``), the
torch.export and torch.onnx.export seconds, and the largest error over every recorded call
in ``ep.module()`` and in onnxruntime. A family that fails says so, with the first reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from behaviours import ZOO
from families import Family, family
from harness import FamilyResult, run_families

PAGE = Path(__file__).resolve().parents[2] / "docs" / "llm.md"
START, END = "<!-- zoo:start -->", "<!-- zoo:end -->"


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_matrix(
    entries: list[Family], results: dict[str, FamilyResult], seconds: float | None, cpu_seconds: float | None = None
) -> str:
    """The support matrix as a Markdown table, with how it was measured."""
    import torch
    import transformers

    lines = [
        "| family | source | classes | dtype | cache | result | calls | programs | patches | export s (torch / onnx) "
        "| max abs ep / ort | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        result = results[entry.name]
        failures = result.failures(entry.atol)
        status = "pass" if not failures else ("known failure" if entry.known_failure else "FAIL")
        note = entry.notes if not failures else f"{entry.notes}; {entry.known_failure or failures[0]}"
        note = note.replace("|", "\\|").replace("\n", " ")
        kind = f"{entry.source} | {entry.class_names} | {entry.precision}"
        if not result.bundles:
            lines.append(f"| {entry.name} | {kind} | - | {status} | - | - | - | - | - | {note} |")
        for b in result.bundles:
            name = entry.name if b.name == entry.name else f"{entry.name} ({b.name})"
            lines.append(
                f"| {name} | {kind} | {b.cache} | {status} | {b.calls} | {b.programs} | "
                f"{', '.join([*b.patches, *(f'{r} (remedy)' for r in b.remedies)]) or '-'} | "
                f"{b.export_seconds:.1f} / {b.onnx_seconds:.1f} | {_error(b.ep_max_abs)} / {_error(b.ort_max_abs)} | "
                f"{note} |"
            )
    passed = sum(1 for e in entries if not results[e.name].failures(e.atol))
    lines.append("")
    if seconds is None:  # rendered from the results a test run wrote
        timing = "from the results of a `make test` run"
    else:
        cpu = f" and {cpu_seconds:.0f}s CPU" if cpu_seconds is not None else ""
        timing = f"{seconds:.0f}s wall{cpu} for the whole zoo"
    lines.append(
        f"{passed}/{len(entries)} families pass (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPU cores, {timing}; `make zoo` to measure again)."
    )
    return "\n".join(lines)


def _cpu_seconds() -> float:
    """CPU time of this process and of the replays it waited for (the wall time depends on the machine's load)."""
    import resource

    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def write_page(table: str, page: Path = PAGE) -> None:
    """Replace the text between the zoo markers of ``page`` with ``table``."""
    text = page.read_text("utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{page}: no {START} ... {END} markers to write the matrix between")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{table}\n{END}{tail}", "utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="family names (default: all, and docs/llm.md is updated)")
    parser.add_argument("--json", help="write every result to this JSON file")
    parser.add_argument("--jobs", type=int, default=2, help="replays run side by side (default: %(default)s)")
    parser.add_argument("--keep", help="write the bundles and ONNX files here instead of a temporary directory")
    parser.add_argument(
        "--from-results",
        metavar="DIR",
        help="render the results a test run wrote (IOBUNDLE_ZOO_RESULTS=DIR) instead of running the zoo",
    )
    args = parser.parse_args(argv)
    entries = [family(n) for n in args.families] if args.families else list(ZOO)
    if args.from_results:
        folder = Path(args.from_results)
        missing = [e.name for e in entries if not (folder / f"{e.name}.json").is_file()]
        if missing:
            raise SystemExit(
                f"{folder}: no result for {', '.join(missing)}; run the whole zoo with IOBUNDLE_ZOO_RESULTS"
            )
        results = {
            e.name: FamilyResult.from_json(json.loads((folder / f"{e.name}.json").read_text("utf-8"))) for e in entries
        }
        table = format_matrix(entries, results, None)
        print(table)
        if not args.families:
            write_page(table)
        return 0
    begin, cpu_begin = time.perf_counter(), _cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="iobundle-zoo-") as tmp:
        root = Path(args.keep or tmp)
        results = run_families(entries, root, jobs=args.jobs)
    seconds, cpu = time.perf_counter() - begin, _cpu_seconds() - cpu_begin
    table = format_matrix(entries, results, seconds, cpu)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({k: r.to_json() for k, r in results.items()}, indent=1), "utf-8")
    if not args.families:
        write_page(table)
    unexpected = [e.name for e in entries if bool(results[e.name].failures(e.atol)) != bool(e.known_failure)]
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
