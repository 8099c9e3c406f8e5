"""Run zoo families end to end: capture a generate() here, export and validate through the CLI in a fresh process.

For each family of :mod:`families`: build the tiny model, observe ``forward`` during a real
``generate()``, save a self-contained bundle (``include_model=True``), then run, in a fresh
interpreter with an empty working directory, the two commands::

    iobundle export BUNDLE --from-bundle --batch-all -o BUNDLE.onnx
    iobundle validate BUNDLE BUNDLE.onnx --report BUNDLE.validate.json

``export`` checks the exported program (``ep.module()``) on every recorded call and exits
non-zero when one differs; ``validate`` runs onnxruntime on every recorded call. Only the
bundle crosses the process boundary. One interpreter runs both commands of a bundle, one
after the other, through the command line's ``main`` (:func:`cli_session`; under pytest-xdist,
one interpreter per worker runs all the worker's replays): much of a replay's time is spent
importing torch, transformers and onnxscript, paid once instead of per command. The replays of several families run side by side (``jobs``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from families import Family

__all__ = [
    "BundleResult",
    "FamilyResult",
    "bundle_cache_kinds",
    "capture_family",
    "cli_session",
    "replay_bundle",
    "run_families",
]

REPLAY_TIMEOUT_S = 900


@dataclass
class BundleResult:
    """What export and validate said about one bundle of a family."""

    name: str
    calls: int = 0
    programs: int = 0
    traced_calls: list[int] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    """Remedies whose re-export serves the check beyond the recorded calls (that check passed with them)."""
    export_seconds: float = 0.0
    onnx_seconds: float = 0.0
    ep_checks: list[dict[str, Any]] = field(default_factory=list)
    ort_rows: list[dict[str, Any]] = field(default_factory=list)
    cache: str = "-"
    export_rc: int | None = None
    validate_rc: int | None = None
    export_output: str = ""
    validate_output: str = ""

    @property
    def ep_max_abs(self) -> float | None:
        values = [c["abs"] for c in self.ep_checks if c["abs"] is not None]
        return max(values) if values else None

    @property
    def ort_max_abs(self) -> float | None:
        values = [float(r["abs"]) for r in self.ort_rows if r.get("abs") is not None]
        return max(values) if values else None

    def failures(self, atol: float) -> list[str]:
        """Every way this bundle falls short of "every recorded call within ``atol`` in both runtimes"."""
        problems = []
        if self.export_rc != 0:
            problems.append(f"export exit code {self.export_rc}: {_tail(self.export_output)}")
        if self.validate_rc != 0:
            problems.append(f"validate exit code {self.validate_rc}: {_tail(self.validate_output)}")
        if len(self.ep_checks) != self.calls:
            problems.append(f"ep.module() checked {len(self.ep_checks)} of {self.calls} calls")
        if len(self.ort_rows) != self.calls:
            problems.append(f"onnxruntime checked {len(self.ort_rows)} of {self.calls} calls")
        for c in self.ep_checks:
            if c["status"] != "ok" or c["abs"] is None or c["abs"] > atol:
                problems.append(f"ep.module() call {c['index']}: {c['status']} (max abs {c['abs']})")
        for r in self.ort_rows:
            if r.get("SUCCESS") is not True or float(r["abs"]) > atol:
                problems.append(f"onnxruntime call {r['index']}: {r.get('error') or 'differs'} (max abs {r['abs']})")
        return problems


@dataclass
class FamilyResult:
    """A family's capture and the replay of each of its bundles."""

    family: str
    capture_seconds: float = 0.0
    bundles: list[BundleResult] = field(default_factory=list)
    error: str | None = None

    def failures(self, atol: float) -> list[str]:
        if self.error:
            return [self.error]
        return [f"{b.name}: {p}" for b in self.bundles for p in b.failures(atol)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FamilyResult:
        """The result :meth:`to_json` gave (``matrix.py --from-results`` reads what a test run wrote)."""
        bundles = [BundleResult(**b) for b in data.get("bundles", [])]
        return cls(**{**data, "bundles": bundles})


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def capture_family(entry: Family, root: Path) -> tuple[dict[str, Path], float]:
    """Build ``entry``'s model, observe its ``generate()`` (or ``entry.run``), save one bundle per observed module.

    The bundle is self-contained (``include_model``) unless the replay builds the model with ``entry.factory``.
    """
    from iobundle import InputObserver

    begin = time.perf_counter()
    model, kwargs = entry.build()
    model = model.to(getattr(torch, entry.dtype))
    modules = entry.observe(model) if entry.observe else {entry.name: model}
    observers = {name: InputObserver() for name in modules}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        caught = None
        if 1 in entry.classes:  # state kept on modules: capture says so, once (a warning, not an error here)
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.filterwarnings("always", message=".*changed tensors its module tree keeps")
        if entry.autocast:
            stack.enter_context(torch.autocast("cpu", dtype=getattr(torch, entry.autocast)))
        for name, observer in observers.items():
            stack.enter_context(observer(modules[name], store_n_calls=entry.store_n_calls))
        if entry.run is None:
            model.generate(**kwargs)
        else:
            entry.run(model, kwargs)
    if caught is not None and not any("module tree keeps" in str(w.message) for w in caught):
        raise AssertionError(f"{entry.name} keeps state on its modules, but capture did not say so")
    paths = {}
    for name, observer in observers.items():
        path = root / f"{name}.iobundle"
        # A model the bundle cannot store (plain torch) is the replay's --model factory instead.
        observer.save(path, include_model=entry.factory is None and (True if modules[name] is model else model))
        paths[name] = path
    return paths, time.perf_counter() - begin


# The fresh interpreter of a replay: reads one command a line (JSON: argv, working directory, the
# files for its stdout and stderr), runs it as `python -m iobundle ARGV` would, its stdout and
# stderr written to those files, and answers with its exit code on the stdout it started with.
_SESSION = """
import json, os, sys, traceback
from iobundle.cli import main
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    argv, cwd, out, err = json.loads(line)
    os.chdir(cwd)
    with open(out, "wb") as o, open(err, "wb") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    print(code, file=answers, flush=True)
"""

Cli = Callable[[list[str], Path], subprocess.CompletedProcess[str]]


class _Interpreter:
    """One interpreter running ``iobundle`` commands (:data:`_SESSION`), started again if it died.

    Each command gets ``timeout`` seconds; past them the interpreter is killed, the command
    returns the signal as a negative exit code with what it had printed, and the next command
    starts a new interpreter.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.folder = Path(tempfile.mkdtemp(prefix="iobundle-cli-"))
        self.count = 0
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.count += 1
        with open(self.folder / f"session-{self.count}.err", "wb") as session_err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SESSION], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=session_err, env=env, text=True,
            )  # fmt: skip
        self.session_err = self.folder / f"session-{self.count}.err"
        return self.proc

    def run(self, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None and proc.stdout is not None
        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        timer = threading.Timer(self.timeout, proc.kill)
        timer.start()
        try:
            with contextlib.suppress(BrokenPipeError):  # the interpreter is gone: its exit code says why
                proc.stdin.write(json.dumps([argv, str(cwd), str(out), str(err)]) + "\n")
                proc.stdin.flush()
            answer = proc.stdout.readline()
            code = int(answer) if answer.strip() else proc.wait()
        finally:
            timer.cancel()
        text = [p.read_text("utf-8", "replace") if p.exists() else "" for p in (out, err)]
        if not answer.strip():
            text[1] += self.session_err.read_text("utf-8", "replace")
        return subprocess.CompletedProcess(argv, code, *text)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        with contextlib.suppress(BrokenPipeError):  # the interpreter is gone (killed): nothing left to read
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_WORKER_INTERPRETER: _Interpreter | None = None


def _worker_interpreter(timeout: float) -> _Interpreter:
    """The interpreter a pytest-xdist worker reuses for all its replays (closed when the worker exits)."""
    global _WORKER_INTERPRETER
    if _WORKER_INTERPRETER is None:
        _WORKER_INTERPRETER = _Interpreter(timeout)
        atexit.register(_WORKER_INTERPRETER.close)
    _WORKER_INTERPRETER.timeout = timeout
    return _WORKER_INTERPRETER


@contextlib.contextmanager
def cli_session(timeout: float = REPLAY_TIMEOUT_S) -> Iterator[Cli]:
    """An interpreter other than this one for several ``iobundle`` commands; yields ``run(argv, cwd)``.

    ``run`` returns what ``subprocess.run`` of ``python -m iobundle ARGV`` would (exit code,
    stdout, stderr); a command past ``timeout`` seconds is killed with its interpreter and
    returns the signal as a negative exit code, with what it had printed. Under pytest-xdist,
    where a worker replays one bundle at a time, the worker's sessions share one interpreter
    (started again if a command killed it): the imports of torch, transformers and onnxscript
    and the first export's set-up are paid once per worker instead of once per bundle, and a
    replay still sees nothing of the process that captured the bundle. Elsewhere (``make zoo``,
    replays side by side in threads) each session is a fresh interpreter.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield _worker_interpreter(timeout).run
        return
    interpreter = _Interpreter(timeout)
    try:
        yield interpreter.run
    finally:
        interpreter.close()


_TRACED = re.compile(r"torch\.export: traced from call (\d+) in ([0-9.]+)s")
_PATCH = re.compile(r"^\s*patch: (\S+)", re.MULTILINE)
_ONNX = re.compile(r"torch\.onnx\.export: .* in ([0-9.]+)s")
_REMEDY = re.compile(
    r"^beyond the recorded calls: .*: ok \(.*served by re-exporting with the remedy (\w+)", re.MULTILINE
)
_CHECKED = re.compile(r"exported program checked on (\d+) recorded calls")


def _parse_export(text: str, result: BundleResult) -> None:
    """Read the export command's report: traced calls, patches, timings, one row per checked call."""
    traced = _TRACED.findall(text)
    result.programs = len(traced)
    result.traced_calls = [int(i) for i, _ in traced]
    result.export_seconds = sum(float(s) for _, s in traced)
    result.patches = list(dict.fromkeys(_PATCH.findall(text)))
    result.remedies = list(dict.fromkeys(_REMEDY.findall(text)))
    result.onnx_seconds = sum(float(s) for s in _ONNX.findall(text))
    rows = []
    in_table = False
    for line in text.splitlines():
        cells = line.split()
        if cells[:2] == ["call", "status"]:
            in_table = True
            continue
        if not in_table or not cells:
            continue
        if not cells[0].isdigit():
            if not set(line.strip()) <= set("-+| \u2500"):
                in_table = False
            continue
        index, status = int(cells[0]), cells[1]
        numbers = [c for c in cells[2:] if _is_number(c)]
        abs_error = float(numbers[0]) if numbers and status == "ok" else None
        rows.append({"index": index, "status": status, "abs": abs_error, "line": line.strip()})
    result.ep_checks = rows


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cache_kind(node: Any) -> str | None:
    """``DynamicCache: full, sliding``: the recorded cache class and its layer kinds, from the manifest's tree."""
    from iobundle.schema import ObjectNode

    if isinstance(node, ObjectNode) and node.type.startswith("transformers.") and node.type.endswith("Cache"):
        name = node.type.removeprefix("transformers.")
        inner = [kind for child in node.items if (kind := _cache_kind(child))]
        if inner:
            return f"{name}({' / '.join(dict.fromkeys(inner))})"
        kinds = node.context if isinstance(node.context, list) else []
        names = [next(iter(k)) if isinstance(k, dict) and k else str(k) for k in kinds if isinstance(k, (str, dict))]
        return f"{name}: {', '.join(dict.fromkeys(names))}" if names else name
    for child in getattr(node, "items", ()):
        if kind := _cache_kind(child):
            return kind
    return None


def bundle_cache_kinds(manifest: Any) -> str:
    """The cache kind the bundle's recorded inputs hold (the most detailed over its calls), or ``-``."""
    kinds = [
        kind for call in manifest.calls for node in [*call.args, *call.kwargs.values()] if (kind := _cache_kind(node))
    ]
    return max(kinds, key=len) if kinds else "-"


def replay_bundle(
    name: str, bundle: Path, work: Path, *, factory: str | None = None, export_args: Iterable[str] = ("--batch-all",)
) -> BundleResult:
    """``iobundle export --from-bundle --batch-all`` then ``iobundle validate`` on ``bundle``, in one fresh process.

    With ``factory`` (``zoo_models:FACTORY``), export builds the model with ``--model factory`` instead, from a
    copy of ``zoo_models.py`` in its working directory (the user's code); ``export_args`` replace ``--batch-all``.
    """
    from iobundle.schema import load_manifest

    manifest = load_manifest(bundle)
    result = BundleResult(name=name, calls=sum(1 for c in manifest.calls if c.status == "ok"))
    result.cache = bundle_cache_kinds(manifest)
    onnx_path = bundle.with_suffix(".onnx")
    report = bundle.with_suffix(".validate.json")
    work.mkdir(parents=True, exist_ok=True)
    model = ["--from-bundle"]
    if factory is not None:
        shutil.copy(Path(__file__).with_name("zoo_models.py"), work / "zoo_models.py")
        model = ["--model", factory]
    with cli_session() as cli:
        proc = cli(["export", str(bundle), *model, *export_args, "-o", str(onnx_path)], work)
        result.export_rc, result.export_output = proc.returncode, proc.stdout + proc.stderr
        _parse_export(proc.stdout, result)
        index = onnx_path.with_suffix(".programs.json")  # one program per phase: validate through the index
        if index.exists():
            onnx_path = index
        if not onnx_path.exists():
            return result
        proc = cli(["validate", str(bundle), str(onnx_path), "--report", str(report)], work)
        result.validate_rc, result.validate_output = proc.returncode, proc.stdout + proc.stderr
    if report.exists():
        result.ort_rows = json.loads(report.read_text("utf-8"))
    return result


def run_families(entries: Iterable[Family], root: Path, *, jobs: int = 2) -> dict[str, FamilyResult]:
    """Capture every family here (one after the other), replay their bundles ``jobs`` at a time."""
    results: dict[str, FamilyResult] = {}
    pending: list[tuple[FamilyResult, Family, str, Path, Path]] = []
    for entry in entries:
        result = results[entry.name] = FamilyResult(entry.name)
        folder = root / entry.name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            bundles, result.capture_seconds = capture_family(entry, folder)
        except Exception as exc:  # a family that cannot be captured is a result, not a crash of the zoo
            result.error = f"capture failed: {type(exc).__name__}: {exc}"
            continue
        pending += [(result, entry, name, path, folder / "work") for name, path in bundles.items()]

    def replay(job: tuple[FamilyResult, Family, str, Path, Path]) -> tuple[FamilyResult, BundleResult]:
        result, entry, name, path, work = job
        return result, replay_bundle(name, path, work, factory=entry.factory, export_args=entry.export_args)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(replay, pending))
    for result, bundle_result in done:
        result.bundles.append(bundle_result)
    return results
