"""The compaction job: turn a delta chain into an anchor, then collect garbage."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from rq import get_current_job

from pipeline import config, metrics
from pipeline.coord import keys, problems
from pipeline.coord.events import AnchorAvailable
from pipeline.coord.replicas import min_live_version, run_lock
from pipeline.errors import CorruptObjectError
from pipeline.format.manifest import Manifest, manifest_key
from pipeline.logs import bind_context, get_logger
from pipeline.publish import dead_letters
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.repair import skip_to_proven
from pipeline.publish.version import PublishOptions
from pipeline.testing import faults
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from workers import queues
from workers.jobs.diff import current_job_id, policy_reason, publish_once
from workers.runtime import Runtime, current

log = get_logger(__name__)


MANUAL = "manual"  # the reason of a compaction asked for by hand (`deltasync compact`)


def compact_job(
    run: str, version: int | None = None, reason: str = MANUAL, attempt: int = 0
) -> dict[str, Any]:
    """rq entry point; arguments are JSON. Returns a JSON summary. ``attempt``: how
    many policy compactions of the run failed in a row before this try (see
    :func:`_failed`); a try with nothing left to do (a repair or another compaction
    made the chain short) ends the streak."""
    runtime = current()
    bind_context(run=run, version=version, job_id=current_job_id())
    policy = reason != MANUAL
    try:
        if attempt and not _still_asked(runtime, run):
            _ended(runtime, run)
            log.info("policy compaction no longer needed", attempt=attempt)
            return {"run": run, "anchor": None, "skipped": "the policy no longer asks"}
        summary = _compact(runtime, run, version, reason)
    except Exception as exc:
        if policy:
            _failed(runtime, run, version, reason, exc)
        raise
    if policy:
        _ended(runtime, run)
    else:
        runtime.redis.delete(keys.compaction_pending_key(run))
    return summary


def _compact(runtime: Runtime, run: str, version: int | None, reason: str) -> dict[str, Any]:
    settings = runtime.settings
    run_binding.check_store(runtime.redis, run, runtime.store)  # one store per run
    with run_lock(
        runtime.redis,
        run,
        "compact",
        timeout_s=config.LOCK_LEASE_S,
        wait_s=config.COMPACT_LOCK_WAIT_S,
        renew_every_s=config.LOCK_RENEW_S,
    ):
        try:
            manifest = compact(runtime.store, run, version, PublishOptions.from_settings(settings))
        except CorruptObjectError as exc:
            manifest = _past_damage(runtime, run, exc)
            reason = f"{reason}, past damage"
        metrics.published(run, "anchor", manifest.total_bytes, None)
        faults.point("compact.before_event")
        r = runtime.redis
        announce_anchor(runtime, manifest, reason)
        faults.point("compact.before_gc")
        live = min_live_version(r, run, settings.replica_ttl_s)
        deleted = collect_garbage(runtime.store, run, settings.keep_anchors, live)
    log.info("compaction done", anchor=manifest.version, deleted=len(deleted), oldest_live=live)
    return {
        "run": run,
        "anchor": manifest.version,
        "bytes": manifest.total_bytes,
        "deleted": len(deleted),
        "oldest_live_replica": live,
    }


def _still_asked(runtime: Runtime, run: str) -> bool:
    """Whether the policy still asks for a compaction of the run's head."""
    head = chain.list_versions(runtime.store, run).head
    return head is not None and policy_reason(runtime, run, head) is not None


def _ended(runtime: Runtime, run: str) -> None:
    """No policy compaction of the run is due: the next step may ask for one."""
    problems.clear_compaction_failure(runtime.redis, run)
    runtime.redis.delete(keys.compaction_pending_key(run))


def _failed(
    runtime: Runtime, run: str, version: int | None, reason: str, exc: BaseException
) -> None:
    """A policy compaction failed. A service hiccup with rq retries left is rq's to
    retry (seconds apart). Otherwise the failure is recorded for `deltasync status`
    with its one-line reason, and the run's head is tried again after
    DELTASYNC_COMPACT_RETRY seconds, doubled for each failure in a row (at most
    ``config.COMPACT_RETRY_MAX_S``). Until then the run stays claimed, so that steps do
    not ask again meanwhile; before, a failure held the claim for an hour with
    nothing said. Recording never hides the job's own error."""
    job = get_current_job()
    if dead_letters.is_transient(exc) and job is not None and job.should_retry:
        return
    if job is not None:
        job.retries_left = 0  # the same error seconds later: the backoff below instead
    try:
        failure = problems.record_compaction_failure(
            runtime.redis,
            run,
            version,
            dead_letters.reason_of(exc),
            base_s=runtime.settings.compact_retry_s,
            max_s=config.COMPACT_RETRY_MAX_S,
        )
        delay = failure.retry_in_s
        r = runtime.redis
        r.set(keys.compaction_pending_key(run), 1, ex=round(delay + config.POLICY_PENDING_TTL_S))
        queues.queue(r, queues.COMPACT_QUEUE).enqueue_in(
            timedelta(seconds=delay),
            queues.COMPACT_JOB,
            kwargs={"run": run, "version": None, "reason": reason, "attempt": failure.failures},
            job_id=f"{queues.compact_job_id(run, 0, 'policy')}-retry-{failure.failures}",
            job_timeout=queues.COMPACT_TIMEOUT_S,
            retry=queues.JOB_RETRY,
            description=f"compact {run} head ({reason}), try {failure.failures + 1}",
        )
    except Exception as record_exc:  # Redis away: rq records the job's failure anyway
        log.warning("failed compaction not recorded", error=str(record_exc))
        return
    log.warning(
        "policy compaction failed, tried again later",
        reason=failure.reason,
        failures=failure.failures,
        retry_in_s=delay,
    )


def announce_anchor(runtime: Runtime, manifest: Manifest, reason: str) -> None:
    """``anchor-available`` for a new anchor, once per version."""
    event = AnchorAvailable.now(
        run=manifest.run,
        version=manifest.version,
        bytes=manifest.total_bytes,
        manifest=manifest_key(manifest.run, "anchor", manifest.version),
        reason=reason,
    )
    publish_once(runtime, keys.anchored_key(manifest.run, manifest.version), event)


def _past_damage(runtime: Runtime, run: str, exc: CorruptObjectError) -> Manifest:
    """The chain to compact is damaged: anchor the diff worker's later, proven version
    instead (when its state cache is on this machine), else fail naming the way out."""
    settings = runtime.settings
    repaired = skip_to_proven(
        runtime.store,
        run,
        StateCache(settings.cache_dir, run),
        PublishOptions.from_settings(settings),
    )
    if repaired is None or repaired.anchor is None:
        raise CorruptObjectError(
            f"{exc}; `deltasync repair --run {run} [--from CHECKPOINT]` makes the run "
            "reachable again"
        ) from exc
    log.warning("compaction skipped past damage", run=run, detail=repaired.describe())
    return repaired.anchor
