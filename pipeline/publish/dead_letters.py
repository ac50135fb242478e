"""Steps that cannot be published, kept aside with a one-line reason.

A step whose own input is bad (an unreadable or malformed checkpoint, a folder the
worker cannot enter, a head it cannot verify) is moved from the run's pending steps
to its dead-letter hash, ``deltasync:run:<run>:dead-steps`` (step -> JSON with the
reason), and announced with a ``step-failed`` event; later steps publish. Transient
service errors (the store, Redis, a lock) are not dead letters: the job is retried.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.coord.connection import redis_errors
from pipeline.coord.events import StepFailed, now_iso
from pipeline.coord.keys import dead_steps_key
from pipeline.coord.stream import EventStream
from pipeline.errors import (
    CorruptObjectError,
    DeltasyncError,
    LockError,
    ServiceUnavailableError,
    StoreError,
)
from pipeline.format.bounded import MAX_REDIS_RECORD_BYTES, load_json
from pipeline.versions.binding import StoreBindingError

MAX_REASON = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
TRANSIENT: tuple[type[BaseException], ...] = (
    StoreError,
    ServiceUnavailableError,
    LockError,
    redis.RedisError,
    StoreBindingError,  # the worker's configuration, not the step, is at fault
)


class PoisonStepError(DeltasyncError):
    """A step failed for a reason of its own and was moved to the dead letters."""


@dataclass(frozen=True)
class DeadStep:
    step: int
    reason: str
    checkpoint: str
    time: str
    args: dict[str, Any] | None = None  # the step's diff job arguments, to send it again


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT)


def reason_of(exc: BaseException) -> str:
    """One line: the error's type and the first line of its message, shortened."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = _CONTROL.sub("?", f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."


def record(
    client: redis.Redis,
    run: str,
    step: int,
    checkpoint: str,
    exc: BaseException,
    pending_key: str,
    *,
    args: dict[str, Any] | None = None,
) -> str:
    """Move ``step`` from ``pending_key`` to the dead letters and announce it; returns the
    reason. Idempotent per step (a retry records the same step once). ``args``: the
    step's diff job arguments, kept so that ``deltasync retry`` can send it again."""
    reason = reason_of(exc)
    where = _CONTROL.sub("?", checkpoint[:500]) or "?"
    doc: dict[str, Any] = {"reason": reason, "checkpoint": where, "time": now_iso()}
    if args is not None:
        doc["args"] = args
    event = StepFailed.now(run=run, version=step, reason=reason, checkpoint=where)
    with redis_errors(client, f"recording dead step {step} of {run}"):
        if client.hexists(dead_steps_key(run), str(step)):  # a retry of the same step
            client.hdel(pending_key, str(step))
            return reason
        with client.pipeline(transaction=True) as pipe:
            EventStream(client, run).publish(event, pipeline=pipe)
            pipe.hset(dead_steps_key(run), str(step), json.dumps(doc))
            pipe.hdel(pending_key, str(step))
            pipe.execute()
    return reason


def list_dead(client: redis.Redis, run: str) -> list[DeadStep]:
    """The run's dead steps, oldest step first (malformed entries are shown as such)."""
    with redis_errors(client, f"reading dead steps of {run}"):
        raw = client.hgetall(dead_steps_key(run))
    out: list[DeadStep] = []
    for key, value in raw.items():
        try:
            step = int(key)
            doc = load_json(
                value,
                max_bytes=MAX_REDIS_RECORD_BYTES,
                what=f"dead step {step}",
                error=CorruptObjectError,
            )
            args = doc.get("args")
            out.append(
                DeadStep(
                    step,
                    str(doc["reason"]),
                    str(doc["checkpoint"]),
                    str(doc["time"]),
                    args if isinstance(args, dict) else None,
                )
            )
        except (DeltasyncError, ValueError, TypeError, KeyError, AttributeError):
            continue
    return sorted(out, key=lambda d: d.step)
