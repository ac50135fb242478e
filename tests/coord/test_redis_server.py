"""The embedded redis-server (start once, reuse, restart, persistence) and client helpers."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.coord.connection import client_url, redact_url, redis_client, redis_errors
from pipeline.coord.events import StepCompleted
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, ServiceUnavailableError
from tests.servers import free_port, stop_process, wait_until
from workers.redis_launcher import ensure_redis, read_server_record, redis_binary, stop_redis

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "home"
    try:
        yield folder
    finally:
        stop_redis(folder)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def ensure_in_subprocess(*data_dirs: Path) -> list[str]:
    """Run ensure_redis in separate processes at the same time; their URLs."""
    code = (
        "import sys; from workers.redis_launcher import ensure_redis; "
        "print(ensure_redis(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(d)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in data_dirs
    ]
    urls = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        urls.append(out.strip().splitlines()[-1])
    return urls


def test_starts_once_and_is_reused(data_dir: Path) -> None:
    url = ensure_redis(data_dir)
    record = read_server_record(data_dir)
    assert record is not None
    assert record.url == url
    assert url.startswith("redis://:") and "@127.0.0.1:" in url  # loopback, with a password
    assert ensure_redis(data_dir) == url
    assert read_server_record(data_dir) == record

    client = redis_client(url)
    assert client.info("server")["process_id"] == record.pid
    client.set("marker", "1")
    assert ensure_in_subprocess(data_dir) == [url]  # a second process reuses it too

    folder = data_dir / "redis"
    for private in ("server.json", "redis.conf"):  # they hold the password
        assert stat.S_IMODE((folder / private).stat().st_mode) == 0o600
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=record.port).get("marker")


def test_folder_names_with_spaces_and_quotes(tmp_path: Path) -> None:
    data_dir = tmp_path / 'odd "name" \\ here'
    try:
        client = redis_client(ensure_redis(data_dir))
        assert client.config_get("dir")["dir"] == str((data_dir / "redis").resolve())
    finally:
        stop_redis(data_dir)


def test_concurrent_starts_start_one_server(tmp_path: Path) -> None:
    data_dir = tmp_path / "home"
    try:
        urls = ensure_in_subprocess(data_dir, data_dir, data_dir)
        assert len(set(urls)) == 1
        record = read_server_record(data_dir)
        assert record is not None and record.url == urls[0]
        assert redis_client(urls[0]).ping()
        servers = [
            p
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _is_server_in(p, data_dir / "redis")
        ]
        assert len(servers) == 1
    finally:
        stop_redis(data_dir)


def _is_server_in(proc: Path, folder: Path) -> bool:
    try:
        return (
            b"redis-server" in (proc / "cmdline").read_bytes()
            and Path(os.readlink(proc / "cwd")) == folder.resolve()
            and pid_alive(int(proc.name))
        )
    except OSError:
        return False


def test_restarts_after_being_killed(data_dir: Path) -> None:
    url = ensure_redis(data_dir)
    record = read_server_record(data_dir)
    assert record is not None
    os.kill(record.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(record.pid), "killed redis-server to exit")

    new_url = ensure_redis(data_dir)
    new_record = read_server_record(data_dir)
    assert new_record is not None
    assert new_record.pid != record.pid
    # The same address (port and password): clients of the old server reconnect.
    assert new_url == new_record.url == url
    assert redis_client(new_url).ping()


def test_events_persist_across_a_restart(data_dir: Path) -> None:
    client = redis_client(ensure_redis(data_dir))
    stream = EventStream(client, "persist")
    events = [
        StepCompleted.now(run="persist", version=v, checkpoint=f"/c/{v}", owned=False)
        for v in range(5)
    ]
    ids = [stream.publish(e) for e in events]
    client.close()
    old = read_server_record(data_dir)
    assert old is not None

    assert stop_redis(data_dir)
    assert not pid_alive(old.pid)
    assert read_server_record(data_dir) is None
    assert not stop_redis(data_dir)  # nothing left to stop

    client = redis_client(ensure_redis(data_dir))
    assert read_server_record(data_dir) != old
    assert EventStream(client, "persist").read() == list(zip(ids, events, strict=True))


def test_sigterm_keeps_data_and_a_stale_record_is_replaced(data_dir: Path) -> None:
    client = redis_client(ensure_redis(data_dir))
    client.set("kept", "yes")
    record = read_server_record(data_dir)
    assert record is not None
    os.kill(record.pid, signal.SIGTERM)  # what a machine shutdown sends
    wait_until(lambda: not pid_alive(record.pid), "terminated redis-server to exit")
    assert read_server_record(data_dir) == record  # stale: still on disk

    client = redis_client(ensure_redis(data_dir))
    assert client.get("kept") == b"yes"


def test_a_record_pointing_at_someone_else_is_not_trusted(data_dir: Path) -> None:
    # A foreign redis-server now listens on the recorded port (e.g. after a reboot).
    port = free_port()
    foreign = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir",
         str(data_dir.parent)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: redis.Redis(port=port).ping(), "foreign redis-server", foreign)
        folder = data_dir / "redis"
        folder.mkdir(parents=True)
        record = {"pid": os.getpid(), "port": port, "url": f"redis://127.0.0.1:{port}/0"}
        (folder / "server.json").write_text(json.dumps({**record, "binary": "x"}))
        url = ensure_redis(data_dir)
        assert f":{port}/" not in url
        assert foreign.poll() is None  # left alone
        assert pid_alive(os.getpid())
    finally:
        stop_process(foreign)


def test_unstartable_binary_is_a_service_error(tmp_path: Path) -> None:
    with pytest.raises(ServiceUnavailableError, match="cannot run"):
        ensure_redis(tmp_path / "home", binary=str(tmp_path / "no-such-redis-server"))
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ServiceUnavailableError, match="failed to start"):
        ensure_redis(tmp_path / "home", binary=str(fake))


# --------------------------------------------------------------------------- clients


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://alice:pw@h:1/2", "redis://alice:***@h:1/2"),
        ("rediss://alice:p%40ss@h.example:6380/0", "rediss://alice:***@h.example:6380/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("unix://:pw@/run/redis.sock?db=3", "unix://:***@/run/redis.sock?db=3"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_client_url_and_errors_never_show_the_password() -> None:
    port = free_port()
    client = redis_client(f"redis://bob:hunter2@127.0.0.1:{port}/4", retries=0)
    assert client_url(client) == f"redis://bob@127.0.0.1:{port}/4"
    with pytest.raises(ServiceUnavailableError) as info, redis_errors(client, "testing"):
        client.ping()
    assert "hunter2" not in str(info.value)
    assert f"127.0.0.1:{port}" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://h:1/0",
        "h:6379",
        "",
        "redis://:pw@h:notaport/0",
        # A database that is not a number: redis-py would quietly use database 0.
        "redis://:pw@h:6379/abc",
        "rediss://:pw@h:6379/1x",
        "redis://:pw@h/l",
    ],
)
def test_bad_client_urls(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        redis_client(url).ping()
    assert "pw" not in str(info.value)


def test_tls_url_makes_a_tls_client() -> None:
    client = redis_client("rediss://h.example:6380/0?ssl_cert_reqs=required")
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert client_url(client).startswith("rediss://h.example:6380/")


def test_acl_user_from_url(redis_url: str) -> None:
    admin = redis_client(redis_url)
    admin.acl_setuser("deltasync-test", enabled=True, passwords=["+pa55"], keys=["*"],
                      commands=["+@all"])  # fmt: skip
    try:
        base = redis_url.removeprefix("redis://")
        user = redis_client(f"redis://deltasync-test:pa55@{base}")
        assert user.acl_whoami() in (b"deltasync-test", "deltasync-test")
        wrong = redis_client(f"redis://deltasync-test:nope@{base}", retries=0)
        with pytest.raises(ServiceUnavailableError) as info, redis_errors(wrong):
            wrong.ping()
        assert "nope" not in str(info.value)
    finally:
        admin.acl_deluser("deltasync-test")


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = subprocess.Popen(
        [redis_binary(), "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
         "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(sock.exists, "redis-server socket", server)
        client = redis_client(f"unix://{sock}?db=2")
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client_url(client) == f"unix://{sock}?db=2"
    finally:
        stop_process(server)


def test_socket_timeout_is_set(redis_url: str) -> None:
    client = redis_client(redis_url, socket_timeout_s=7.5)
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 7.5
    assert client.ping()
