"""Rollout nodes that fail to sync, and diff workers' damaged state caches, as
`deltasync status` shows them.

A heartbeat names the version a node holds, so a node that never bootstrapped (or
keeps failing) has none and would not show up. A failing node therefore also writes
``deltasync:run:<run>:failing:<node>``: its last error, the version it holds (if
any), how many syncs failed in a row, and since when (the Redis server's clock). The
record expires unless renewed by the next failure, and is removed at the node's next
successful sync.

A diff worker whose background scrub finds a state-cache tensor changed on disk
records it in ``deltasync:run:<run>:cache-damage`` (host -> the version, tensor,
time and how many so far); the record expires a week after the last finding.

A job a worker refuses to run (it names a function that is not one of deltasync's
jobs) is recorded in ``deltasync:refused-jobs``, a stream capped at MAX_REFUSED
entries, and announced as ``job-refused`` on every run's event stream.

A policy compaction that fails records ``deltasync:run:<run>:compaction-failed``: its
one-line reason, the failures in a row, and when it is tried next (the delay doubles
with each failure, up to a cap); a successful one removes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from dataclasses import fields as fields_of
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from pipeline.config import CACHE_DAMAGE_TTL_S, COMPACTION_FAILED_TTL_S
from pipeline.coord import scripts
from pipeline.coord.connection import redis_errors, text
from pipeline.coord.events import JobRefused, now_iso
from pipeline.coord.keys import (
    cache_damage_key,
    compaction_failed_key,
    failing_index_key,
    failing_key,
    refused_jobs_key,
)
from pipeline.coord.replicas import DEFAULT_TTL_S, node_records
from pipeline.coord.stream import EventStream, list_runs
from pipeline.errors import CorruptObjectError, DeltasyncError
from pipeline.format.bounded import MAX_REDIS_RECORD_BYTES, load_json

MAX_ERROR_CHARS = 2000
MAX_REFUSED = 1000  # refused-job records kept
MAX_REFUSED_CHARS = 300  # per field: a refused job's names are a stranger's text
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class FailingReplica:
    node: str
    held: int | None  # the version it holds, None before its first bootstrap
    error: str  # "ErrorType: message" of the last failed sync
    since: datetime  # first failure of this streak (the Redis server's clock)
    failing_for_s: float
    last_s_ago: float  # since the last failure
    failures: int  # failed syncs in a row


def _record(raw: bytes | str, key: str) -> Any:
    """A JSON record read from Redis, bounded in size and nesting (CorruptObjectError)."""
    return load_json(raw, max_bytes=MAX_REDIS_RECORD_BYTES, what=key, error=CorruptObjectError)


def report_failure(
    client: redis.Redis,
    run: str,
    node: str,
    held: int | None,
    error: str,
    *,
    ttl_s: float = DEFAULT_TTL_S,
) -> None:
    """Record that ``node``'s last sync failed with ``error``."""
    key = failing_key(run, node)
    held_text = "" if held is None else str(int(held))
    with redis_errors(client, f"reporting failing replica {node}"):
        scripts.REPORT_FAILURE(
            client,
            [key, failing_index_key(run)],
            node,
            held_text,
            error[:MAX_ERROR_CHARS],
            max(1, round(ttl_s * 1000)),
        )


def clear_failure(client: redis.Redis, run: str, node: str) -> None:
    """``node`` synced again: it is no longer failing."""
    with redis_errors(client, f"clearing failing replica {node}"), client.pipeline() as pipe:
        pipe.delete(failing_key(run, node))
        pipe.srem(failing_index_key(run), node)
        pipe.execute()


def list_failing(client: redis.Redis, run: str) -> list[FailingReplica]:
    """The nodes of ``run`` whose last sync failed (record not expired), by name."""
    return node_records(client, failing_index_key(run), lambda node: failing_key(run, node), _parse)


def _parse(node: str, fields: dict[str, str], now: float) -> FailingReplica | None:
    try:
        since = float(fields["since"])
        last = float(fields["last"])
        held = fields.get("held", "")
        return FailingReplica(
            node=node,
            held=int(held) if held else None,
            error=fields.get("error", ""),
            since=datetime.fromtimestamp(since, UTC),
            failing_for_s=max(0.0, now - since),
            last_s_ago=max(0.0, now - last),
            failures=int(fields.get("failures", "1")),
        )
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class CacheDamage:
    host: str  # the diff worker's host (its state cache)
    version: int  # the cached version
    tensor: str
    note: str
    time: str  # of the last finding (ISO 8601, UTC)
    count: int  # findings so far


def report_cache_damage(
    client: redis.Redis, run: str, host: str, version: int, tensor: str, note: str
) -> None:
    """Record that ``host``'s state cache of ``run`` held a damaged ``tensor``."""
    key = cache_damage_key(run)
    with redis_errors(client, f"reporting state-cache damage of {run}"):
        raw: Any = client.hget(key, host)
        try:
            count = int(_record(raw, key)["count"]) + 1 if raw else 1
        except (DeltasyncError, TypeError, KeyError, ValueError):
            count = 1
        doc = {
            "version": int(version),
            "tensor": tensor[:MAX_ERROR_CHARS],
            "note": note[:MAX_ERROR_CHARS],
            "time": now_iso(),
            "count": count,
        }
        with client.pipeline(transaction=True) as pipe:
            pipe.hset(key, host, json.dumps(doc, sort_keys=True))
            pipe.expire(key, round(CACHE_DAMAGE_TTL_S))
            pipe.execute()


