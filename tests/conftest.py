"""Shared fixtures: real servers on free ports, and stores on every backend.

- ``redis_server`` (session): a real redis-server (``tests.servers.redis_executable``
  says which binary; tests that use these fixtures are marked ``redis``);
  ``redis_url`` (per test) flushes it and returns ``redis://127.0.0.1:P/0``;
  ``private_redis`` gives a test its own server to ``stop()`` / ``restart()`` (same
  port, data lost) without disturbing others.
- ``s3_server`` (session): SeaweedFS ``weed mini`` with a bucket; its endpoint and
  credentials are put in ``os.environ`` so stores and child processes find them.
  ``s3_url`` (per test) is a fresh ``s3://bucket/prefix``. ``s3_server.stop()`` /
  ``restart()`` keep the data folder and ports; later tests restart it if needed.
- ``hf_bucket`` (session): the local Hub bucket stand-in (``HF_ENDPOINT`` points at
  it); ``hf_url`` (per test) is a fresh ``hf://buckets/<ns>/<bucket>/<prefix>``.
  Xet transfers from several processes at the same moment do not work against the
  stand-in (see its docstring): concurrent multi-process tests should use file or s3.
- ``store`` (per test, parametrised file/s3/hf): an ObjectStore with a fresh root;
  ``store_url`` is the same for code that opens stores from URLs (subprocesses).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.store import ObjectStore, open_store
from tests.hf_bucket_standin import HfBucketStandin
from tests.servers import RedisServer, SeaweedS3Server, redis_executable, redis_version

STORE_BACKENDS = ("file", "s3", "hf")
HF_TEST_BUCKET = "deltasync-tests/bucket"

_HF_HOME: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    # huggingface_hub reads these at import: keep its caches out of the user's home
    # and its progress bars out of test output.
    global _HF_HOME
    if "HF_HOME" not in os.environ:
        _HF_HOME = tempfile.mkdtemp(prefix="deltasync-hf-home-")
        os.environ["HF_HOME"] = _HF_HOME
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def pytest_report_header(config: pytest.Config) -> str:
    executable = redis_executable()
    return f"redis-server for tests: {executable} (v{redis_version(executable)})"


_REDIS_FIXTURES = {"redis_server", "redis_url", "private_redis"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that talks to a test redis-server (``-m redis`` selects them)."""
    for item in items:
        if _REDIS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _HF_HOME is not None:
        shutil.rmtree(_HF_HOME, ignore_errors=True)


def fresh_name(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


class _EnvPatch:
    """Set environment variables for the whole session and put them back afterwards."""

    def __init__(self, values: dict[str, str]) -> None:
        self.saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)

    def undo(self) -> None:
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- Redis ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests that stop it should call ensure_running()."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server, running and empty."""
    redis_server.ensure_running()
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be stopped and restarted."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- S3 ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3Server]:
    """SeaweedFS S3 for the session, with its endpoint and keys in os.environ."""
    server = SeaweedS3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    env = _EnvPatch(server.store_environment())
    try:
        yield server
    finally:
        env.undo()
        server.stop()


@pytest.fixture
def s3_url(s3_server: SeaweedS3Server) -> str:
    """A fresh, empty prefix in the session's bucket."""
    s3_server.ensure_running()
    return s3_server.url(fresh_name())


# -- Hugging Face bucket ---------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HfBucketStandin]:
    """The local stand-in of the Hub's bucket API, with ``HF_ENDPOINT`` pointing at it."""
    standin = HfBucketStandin(tmp_path_factory.mktemp("hf-cas"))
    standin.start()
    standin.create_bucket(HF_TEST_BUCKET)
    env = _EnvPatch({"HF_ENDPOINT": standin.endpoint})
    try:
        yield standin
    finally:
        env.undo()
        standin.stop()


@pytest.fixture
def hf_url(hf_bucket: HfBucketStandin) -> str:
    """A fresh, empty prefix in the stand-in's test bucket."""
    return f"hf://buckets/{HF_TEST_BUCKET}/{fresh_name()}"


# -- every backend ---------------------------------------------------------------------


@pytest.fixture(params=STORE_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URL on each backend; servers start only when a backend is used."""
    backend = request.param
    if backend == "file":
        return (tmp_path / "store").as_uri()
    if backend == "s3":
        return str(request.getfixturevalue("s3_url"))
    return str(request.getfixturevalue("hf_url"))


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    """An ObjectStore with a fresh, empty root, on each backend (file, s3, hf)."""
    return open_store(store_url)
