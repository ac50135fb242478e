"""rq queues, job ids and enqueueing, all with the JSON serializer (never pickle)."""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

import redis
from rq import Queue, Retry
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from pipeline import config
from pipeline.coord import keys

DIFF_QUEUE = keys.DIFF_QUEUE_NAME
COMPACT_QUEUE = keys.COMPACT_QUEUE_NAME

DIFF_JOB = "workers.jobs.diff.diff_job"
DIFF_PART_JOB = "workers.jobs.diff.diff_part_job"
COMPACT_JOB = "workers.jobs.compaction.compact_job"

# A field of rq's worker hash: the worker's lease (seconds), which status judges it by.
LEASE_FIELD = "deltasync_lease"

# Store or Redis hiccups: retried with backoff (needs a worker running its scheduler).
JOB_RETRY = Retry(max=3, interval=[2, 10, 30])
DIFF_TIMEOUT_S = config.DIFF_JOB_TIMEOUT_S
COMPACT_TIMEOUT_S = config.COMPACT_JOB_TIMEOUT_S


def queue(connection: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer)


def _id_part(text: str) -> str:
    """rq job ids take letters, digits, _ and -; run names may also hold dots."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if safe != text:
        safe += "_" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return safe


def diff_job_id(run: str, step: int) -> str:
    return f"diff-{_id_part(run)}-{step}"


def diff_part_job_id(run: str, step: int, part: str) -> str:
    return f"diffpart-{_id_part(run)}-{step}-{_id_part(part)}"


def diff_host_queue(host: str) -> str:
    """The queue of the part jobs routed to the diff workers of trainer host ``host``."""
    return keys.diff_host_queue(host)


def diff_queues(host: str | None) -> list[str]:
    """The queues a diff worker takes jobs from, its host's first."""
    return [DIFF_QUEUE] if host is None else [diff_host_queue(host), DIFF_QUEUE]


def enqueue_diff_part(
    connection: redis.Redis,
    run: str,
    step: int,
    checkpoint: str,
    part: str,
    parent: int,
    host: str | None = None,
    *,
    again: bool = False,
) -> str:
    """Queue one part of a parallel diff, ahead of waiting steps (they wait on it): on
    the queue of ``host``'s diff workers when the part is routed to a host. ``again``:
    one more job for a part whose first was lost (a job id of its own)."""
    job_id = diff_part_job_id(run, step, part)
    if again:
        job_id += f"-again-{secrets.token_hex(4)}"
    name = DIFF_QUEUE if host is None else diff_host_queue(host)
    queue(connection, name).enqueue_call(
        DIFF_PART_JOB,
        kwargs={
            "run": run,
            "step": step,
            "checkpoint": checkpoint,
            "part": part,
            "parent_version": parent,
        },
        job_id=job_id,
        timeout=DIFF_TIMEOUT_S,
        description=f"diff {run} step {step} {part}",
        at_front=True,
    )
    return job_id


def compact_job_id(run: str, version: int, requested_by: str) -> str:
    return f"compact-{_id_part(run)}-{version}-{_id_part(requested_by)}"


def enqueue_diff(
    connection: redis.Redis,
    kwargs: dict[str, Any],
    *,
    pipeline: redis.client.Pipeline | None = None,
) -> str:
    job_id = diff_job_id(kwargs["run"], kwargs["step"])
    queue(connection, DIFF_QUEUE).enqueue_call(
        DIFF_JOB,
        kwargs=kwargs,
        job_id=job_id,
        timeout=DIFF_TIMEOUT_S,
        retry=JOB_RETRY,
        description=f"diff {kwargs['run']} step {kwargs['step']}",
        pipeline=pipeline,
    )
    return job_id


def forget_failed_diff(connection: redis.Redis, run: str, step: int) -> None:
    """Take a step's failed diff job out of the failed registry before it is sent again
    (its job id is the step's)."""
    registry = FailedJobRegistry(queue=queue(connection, DIFF_QUEUE), serializer=JSONSerializer)
    registry.remove(diff_job_id(run, step))


def enqueue_compaction(
    connection: redis.Redis,
    run: str,
    version: int,
    reason: str,
    *,
    requested_by: str,
    pipeline: redis.client.Pipeline | None = None,
) -> str:
    job_id = compact_job_id(run, version, requested_by)
    queue(connection, COMPACT_QUEUE).enqueue_call(
        COMPACT_JOB,
        kwargs={"run": run, "version": version, "reason": reason},
        job_id=job_id,
        timeout=COMPACT_TIMEOUT_S,
        retry=JOB_RETRY,
        description=f"compact {run} {version} ({reason})",
        pipeline=pipeline,
    )
    return job_id
