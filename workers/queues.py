"""rq queues, job ids and enqueueing, all with the JSON serializer (never pickle), and
the only functions jobs on these queues may name."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Retry
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from pipeline import config
from pipeline.coord import keys
from pipeline.errors import DeltasyncError

DIFF_QUEUE = keys.DIFF_QUEUE_NAME
COMPACT_QUEUE = keys.COMPACT_QUEUE_NAME

DIFF_JOB = "workers.jobs.diff.diff_job"
DIFF_PART_JOB = "workers.jobs.diff.diff_part_job"
COMPACT_JOB = "workers.jobs.compaction.compact_job"

# What each queue may carry: rq imports and calls whatever function a job names, so
# the workers refuse any other (JobWorker.execute_job) before importing anything.
DIFF_QUEUE_JOBS = frozenset({DIFF_JOB})
HOST_QUEUE_JOBS = frozenset({DIFF_PART_JOB})  # a trainer host's queue: part jobs only
COMPACT_QUEUE_JOBS = frozenset({COMPACT_JOB})
JOB_FUNCTIONS = DIFF_QUEUE_JOBS | HOST_QUEUE_JOBS | COMPACT_QUEUE_JOBS
_HOST_QUEUE = keys.DIFF_HOST_QUEUE.regex()

# A field of rq's worker hash: the worker's lease (seconds), which status judges it by.
LEASE_FIELD = "deltasync_lease"

# Store or Redis hiccups: retried with backoff (needs a worker running its scheduler).
JOB_RETRY = Retry(max=3, interval=[2, 10, 30])
DIFF_TIMEOUT_S = config.DIFF_JOB_TIMEOUT_S
COMPACT_TIMEOUT_S = config.COMPACT_JOB_TIMEOUT_S


def queue(connection: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer)


def jobs_of(queue_name: str) -> frozenset[str]:
    """The job functions ``queue_name`` may carry (none for a queue deltasync does not use)."""
    if queue_name == DIFF_QUEUE:
        return DIFF_QUEUE_JOBS
    if queue_name == COMPACT_QUEUE:
        return COMPACT_QUEUE_JOBS
    return HOST_QUEUE_JOBS if _HOST_QUEUE.fullmatch(queue_name) else frozenset()


def refusal(job: Job, queue_name: str) -> str | None:
    """Why a worker must not run ``job`` taken from ``queue_name`` (one line), or None.

    The function's name is checked as a string first: nothing is imported for a job
    that names anything else. deltasync's jobs have no callbacks or webhooks (rq would
    import those, or send requests to them)."""
    try:
        name, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError:
        return "job data is not JSON"
    if not isinstance(name, str) or name not in jobs_of(queue_name):
        shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:197] + "..."
        return f"function {shown} is not a deltasync job of queue {queue_name}"
    if instance is not None:
        return f"{name} called on an object"
    saved = job.to_dict(include_meta=False, include_result=False)
    hooks = [k for k in ("success", "failure", "stopped") if saved.get(f"{k}_callback_name")]
    if hooks or job.webhooks:
        return f"{name} with callbacks or webhooks ({', '.join(hooks) or 'webhooks'})"
    module, _, attr = name.rpartition(".")
    try:  # a deltasync job: safe to import; its arguments must fit (their values it checks)
        inspect.signature(getattr(importlib.import_module(module), attr)).bind(*args, **kwargs)
    except TypeError as exc:
        return f"{name}: arguments do not fit ({exc})"
    return None


class RefusedJobError(DeltasyncError):
    """A job names a function that is not one of deltasync's jobs."""


class DeltasyncJob(Job):  # type: ignore[misc]
    """rq's Job that resolves only deltasync's job functions and never a callback: the
    workers check each job (``refusal``) first; this holds wherever else rq reads them."""

    @property
    def func(self) -> Any:
        if self.func_name not in JOB_FUNCTIONS or self.instance is not None:
            raise RefusedJobError(f"function {self.func_name!r} is not a deltasync job")
        return super().func

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None


def _id_part(text: str) -> str:
    """rq job ids take letters, digits, _ and -; run names may also hold dots."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if safe != text:
        safe += "_" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return safe


@dataclass(frozen=True)
class DiffArgs:
    """A diff job's arguments (``diff_job``'s parameters). On the wire (the job's
    kwargs, a pending or set-aside step's record) they are :meth:`wire`'s JSON object.
    ``sharded``: ``checkpoint`` is the step folder of a sharded run's rank, whose
    ranks registered under trainer start ``launch``."""

    run: str
    step: int
    checkpoint: str
    owned: bool = False
    sharded: bool = False
    launch: str | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run,
            "step": self.step,
            "checkpoint": self.checkpoint,
            "owned": self.owned,
        }
        return {**out, "sharded": True, "launch": self.launch} if self.sharded else out

    @classmethod
    def parse(cls, run: str, step: int, raw: Mapping[str, Any]) -> DiffArgs:
        """Step ``step``'s recorded arguments (those of :meth:`wire` after run and step);
        KeyError without a checkpoint, TypeError for a value of the wrong type."""
        args = cls(
            run,
            step,
            raw["checkpoint"],
            raw.get("owned", False),
            raw.get("sharded", False),
            raw.get("launch"),
        )
        typed = (args.checkpoint, str), (args.owned, bool), (args.sharded, bool)
        if not all(isinstance(v, t) for v, t in typed) or not isinstance(args.launch, str | None):
            raise TypeError(f"step {step}: arguments of the wrong type")
        return args


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
    host: str,
    *,
    again: bool = False,
) -> str:
    """Queue one part of a sharded step on the queue of ``host``'s diff workers, ahead
    of waiting steps (they wait on it). ``again``: one more job for a part whose first
    was lost (a job id of its own)."""
    job_id = diff_part_job_id(run, step, part)
    if again:
        job_id += f"-again-{secrets.token_hex(4)}"
    queue(connection, diff_host_queue(host)).enqueue_call(
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
    args: DiffArgs,
    *,
    pipeline: redis.client.Pipeline | None = None,
) -> str:
    job_id = diff_job_id(args.run, args.step)
    queue(connection, DIFF_QUEUE).enqueue_call(
        DIFF_JOB,
        kwargs=args.wire(),
        job_id=job_id,
        timeout=DIFF_TIMEOUT_S,
        retry=JOB_RETRY,
        description=f"diff {args.run} step {args.step}",
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
