"""What recording costs the model's thread, in instructions: a measure the machine's load does not move.

Wall-clock figures on a shared machine swing by 30 % from minute to minute, more than most changes to the
recording path are worth. This counts instructions instead (valgrind's callgrind), in a synthetic decode
loop: a "model" that only grows a ``DynamicCache`` of ``--layers`` layers by one position per call (no
compute), streamed to a bundle by ``InputObserver`` as ``generate()`` would call it. Each process is run
twice per variant, with two numbers of decode calls, so that what a process does once (importing torch,
starting the stream) cancels: per call = (instructions at the larger count - at the smaller) / (difference).
Recording per call is that of the recorded loop minus that of the unrecorded one, on the main thread (the
model's); the writer process, the thread that reads its answers and Python's cyclic collector (paused: its
collections come in lumps, which the wall-clock figures time) are not counted, nor the end of the block (the
process ends inside it: closing the stream, which waits for the writer process and writes the final manifest,
grows with the calls and was counted as theirs, 10 M of the 14 M instructions a call this script reported
before). One ``--tree`` per checkout to compare (a worktree of another commit, say), each measured in its own
interpreter with that tree first on ``sys.path``.

    .venv/bin/python benchmarks/instructions.py --tree . --tree ../base   # about 6 minutes per tree

Needs valgrind (``apt-get install valgrind``). Not part of ``make bench``: the numbers are instructions,
not time, and a run takes minutes (``benchmarks/hot_loop.py`` times the same loop in seconds). About 3.7 M
instructions per 32-layer decode call, what 0.6 ms of the thread's CPU in ``hot_loop.py`` implies; compare
checkouts measured the same way, never a count with a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: sys.path[0] is benchmarks/, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hot_loop import DECODER

_LOOP = (
    DECODER
    + r"""
calls, record = int(sys.argv[2]), sys.argv[3] == "1"
gc.disable()  # collections come in lumps that one count catches and another not: timed in the wall-clock figures
with InputObserver()(model, store_n_calls=calls + 1 if record else 0, stream_to=tempfile.mkdtemp() + "/b"):
    decode(calls)
    # out without leaving the block: its end (the final manifest, every call's entry) grows with the calls and
    # would be counted as theirs; the writer process sees the pipe close and ends too
    sys.stdout.flush()
    os._exit(0)
"""
)


def _instructions(tree: Path, layers: int, calls: int, record: bool) -> int:
    """Instructions callgrind counts on the main thread (the model's) in one run of the loop.

    The main thread's alone: the thread that reads the writer process's answers does per answer what the
    process batches at full speed and answers one by one under valgrind, 50 times slower.
    """
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={tmp}/out",
             sys.executable, "-c", _LOOP, str(layers), str(calls), "1" if record else "0"],
            cwd=tree, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        main_thread = Path(tmp, "out-01")
        found = re.search(r"^summary:\s+(\d+)", main_thread.read_text(), re.M) if main_thread.is_file() else None
    if result.returncode != 0 or found is None:
        raise SystemExit(f"{tree}: the loop failed under valgrind (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return int(found.group(1))


def measure(tree: Path, layers: int, counts: tuple[int, int]) -> dict[str, float]:
    """Instructions per decode call of the loop, recorded and not, and recording's share, for ``tree``."""
    runs = [(record, calls) for record in (False, True) for calls in counts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # one valgrind per core
        counted = dict(zip(runs, pool.map(lambda r: _instructions(tree, layers, r[1], r[0]), runs)))
    span = counts[1] - counts[0]
    plain = (counted[(False, counts[1])] - counted[(False, counts[0])]) / span
    recorded = (counted[(True, counts[1])] - counted[(True, counts[0])]) / span
    return {"plain": plain, "recorded": recorded, "recording": recorded - plain}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--layers", type=int, default=32, help="cache layers (default 32: 4 tensors a layer per call)")
    parser.add_argument("--calls", type=int, nargs=2, default=(20, 40), metavar=("FEW", "MANY"),
                        help="the two numbers of recorded decode calls (default 20 40)")  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.calls[0] < args.calls[1]:
        parser.error("--calls FEW MANY needs 0 < FEW < MANY")
    if args.layers < 1:
        parser.error("--layers needs at least 1")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind)")
    trees = [t.resolve() for t in args.tree or [Path(__file__).resolve().parents[1]]]
    first = None
    for tree in trees:
        per_call = measure(tree, args.layers, tuple(args.calls))
        first = first or per_call["recording"]
        print(
            f"{tree}: recording {per_call['recording'] / 1e6:.3f} M instructions per decode call "
            f"({per_call['recording'] / first:.3f} x the first tree), the loop alone {per_call['plain'] / 1e6:.3f} M, "
            f"{args.layers} layers"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
