"""Shared by every test folder: the zoo runs first; a real S3 API on localhost (moto's server, through s3fs).

The zoo's tests (``tests/zoo``) are the longest of the suite (each exports and validates a
model in fresh processes): collected first, they start first, and pytest-xdist's workers
share the rest of the suite around them instead of waiting on one last zoo test.

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

ZOO = Path(__file__).resolve().parent / "zoo"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the zoo's tests first, keeping the order of everything else (whole modules stay together)."""
    items.sort(key=lambda item: ZOO not in item.path.parents)


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
