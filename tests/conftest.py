"""Shared by every test folder: how pytest-xdist shares the suite out; a real S3 API on localhost (moto's server, through s3fs).

``make test`` runs two pytest-xdist workers with ``--dist loadgroup``: a test is a unit of
work of its own unless it carries an ``xdist_group`` mark, and every test of a group runs on
one worker. Two rules keep the two workers busy and each expensive fixture built once:

- **Tests that share a module-scoped fixture form a group.** Left as separate units, the
  tests of one module go to both workers, and each worker builds the module's fixture (a
  capture, an export, a replay in a fresh process) for itself. :func:`share_module_fixtures`
  puts the tests that share one (directly or through another test) into one group; the
  groups named by hand (``xdist_group`` marks, for session-scoped fixtures) join it.
- **The longest units start first.** A worker takes the next unit in collection order
  when it runs short, so a long unit collected last would leave the other worker idle at the
  end. First the groups holding a test marked ``slow`` (one capture, export or replay shared
  by several end-to-end tests: the longest units, such as the LLM families' replay), then the
  other ``slow`` tests (a demo, a zoo family: each exports and validates a model in fresh
  processes), then the other groups, then single tests, the many short ones that even out the
  end; within each rank the order of the files is kept (see :func:`start_order`). ``make test``
  passes ``--no-loadscope-reorder``: without it pytest-xdist 3.8 sorts the units by their number
  of tests, and this order only holds among the units of one size.

The server runs in its own process, started once per test process (each pytest-xdist worker
starts its own, on a port the operating system picks) and stopped at the end of the session.
Only 127.0.0.1 is ever contacted. A test gets the server through :func:`s3`, which points
fsspec at it (``FSSPEC_S3_ENDPOINT_URL`` and dummy credentials in the environment, for the
commands it runs in fresh processes too) and hands out empty buckets.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # for the plain helper module two_calls.py beside the tests


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Group the tests that share a module-scoped fixture, then put the longest units first.

    Runs before pytest-xdist's own hook, which appends each test's group to its node id in a
    worker (the id is all the scheduler sees); checks afterwards that it did. With pytest 9.2
    and pytest-xdist 3.8 it does not (pytest-xdist#1386: the groups are silently ignored and
    every fixture is built on both workers), hence the pin of pytest below 9.2.
    """
    groups = share_module_fixtures(items)
    items[:] = start_order(items, groups)
    yield
    if getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers under --dist loadgroup
        for item in items:
            if _named_groups(item) and "@" not in item.nodeid:
                item.stash[LOST_GROUP] = (
                    f"pytest-xdist did not put this test in its xdist_group {_named_groups(item)}: under "
                    "--dist loadgroup each worker would build the fixtures it shares (pytest-xdist#1386); "
                    "install the pytest and pytest-xdist versions of constraints.txt"
                )


