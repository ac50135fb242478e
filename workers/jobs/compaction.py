"""The compaction job: turn a delta chain into an anchor, then collect garbage."""

from __future__ import annotations

from typing import Any

from rq import get_current_job

from pipeline import config, metrics
from pipeline.coord import keys
from pipeline.coord.events import AnchorAvailable
from pipeline.coord.replicas import min_live_version, run_lock
from pipeline.errors import CorruptObjectError
from pipeline.format.manifest import Manifest, manifest_key
from pipeline.logs import bind_context, get_logger
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.repair import skip_to_proven
from pipeline.publish.state_cache import StateCache
from pipeline.testing import faults
from pipeline.versions import binding as run_binding
from workers.jobs.diff import publish_once
from workers.runtime import Runtime, current

log = get_logger(__name__)


def compact_job(run: str, version: int | None = None, reason: str = "manual") -> dict[str, Any]:
    """rq entry point; arguments are JSON. Returns a JSON summary."""
    runtime = current()
    settings = runtime.settings
    job = get_current_job()
    bind_context(run=run, version=version, job_id=job.id if job else None)
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
            manifest = compact(
                runtime.store,
                run,
                version,
                signing_key=settings.signing_key(),
                anchor_compression=settings.anchor_compression,
            )
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
    runtime.redis.delete(keys.compaction_pending_key(run))
    log.info("compaction done", anchor=manifest.version, deleted=len(deleted), oldest_live=live)
    return {
        "run": run,
        "anchor": manifest.version,
        "bytes": manifest.total_bytes,
        "deleted": len(deleted),
        "oldest_live_replica": live,
    }


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
        signing_key=settings.signing_key(),
        anchor_compression=settings.anchor_compression,
    )
    if repaired is None or repaired.anchor is None:
        raise CorruptObjectError(
            f"{exc}; `deltasync repair --run {run} [--from CHECKPOINT]` makes the run "
            "reachable again"
        ) from exc
    log.warning("compaction skipped past damage", run=run, detail=repaired.describe())
    return repaired.anchor
