"""Replica heartbeats, per-run locks and once-only claims on Redis.

A replica reports the version it holds to ``deltasync:run:<run>:replica:<node>``
(a hash that expires unless renewed); garbage collection keeps what the oldest
live replica still needs. Heartbeat times come from the Redis server's clock,
so ages do not depend on clocks agreeing between machines. Each heartbeat names
the node's lease: silent for longer, it is shown as dead until its record expires.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import redis
import structlog

from pipeline.config import REPLICA_TTL_S
from pipeline.coord import scripts
from pipeline.coord.connection import redis_errors, text
from pipeline.coord.keys import NODE_PATTERN, lock_key, replica_key, replicas_key
from pipeline.errors import ConfigError, DeltasyncError, LockError

_Record = TypeVar("_Record")

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = REPLICA_TTL_S
# A node heartbeats every few seconds between syncs; one silent this long is dead.
DEFAULT_LEASE_S = 60.0


def _ms(seconds: float) -> int:
    if not seconds > 0:
        raise ConfigError(f"a time-to-live must be positive, got {seconds}")
    return max(1, round(seconds * 1000))


# --------------------------------------------------------------------------- heartbeats


@dataclass(frozen=True)
class ReplicaInfo:
    node: str
    version: int
    time: datetime  # when it last reported (the Redis server's clock)
    age_s: float  # seconds since then
    state_hash: str
    lease_s: float = DEFAULT_LEASE_S  # silent for longer: dead (its record stays till its TTL)

    @property
    def dead(self) -> bool:
        return self.age_s > self.lease_s


def report(
    client: redis.Redis,
    run: str,
    node: str,
    version: int,
    state_hash: str,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    lease_s: float = DEFAULT_LEASE_S,
) -> None:
    """Record that ``node`` holds ``version`` of ``run``; dead after ``lease_s`` silence,
    forgotten after ``ttl_s``."""
    key = replica_key(run, node)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"replica {node} of run {run}: invalid version {version!r}")
    with redis_errors(client, f"reporting replica {node}"):
        scripts.REPORT_REPLICA(
            client, [key, replicas_key(run)], node, version, state_hash, _ms(ttl_s), lease_s
        )


def forget_replica(client: redis.Redis, run: str, node: str) -> None:
    """Remove ``node``'s heartbeat (a replica shutting down cleanly)."""
    with redis_errors(client, f"removing replica {node}"), client.pipeline() as pipe:
        pipe.delete(replica_key(run, node))
        pipe.srem(replicas_key(run), node)
        pipe.execute()


def list_replicas(client: redis.Redis, run: str) -> list[ReplicaInfo]:
    """The replicas of ``run`` whose heartbeat has not expired, by node name."""
    return node_records(client, replicas_key(run), lambda node: replica_key(run, node), _info)


def node_records(
    client: redis.Redis,
    index: str,
    key_of: Callable[[str], str],
    parse: Callable[[str, dict[str, str], float], _Record | None],
) -> list[_Record]:
    """The records of the nodes named in the set ``index``, by node name: each node's
    hash at ``key_of(node)`` parsed by ``parse(node, fields, now)`` (the server's
    clock). Names that are not node names are skipped; those whose record expired or
    does not parse (None) leave the index."""
    with redis_errors(client, f"reading {index}"):
        members: Any = client.smembers(index)
        nodes = sorted(text(n) for n in members)
        valid = [n for n in nodes if NODE_PATTERN.fullmatch(n)]
        with client.pipeline(transaction=False) as pipe:
            pipe.time()
            for node in valid:
                pipe.hgetall(key_of(node))
            now_raw, *hashes = pipe.execute()
        now = float(now_raw[0]) + float(now_raw[1]) / 1e6
        found: list[_Record] = []
        gone: list[str] = [n for n in nodes if n not in valid]
        for node, raw in zip(valid, hashes, strict=True):
            record = parse(node, {text(k): text(v) for k, v in raw.items()}, now)
            if record is None:
                gone.append(node)
            else:
                found.append(record)
        if gone:  # expired records leave their name in the index
            client.srem(index, *gone)
    return found