LOST_GROUP = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test that pytest-xdist took out of its group (see :func:`pytest_collection_modifyitems`)."""
    if LOST_GROUP in item.stash:
        pytest.fail(item.stash[LOST_GROUP], pytrace=False)


def _named_groups(item: pytest.Item) -> list[str]:
    return [str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")]


def share_module_fixtures(items: list[pytest.Item]) -> list[str | None]:
    """Mark the tests that share a module-scoped fixture with one ``xdist_group``; each item's group (None: its own unit).

    Tests are joined when they use the same module-scoped fixture of the same module, or the
    same ``xdist_group`` name. Every test of a joined set gets every group name of the set,
    so that pytest-xdist (which names a test's group after all its marks) sees one group.
    """
    parent = list(range(len(items)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[object, int] = {}  # a fixture (module, name) or a group name -> the first item that has it
    keys: list[list[tuple[Path, str]]] = []
    for index, item in enumerate(items):
        defs = item._fixtureinfo.name2fixturedefs if isinstance(item, pytest.Function) else {}
        fixtures = [
            (item.path, name) for name in item.fixturenames if defs.get(name) and defs[name][-1].scope == "module"
        ]
        keys.append(fixtures)
        for key in [*fixtures, *_named_groups(item)]:
            parent[root(index)] = root(first.setdefault(key, index))
    members: dict[int, list[int]] = {}
    for index in range(len(items)):
        members.setdefault(root(index), []).append(index)
    groups: list[str | None] = [None] * len(items)
    for indices in members.values():
        named = sorted({name for i in indices for name in _named_groups(items[i])})
        if len(indices) == 1 and not named:
            continue  # a test alone: its own unit
        if not named:  # a group by fixture, named after the first one: "replay/check/test_report.py:result"
            path, fixture = next(key for i in indices for key in keys[i])
            named = [f"{(path.relative_to(TESTS) if path.is_relative_to(TESTS) else path).as_posix()}:{fixture}"]
        for i in indices:
            for name in sorted(set(named) - set(_named_groups(items[i]))):
                items[i].add_marker(pytest.mark.xdist_group(name))
            groups[i] = "_".join(named)
    return groups


def start_order(items: list[pytest.Item], groups: list[str | None]) -> list[pytest.Item]:
    """The items, their units ranked: groups with a ``slow`` test, other ``slow`` tests, other groups, single tests.

    A group takes the rank of its highest-ranked test; within a rank the items keep the
    order of the collection (so a group's place is that of its first test).
    """
    rank: dict[str, int] = {}
    for item, group in zip(items, groups):
        unit = group or item.nodeid
        slow = item.get_closest_marker("slow") is not None
        here = 0 if slow and group else 1 if slow else 2 if group else 3
        rank[unit] = min(rank.get(unit, here), here)
    return [
        item
        for _, _, item in sorted(
            ((rank[group or item.nodeid], index, item) for index, (item, group) in enumerate(zip(items, groups))),
            key=lambda entry: entry[:2],
        )
    ]


# The server prints the port the system gave it, then serves until its standard input closes.
_SERVER = """\
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


def require(module: str, why: str) -> None:
    """Skip the test when ``module`` is not installed; under CI (``CI`` set) fail it instead.

    The module is looked up, not imported (moto is imported only by the server process).
    """
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but {module} is not installed: {why}")
    pytest.skip(f"needs {module}: {why}")


@dataclass
class S3Server:
    """A running S3 API: its endpoint, and the environment a fresh process needs to reach it."""

    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    def bucket(self) -> str:
        """A new empty bucket, as ``s3://NAME``."""
        import fsspec

        name = f"iobundle-{uuid.uuid4().hex[:16]}"
        fsspec.filesystem("s3").mkdir(name)  # configured by the s3 fixture
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server in a child process on a free 127.0.0.1 port, for the whole session."""
    for module in ("s3fs", "moto"):
        require(module, "pip install -c constraints.txt -e '.[test]' installs it")
    log = tmp_path_factory.mktemp("s3") / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            proc.kill()
            pytest.fail(f"moto's S3 server did not start: {log.read_text()[-2000:]}")
        endpoint = f"http://127.0.0.1:{int(line)}"
        env = {
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata service for credentials
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        yield S3Server(endpoint, env)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """:func:`s3_server`, with this process's environment and fsspec's configuration pointing at it."""
    import fsspec.config

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    # FSSPEC_S3_* is read when fsspec is imported (already done here); a fresh process reads the environment.
    # No listings cache: a read sees what the server holds, also after a command in another process wrote.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server.endpoint, "use_listings_cache": False})
    return s3_server


@contextlib.contextmanager
def own_file_layout() -> Iterator[None]:
    """Inside: every tensor a bundle writer writes goes to its call's own safetensors file, none to a segment.

    That is format version 3's layout, which version 4 keeps for large tensors: for the tests that open,
    edit or break ``calls/NNNNNN.safetensors`` files (segments have tests of their own).
    """
    from iobundle.capture import _writer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_writer, "SEGMENT_TENSOR_BYTES", 0)
        yield


@pytest.fixture
def own_files() -> Iterator[None]:
    """:func:`own_file_layout` for one test."""
    with own_file_layout():
        yield


@pytest.fixture
def thread_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams write with a thread of this process, not the writer process: for tests that patch the
    write path here (a disk full, a slow disk, fsync spies) or that check the thread's own promises."""
    from iobundle.capture import _stream

    monkeypatch.setattr(_stream, "WRITER", "thread")


@pytest.fixture
def process_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams write with the writer process (``IOBUNDLE_WRITER=process``), for the tests of that writer."""
    from iobundle.capture import _stream

    monkeypatch.setattr(_stream, "WRITER", "process")


@pytest.fixture(params=["read-whole", "mapped"])
def tensor_file_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both ways of opening a tensor file: small files read whole, large ones mapped."""
    from iobundle.calls import _tensorfile_read as _tensorfile

    if request.param == "mapped":
        monkeypatch.setattr(_tensorfile, "READ_WHOLE_BYTES", -1)
    return str(request.param)
