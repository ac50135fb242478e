"""The parallel diff mode (``DELTASYNC_PARALLEL_PARTS``): coordinator and helpers.

The coordinator holds the run's diff lease from the fan-out until the manifest
is written, so the next step never starts against an unpublished parent. A job
waiting for that lease helps with the in-flight fan-out instead of idling, and
part jobs (queued ahead of waiting steps) bring idle workers in.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.coord.replicas import RunLock, _Renewer
from pipeline.errors import DeltasyncError, LockError, MismatchError
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.manifest import Kind
from pipeline.format.manifest_parse import check_tensor_name
from pipeline.format.tensors import check_tensors
from pipeline.logs import get_logger
from pipeline.publish.parallel import (
    Fanout,
    assemble,
    current_fanout,
    end_fanout,
    parts_key,
    start_fanout,
    work_parts,
)
from pipeline.publish.state_cache import StateCache
from pipeline.publish.step import PublishResult, publish_step
from pipeline.versions import chain
from workers import queues
from workers.runtime import Runtime

log = get_logger(__name__)

LOCK_LEASE_S = 60.0
LOCK_RENEW_S = 15.0
LOCK_WAIT_S = 3600.0
IDLE_S = 0.1


def work_on_part(
    runtime: Runtime, run: str, step: int, checkpoint: str, part: str, parent: int
) -> int:
    """Encode ``part`` (then any other free part) of the fan-out of ``step``, if it is
    still in flight; the number of parts this call encoded."""
    fanout = current_fanout(runtime.redis, run)
    if fanout is None or (fanout.step, fanout.parent, fanout.checkpoint) != (
        step,
        parent,
        checkpoint,
    ):
        log.info("part job has nothing to do", part=part)
        return 0
    return _help(runtime, fanout, first=part)


def _help(runtime: Runtime, fanout: Fanout, first: str | None = None) -> int:
    """Best effort: whatever a helper fails to do, the coordinator does itself."""
    try:
        manifest = chain.load_manifest(runtime.store, fanout.run, fanout.parent_kind, fanout.parent)
        cache = StateCache(runtime.settings.cache_dir, fanout.run)
        return work_parts(runtime.redis, runtime.store, cache, fanout, manifest, first=first)
    except (DeltasyncError, OSError) as e:
        # The fan-out ended under us (checkpoint removed, cache advanced) or the cache
        # is damaged: the coordinator sees the same and acts on it.
        log.info("cannot help with the fan-out", version=fanout.step, error=str(e))
        return 0


def _waiting_key(run: str) -> str:
    return f"deltasync:run:{run}:diff-waiting"


class _Line:
    """Diff jobs of a run waiting for its lease, smallest step first: a job whose
    lease key lapsed (its worker died) no longer holds up the steps after it."""

    LEASE_MS = 30_000

    def __init__(self, runtime: Runtime, run: str, step: int) -> None:
        self.redis, self.key, self.step = runtime.redis, _waiting_key(run), step

    def join(self) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self.key, {str(self.step): self.step})
            pipe.set(f"{self.key}:{self.step}", 1, px=self.LEASE_MS)
            pipe.execute()

    def first(self) -> bool:
        for raw in self.redis.zrangebyscore(self.key, "-inf", self.step - 1):
            member = raw.decode() if isinstance(raw, bytes) else str(raw)
            if self.redis.exists(f"{self.key}:{member}"):
                return False
            self.redis.zrem(self.key, member)
        return True

    def leave(self) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.key, str(self.step))
            pipe.delete(f"{self.key}:{self.step}")
            pipe.execute()


def publish_step_parallel(
    runtime: Runtime, run: str, step: int, checkpoint: Path, level: int
) -> PublishResult:
    """Take the run's diff lease once no smaller step waits for it (helping the
    in-flight fan-out meanwhile) and publish ``step``."""
    lock = RunLock(runtime.redis, run, "diff", LOCK_LEASE_S)
    line = _Line(runtime, run, step)
    deadline = time.monotonic() + LOCK_WAIT_S
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
            with _Renewer(lock, LOCK_RENEW_S):
                return _coordinate(runtime, run, step, checkpoint, level)
        finally:
            lock.release()
    finally:
        line.leave()


def _coordinate(
    runtime: Runtime, run: str, step: int, checkpoint: Path, level: int
) -> PublishResult:
    settings, store, r = runtime.settings, runtime.store, runtime.redis
    cache = StateCache(settings.cache_dir, run)
    index = chain.list_versions(store, run)
    head = index.head
    if head is None or step <= head:
        # The first anchor, or a step already published or stale: the single-job path.
        return publish_step(
            store,
            run,
            step,
            checkpoint,
            cache,
            level=level,
            signing_key=settings.signing_key(),
            part_bytes=settings.part_bytes,
            anchor_compression=settings.anchor_compression,
            content_hash=settings.content_hash,
        )
    started = time.perf_counter()
    parent_kind: Kind = "anchor" if head in index.anchors else "delta"
    parent = chain.load_manifest(store, run, parent_kind, head)
    with CheckpointReader(checkpoint) as new:
        for name in new.names():
            check_tensor_name(name, f"checkpoint {new.path}")
        check_tensors(parent, new.specs(), holder=f"checkpoint {new.path}", complete=True)
        if not cache.is_valid_for(parent):
            log.info("state cache is stale, rebuilding", run=run, head=head, cached=cache.version)
            cache.rebuild(store, run, head)
        fanout = Fanout(run, step, str(checkpoint), head, parent_kind, level)
        start_fanout(r, fanout)
        parts = parent.parts()
        for key, _ in parts:
            queues.enqueue_diff_part(r, run, step, str(checkpoint), key, head)
        while r.hlen(parts_key(run, step, head)) < len(parts):
            try:
                if work_parts(r, store, cache, fanout, parent) == 0:
                    time.sleep(IDLE_S)
            except MismatchError as e:
                # The cache claimed the head's state but its bytes disagree: rebuild.
                log.warning("state cache is damaged, rebuilding", run=run, error=str(e))
                cache.rebuild(store, run, head)
        manifest = assemble(r, store, fanout, parent, settings.signing_key())
        end_fanout(r, fanout)
        cache.advance(new, manifest)
    return PublishResult.published(
        manifest, head, {"total_s": round(time.perf_counter() - started, 4)}
    )