def _info(node: str, fields: dict[str, str], now: float) -> ReplicaInfo | None:
    try:
        stamp = float(fields["time"])
        return ReplicaInfo(
            node=node,
            version=int(fields["version"]),
            time=datetime.fromtimestamp(stamp, UTC),
            age_s=max(0.0, now - stamp),
            state_hash=fields.get("state_hash", ""),
            lease_s=_lease(fields.get("lease")),
        )
    except (KeyError, ValueError):
        return None  # expired (empty) or not written by report()


def _lease(raw: str | None) -> float:
    """A heartbeat's lease; the default for records written before leases, or garbled."""
    try:
        lease = float(raw) if raw else DEFAULT_LEASE_S
    except ValueError:
        return DEFAULT_LEASE_S
    return lease if lease > 0 else DEFAULT_LEASE_S


def min_live_version(client: redis.Redis, run: str, ttl_s: float = DEFAULT_TTL_S) -> int | None:
    """The lowest version a replica heard from within ``ttl_s`` holds; None if none is live."""
    versions = [r.version for r in list_replicas(client, run) if r.age_s <= ttl_s]
    return min(versions, default=None)


# --------------------------------------------------------------------------- locks


def _process_identity(pid: int) -> str | None:
    """``boot:pid-namespace:pid:start-time`` of a live process on this kernel (Linux), or
    None. The start time tells a reused pid apart; boot id and pid namespace tell
    processes in other containers or on other machines apart."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if len(fields) < 20:
        return None
    return f"{boot}:{namespace}:{pid}:{fields[19]}"


def process_token() -> str:
    """A lock holder's token: this process's identity and a random part, so that a
    process of this machine can tell the holder died (:func:`holder_is_dead`)."""
    me = _process_identity(os.getpid()) or f"-:-:{os.getpid()}:-"
    return f"{me}:{secrets.token_hex(16)}"


def release_dead_holder(client: redis.Redis, key: str) -> bool:
    """Delete the lock ``key`` if its value is a :func:`process_token` of a process of
    this machine that is gone, and still that value; True if deleted."""
    with redis_errors(client, f"reading lock {key}"):
        holder = _dead_holder(client, key)
        if holder is None:
            return False
        released = bool(scripts.RELEASE_LOCK(client, [key], holder))
    if released:
        log.warning("lock of a dead holder released", lock=key, holder=holder)
    return released


def _dead_holder(client: redis.Redis, key: str) -> str | None:
    """The token holding lock ``key`` when it names a process of this machine that is
    gone; None when the lock is free or its holder may be alive."""
    holder = _text_or_none(client.get(key))
    return holder if holder is not None and holder_is_dead(holder) else None


def holder_is_dead(token: str) -> bool:
    """True only when ``token`` names a process of this kernel and pid namespace that no
    longer exists; any doubt (another machine, no /proc) answers False."""
    parts = token.split(":")
    mine = _process_identity(os.getpid())
    if len(parts) != 5 or mine is None or not parts[2].isdigit():
        return False
    boot, namespace = mine.split(":")[:2]
    if parts[0] != boot or parts[1] != namespace:
        return False
    return _process_identity(int(parts[2])) != ":".join(parts[:4])


class RunLock:
    """A lock on ``deltasync:run:<run>:lock:<name>`` that expires after ``timeout_s``.

    Taken with SET NX PX and a token naming the holding process; released or
    extended only while the token is still ours, so a holder whose lock expired
    (and was taken by another) cannot release the new holder's lock. A lock
    whose holder died on this machine (a killed worker) is taken over at once
    instead of waiting for it to expire.
    """

    def __init__(self, client: redis.Redis, run: str, name: str, timeout_s: float) -> None:
        self.redis = client
        self.key = lock_key(run, name)
        self.timeout_ms = _ms(timeout_s)
        self.token = process_token()

    def acquire(self, wait_s: float = 0.0) -> bool:
        """Take the lock, polling for up to ``wait_s`` seconds; False if still held by another."""
        deadline = time.monotonic() + wait_s
        delay = 0.02
        while True:
            with redis_errors(self.redis, f"taking lock {self.key}"):
                if self.redis.set(self.key, self.token, nx=True, px=self.timeout_ms):
                    return True
                if self._take_over_dead_holder():
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.5)

    def _take_over_dead_holder(self) -> bool:
        holder = _dead_holder(self.redis, self.key)
        if holder is None:
            return False
        taken = bool(
            scripts.TAKE_OVER_LOCK(self.redis, [self.key], holder, self.token, self.timeout_ms)
        )
        if taken:
            log.warning("lock taken over from a dead holder", lock=self.key, holder=holder)
        return taken

    def release(self) -> bool:
        """Release if still ours; False if it had expired (and maybe been taken by another)."""
        with redis_errors(self.redis, f"releasing lock {self.key}"):
            return bool(scripts.RELEASE_LOCK(self.redis, [self.key], self.token))

    def extend(self, timeout_s: float | None = None) -> bool:
        """Restart the expiry (for long jobs); False if the lock is no longer ours."""
        ms = self.timeout_ms if timeout_s is None else _ms(timeout_s)
        with redis_errors(self.redis, f"extending lock {self.key}"):
            return bool(scripts.EXTEND_LOCK(self.redis, [self.key], self.token, ms))

    def owned(self) -> bool:
        with redis_errors(self.redis, f"reading lock {self.key}"):
            return _text_or_none(self.redis.get(self.key)) == self.token


class _Renewer:
    """Extends a lock every ``every_s`` on a daemon thread until stopped, so a short
    lease covers a long job and lapses soon after its holder vanishes."""

    def __init__(self, lock: RunLock, every_s: float) -> None:
        self.lock = lock
        self.every_s = every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="deltasync-lock", daemon=True)

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                if not self.lock.extend():
                    log.warning("lock lost while held", lock=self.lock.key)
                    return
            except DeltasyncError as exc:  # Redis away for a moment: try again
                log.warning("cannot extend lock", lock=self.lock.key, error=str(exc))

    def __enter__(self) -> _Renewer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


@contextlib.contextmanager
def run_lock(
    client: redis.Redis,
    run: str,
    name: str,
    timeout_s: float,
    *,
    wait_s: float | None = None,
    renew_every_s: float | None = None,
) -> Iterator[RunLock]:
    """Hold the lock ``name`` of ``run`` for the block; LockError if it stays taken.

    Waits for up to ``wait_s`` (default: ``timeout_s``, after which any
    holder's lock has expired) before giving up. With ``renew_every_s`` the
    lock is extended in the background while the block runs, so ``timeout_s``
    can be a short lease rather than the longest job.
    """
    lock = RunLock(client, run, name, timeout_s)
    if not lock.acquire(timeout_s if wait_s is None else wait_s):
        raise LockError(f"lock {lock.key} is held by another process")
    try:
        with contextlib.nullcontext() if renew_every_s is None else _Renewer(lock, renew_every_s):
            yield lock
    finally:
        try:
            released = lock.release()
        except DeltasyncError as exc:  # it expires on its own
            log.warning("cannot release lock", lock=lock.key, error=str(exc))
        else:
            if not released:
                log.warning("lock expired before release", lock=lock.key, timeout_s=timeout_s)


def lock_held(client: redis.Redis, run: str, name: str) -> bool:
    """Whether lock ``name`` of ``run`` is held by a process not known to be dead (one of
    this machine that died no longer holds it)."""
    with redis_errors(client, f"reading lock {name}"):
        holder = _text_or_none(client.get(lock_key(run, name)))
    return holder is not None and not holder_is_dead(holder)


def claim_once(client: redis.Redis, key: str, ttl_s: float, value: str = "1") -> bool:
    """True for the first caller to claim ``key`` within ``ttl_s``; False for every later one."""
    with redis_errors(client, f"claiming {key}"):
        return bool(client.set(key, value, nx=True, px=_ms(ttl_s)))


def _text_or_none(value: Any) -> str | None:
    return None if value is None else text(value)
