"""The diff lease of a run and the part jobs of sharded steps.

Every diff job takes the run's diff lease the same way: in line behind the
smaller steps waiting for it, helping with the in-flight fan-out of a sharded
step meanwhile (its own host's parts) instead of idling. The holder publishes
its step (a sharded step's coordinator calls the hosts' workers in with part
jobs on their host queues) and keeps the lease until the manifest is written,
so the next step never starts against an unpublished parent.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator

from pipeline import config
from pipeline.coord import keys
from pipeline.coord.hints import publish_part
from pipeline.coord.replicas import RunLock, _Renewer
from pipeline.errors import LockError
from pipeline.format.manifest import Manifest
from pipeline.logs import get_logger
from pipeline.publish.diff import DeltaTask
from pipeline.publish.ranks.fanout import CallIn, current_fanout
from pipeline.publish.ranks.sharded import HostSide, help_host, publish_sharded
from pipeline.publish.step import PublishResult
from pipeline.publish.version import PublishOptions
from workers import queues
from workers.runtime import Runtime

log = get_logger(__name__)

IDLE_S = 0.1


def work_on_part(
    runtime: Runtime, run: str, step: int, checkpoint: str, part: str, parent: int
) -> int:
    """Encode ``part`` (then any other free part) of the fan-out of ``step``, if it is
    still in flight; the number of parts this call encoded."""
    fanout = current_fanout(runtime.redis, run)
    wanted = (step, parent, checkpoint)
    if fanout is None or (fanout.step, fanout.parent, fanout.checkpoint) != wanted:
        log.info("part job has nothing to do", part=part)
        return 0
    return _help(runtime, fanout, first=part)


def _help(runtime: Runtime, fanout: DeltaTask, first: str | None = None) -> int:
    """A host's ranks' parts, by its workers only (an unsharded fan-out, left by an
    older release, is nobody's to help with)."""
    side = host_side(runtime) if fanout.sharded else None
    return 0 if side is None else help_host(side, fanout, first=first)


def host_side(runtime: Runtime) -> HostSide | None:
    """What this worker works with for a sharded run's parts: None unless it serves a
    trainer host (``DELTASYNC_DIFF_HOST``)."""
    settings = runtime.settings
    if settings.diff_host is None:
        return None
    return HostSide(
        runtime.redis,
        runtime.store,
        settings.diff_host,
        settings.staging_dir,
        settings.cache_dir,
        settings.part_bytes,
        lambda hint: publish_part(runtime.redis, hint),
    )


def _call_in(runtime: Runtime, again: bool) -> CallIn:
    """Part jobs on each part's host queue. ``again`` (a part nobody holds, called in
    once more): only on a host queue that is empty, since any job a host's worker
    takes has it sweep every free part of that host."""

    def call_in(task: DeltaTask, parts: list[tuple[str, str]]) -> None:
        busy = {
            host
            for host in {h for _, h in parts}
            if again and queues.queue(runtime.redis, queues.diff_host_queue(host)).count > 0
        }
        for key, host in parts:
            if host in busy:
                continue
            queues.enqueue_diff_part(
                runtime.redis,
                task.run,
                task.step,
                task.checkpoint,
                key,
                task.parent,
                host,
                again=again,
            )

    return call_in


def publish_sharded_step(
    runtime: Runtime,
    run: str,
    step: int,
    checkpoint: str,
    options: PublishOptions,
    on_published: Callable[[Manifest], None],
    launch: str | None = None,
) -> PublishResult:
    """The coordinator of a sharded step (see :mod:`pipeline.publish.ranks.sharded`); it works
    its own host's parts when it serves one. ``launch``: the trainer start whose ranks
    count."""
    side = host_side(runtime)
    return publish_sharded(
        runtime.redis,
        runtime.store,
        run,
        step,
        checkpoint,
        options,
        call_in=_call_in(runtime, again=False),
        call_again=_call_in(runtime, again=True),
        work_here=None if side is None else functools.partial(help_host, side),
        wait_s=runtime.settings.sharded_part_wait_s,
        on_published=on_published,
        launch=launch,
    )


class _Line:
    """Diff jobs of a run waiting for its lease, smallest step first: a job whose
    lease key lapsed (its worker died) no longer holds up the steps after it."""

    LEASE_MS = round(config.DIFF_LINE_LEASE_S * 1000)

    def __init__(self, runtime: Runtime, run: str, step: int) -> None:
        self.redis, self.run, self.step = runtime.redis, run, step
        self.key = keys.diff_waiting_key(run)

    def join(self) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self.key, {str(self.step): self.step})
            pipe.set(keys.diff_waiting_lease_key(self.run, self.step), 1, px=self.LEASE_MS)
            pipe.execute()

    def first(self) -> bool:
        for raw in self.redis.zrangebyscore(self.key, "-inf", self.step - 1):
            member = raw.decode() if isinstance(raw, bytes) else str(raw)
            if member.isdigit() and self.redis.exists(
                keys.diff_waiting_lease_key(self.run, int(member))
            ):
                return False
            self.redis.zrem(self.key, member)
        return True

    def leave(self) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.key, str(self.step))
            pipe.delete(keys.diff_waiting_lease_key(self.run, self.step))
            pipe.execute()


@contextlib.contextmanager
def diff_lease(runtime: Runtime, run: str, step: int) -> Iterator[None]:
    """Hold the run's diff lease for the block, taken once no smaller step waits for
    it (helping the in-flight fan-out meanwhile); LockError after ``config.DIFF_LOCK_WAIT_S``."""
    lock = RunLock(runtime.redis, run, "diff", config.LOCK_LEASE_S)
    line = _Line(runtime, run, step)
    deadline = time.monotonic() + config.DIFF_LOCK_WAIT_S
    try:
        while True:
            line.join()
            if line.first() and lock.acquire(0.05):
                break
            if time.monotonic() > deadline:
                raise LockError(f"lock {lock.key} is held by another process")
            fanout = current_fanout(runtime.redis, run)
            if fanout is None or _help(runtime, fanout) == 0:
                time.sleep(IDLE_S)
        try:
            with _Renewer(lock, config.LOCK_RENEW_S):
                yield
        finally:
            lock.release()
    finally:
        line.leave()