def list_cache_damage(client: redis.Redis, run: str) -> list[CacheDamage]:
    """Damage the diff workers' scrubs found in their state caches of ``run``, by host."""
    key = cache_damage_key(run)
    with redis_errors(client, f"reading {key}"):
        raw: Any = client.hgetall(key)
    out: list[CacheDamage] = []
    for host, value in raw.items():
        try:
            doc = _record(value, key)
            out.append(
                CacheDamage(
                    text(host),
                    int(doc["version"]),
                    str(doc["tensor"]),
                    str(doc["note"]),
                    str(doc["time"]),
                    int(doc["count"]),
                )
            )
        except (DeltasyncError, ValueError, TypeError, KeyError):
            continue
    return sorted(out, key=lambda d: d.host)


@dataclass(frozen=True)
class RefusedJob:
    job_id: str
    queue: str
    function: str  # as the job named it (shortened, control characters replaced)
    reason: str  # one line
    worker: str
    time: str  # ISO 8601, UTC


def _line(value: object) -> str:
    line = _CONTROL.sub("?", str(value)) or "?"
    return line if len(line) <= MAX_REFUSED_CHARS else line[: MAX_REFUSED_CHARS - 3] + "..."


def report_refused_job(
    client: redis.Redis, *, job_id: str, queue: str, function: str, reason: str, worker: str
) -> RefusedJob:
    """Record that ``worker`` refused a job, and announce it on every run's stream."""
    found = RefusedJob(
        _line(job_id), _line(queue), _line(function), _line(reason), _line(worker), now_iso()
    )
    runs = list_runs(client)
    with (
        redis_errors(client, "recording a refused job"),
        client.pipeline(transaction=True) as pipe,
    ):
        doc = json.dumps(asdict(found), sort_keys=True)
        pipe.xadd(refused_jobs_key(), {"job": doc}, maxlen=MAX_REFUSED, approximate=False)
        for run in runs:
            event = JobRefused.now(
                run=run,
                version=0,
                job_id=found.job_id,
                queue=found.queue,
                function=found.function,
                reason=found.reason,
            )
            EventStream(client, run).publish(event, pipeline=pipe)
        pipe.execute()
    return found


def list_refused_jobs(client: redis.Redis, count: int = 5) -> tuple[int, list[RefusedJob]]:
    """How many refused jobs are recorded (at most MAX_REFUSED), and the last ``count``,
    newest first."""
    key = refused_jobs_key()
    with redis_errors(client, f"reading {key}"):
        total = int(client.xlen(key))
        entries: Any = client.xrevrange(key, count=count)
    out: list[RefusedJob] = []
    for _entry_id, fields in entries:
        try:
            doc = _record({text(k): v for k, v in fields.items()}["job"], key)
            out.append(RefusedJob(**{f.name: str(doc[f.name]) for f in fields_of(RefusedJob)}))
        except (DeltasyncError, ValueError, TypeError, KeyError):
            continue
    return total, out


@dataclass(frozen=True)
class CompactionFailure:
    version: int | None  # what it was to anchor (None: the head)
    reason: str  # one line: "ErrorType: message"
    failures: int  # in a row
    since: str  # the first of them (ISO 8601, UTC)
    time: str  # the last
    retry_in_s: float  # the delay before the next try, from ``time``
    retry_at: str


def record_compaction_failure(
    client: redis.Redis,
    run: str,
    version: int | None,
    reason: str,
    *,
    base_s: float,
    max_s: float,
) -> CompactionFailure:
    """Record one more failed policy compaction of ``run``; the next try waits
    ``base_s`` doubled for each failure in a row before this one, at most ``max_s``.
    Callers hold the run's compaction lock (one writer)."""
    previous = compaction_failure(client, run)
    failures = 1 if previous is None else previous.failures + 1
    delay = min(base_s * 2.0 ** min(failures - 1, 62), max_s)
    now = datetime.now(UTC)
    at = now.isoformat(timespec="seconds").replace("+00:00", "Z")
    failure = CompactionFailure(
        version=version,
        reason=reason[:MAX_ERROR_CHARS],
        failures=failures,
        since=at if previous is None else previous.since,
        time=at,
        retry_in_s=delay,
        retry_at=(now + timedelta(seconds=delay))
        .isoformat(timespec="seconds")
        .replace("+00:00", "Z"),
    )
    with redis_errors(client, f"recording the failed compaction of {run}"):
        client.set(
            compaction_failed_key(run),
            json.dumps(failure.__dict__, sort_keys=True),
            ex=round(COMPACTION_FAILED_TTL_S),
        )
    return failure


def compaction_failure(client: redis.Redis, run: str) -> CompactionFailure | None:
    """The run's last failed policy compaction, None once one succeeded (or never)."""
    with redis_errors(client, f"reading the failed compaction of {run}"):
        raw: Any = client.get(compaction_failed_key(run))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        version = doc["version"]
        return CompactionFailure(
            version=None if version is None else int(version),
            reason=str(doc["reason"]),
            failures=int(doc["failures"]),
            since=str(doc["since"]),
            time=str(doc["time"]),
            retry_in_s=float(doc["retry_in_s"]),
            retry_at=str(doc["retry_at"]),
        )
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


def clear_compaction_failure(client: redis.Redis, run: str) -> None:
    with redis_errors(client, f"clearing the failed compaction of {run}"):
        client.delete(compaction_failed_key(run))
