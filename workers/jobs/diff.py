"""The diff job: publish one trainer step as the run's next version."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import redis
from rq import get_current_job

from pipeline import config, metrics
from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.events import CompactionRequested, DeltaAvailable, Event
from pipeline.coord.hints import publish_part
from pipeline.coord.replicas import claim_once
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, DeltasyncError, EventError
from pipeline.format.bounded import MAX_REDIS_RECORD_BYTES, load_json
from pipeline.format.manifest import Kind, Manifest, manifest_key
from pipeline.logs import bind_context, get_logger
from pipeline.publish import dead_letters
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.testing import faults
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from pipeline.versions.policy import ChainTally, tally
from workers import metrics_http, queues
from workers.jobs import sharded_diff
from workers.runtime import Runtime, current

log = get_logger(__name__)


def publish_once(runtime: Runtime, marker: str, event: Event) -> None:
    """Append ``event`` unless ``marker`` says it was; event and marker in one MULTI,
    which WATCHes the marker: of two workers announcing the same version at once, the
    second finds the marker set and appends nothing."""
    r = runtime.redis
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(marker)  # type: ignore[no-untyped-call]
                if pipe.exists(marker):
                    return
                pipe.multi()
                EventStream(r, event.run).publish(event, pipeline=pipe)
                pipe.set(marker, 1, ex=config.ANNOUNCED_TTL_S)
                pipe.execute()
                return
            except redis.WatchError:
                continue  # set meanwhile: the check above now returns


def announce(runtime: Runtime, manifest: Manifest) -> None:
    """Publish ``delta-available`` for a version, at most once per version."""
    event = DeltaAvailable.now(
        run=manifest.run,
        version=manifest.version,
        kind=manifest.kind,
        parent=manifest.parent,
        anchor=manifest.anchor,
        bytes=manifest.total_bytes,
        changed=sum(t.changed for t in manifest.tensors),
        total=sum(t.numel for t in manifest.tensors),
        manifest=manifest_key(manifest.run, manifest.kind, manifest.version),
    )
    publish_once(runtime, keys.announced_key(manifest.run, manifest.version), event)


def announce_parent(runtime: Runtime, manifest: Manifest) -> None:
    """Announce the parent of ``manifest`` if it was emitted and nobody announced it: a
    worker killed between a version's manifest and its event leaves it unannounced until
    rq retries its job (the job timeout later), so the next version announces it first
    and events stay in order. Versions published without an emit stay unannounced."""
    parent = manifest.parent
    if parent is None:
        return
    emitted = keys.emitted_key(manifest.run, parent)  # set by workers.trainers.trainer
    if not runtime.redis.exists(emitted) or runtime.redis.exists(
        keys.announced_key(manifest.run, parent)
    ):
        return
    deltas = chain.list_versions(runtime.store, manifest.run).deltas
    kind: Kind = "delta" if parent in deltas else "anchor"
    announce(runtime, chain.load_manifest(runtime.store, manifest.run, kind, parent))
    log.warning("announced a version its worker did not", version=parent)


def current_job_id() -> str | None:
    job = get_current_job()
    return job.id if job is not None else None


# (store, run) -> the chain tally of the last version this process asked the policy
# about: the next step's tally follows from it and the step's manifest.
_tallies: dict[tuple[str, str], ChainTally] = {}


def policy_reason(
    runtime: Runtime, run: str, version: int, published: Manifest | None = None
) -> str | None:
    """Why the compaction policy asks for an anchor at ``version`` (None: it does not);
    ``published``: the manifest this process just wrote for it."""
    store = runtime.store
    where = (store.url, run)
    found = tally(store, run, version, last=_tallies.get(where), published=published)
    if found is None:
        _tallies.pop(where, None)
        return None
    _tallies[where] = found
    return found.reason(runtime.settings.max_chain, runtime.settings.max_delta_fraction)


def diff_job(
    run: str,
    step: int,
    checkpoint: str,
    owned: bool = False,
    sharded: bool = False,
    launch: str | None = None,
) -> dict[str, Any]:
    """rq entry point; arguments are JSON. Returns a JSON summary. ``sharded``: the step
    was staged by the ranks of a sharded trainer (``checkpoint`` names the step folder
    of the rank that completed it, see :class:`workers.queues.DiffArgs`); this job
    coordinates its parts across the hosts.

    Steps emitted before ``step`` and not yet published go first, in order: with
    several diff workers the job of a later step may start first, and would
    otherwise leave the earlier step behind the head (skipped as stale).
    """
    runtime = current()
    pending = keys.pending_steps_key(run)
    for earlier in _earlier_pending(runtime, run, step):
        try:
            _diff_one(runtime, earlier)
        except Exception as exc:
            if dead_letters.is_transient(exc):
                raise  # the services are the problem: this job is retried as a whole
            if published_meanwhile(runtime, run, earlier.step, exc):
                continue
            # That step's own input is bad: set aside, so that later steps publish.
            reason = dead_letters.record(
                runtime.redis,
                run,
                earlier.step,
                earlier.checkpoint,
                exc,
                pending,
                args=earlier.wire(),
            )
            log.warning("earlier step set aside", step=earlier.step, reason=reason)
    args = queues.DiffArgs(run, step, checkpoint, owned, sharded, launch)
    try:
        return _diff_one(runtime, args)
    except Exception as exc:
        if dead_letters.is_transient(exc):
            raise
        if published_meanwhile(runtime, run, step, exc):
            return {"run": run, "version": step, "status": "skipped", "reason": "already published"}
        metrics.refused(run, "diff", exc)
        reason = dead_letters.record(
            runtime.redis, run, step, str(checkpoint), exc, pending, args=args.wire()
        )
        raise dead_letters.PoisonStepError(
            f"step {step} of run {run} set aside: {reason} (once its cause is fixed: "
            f"`deltasync retry --run {run} --step {step}`)"
        ) from None


def published_meanwhile(runtime: Runtime, run: str, step: int, exc: BaseException) -> bool:
    """True when the store (the truth) holds ``step`` although this job failed on it:
    another worker published it meanwhile (this one was paused past its lease, say).
    Such a step is no dead letter. A store that cannot be read raises (the job is
    retried) rather than a step-failed written on a guess."""
    if step not in chain.list_versions(runtime.store, run).versions:
        return False
    log.warning(
        "step failed here but is published: not set aside",
        step=step,
        error=dead_letters.reason_of(exc),
    )
    runtime.redis.hdel(keys.pending_steps_key(run), str(step))
    return True


def _earlier_pending(runtime: Runtime, run: str, step: int) -> list[queues.DiffArgs]:
    out: list[queues.DiffArgs] = []
    for key, raw in runtime.redis.hgetall(keys.pending_steps_key(run)).items():
        try:
            earlier = int(key)
            args = load_json(
                raw, max_bytes=MAX_REDIS_RECORD_BYTES, what="pending step", error=EventError
            )
            if "checkpoint" in args:
                out.append(queues.DiffArgs.parse(run, earlier, args))
        except (DeltasyncError, ValueError, TypeError, KeyError) as exc:
            log.warning("malformed pending step set aside", run=run, entry=str(key)[:40])
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            if name.isdigit() and int(name) < step:
                dead_letters.record(
                    runtime.redis, run, int(name), "?", exc, keys.pending_steps_key(run)
                )
            else:
                runtime.redis.hdel(keys.pending_steps_key(run), key)
    return sorted((a for a in out if a.step < step), key=lambda a: a.step)


def _diff_one(runtime: Runtime, args: queues.DiffArgs) -> dict[str, Any]:
    run, step, sharded = args.run, args.step, args.sharded
    settings = runtime.settings
    bind_context(run=run, version=step, job_id=current_job_id())
    path = Path(args.checkpoint)
    if not sharded:  # a sharded step's folders are on its hosts, each checks its own
        check_checkpoint_root(settings, run, path)
    # Only deltasync's own staging copies are moved or removed; never a user's checkpoint.
    # A sharded step's folders are its hosts' (they adopt or remove them).
    staged = (
        args.owned
        and not sharded
        and not settings.keep_staging
        and is_own_staging(settings, run, step, path)
    )

    announced: list[int] = []

    def published(manifest: Manifest) -> None:
        runtime.redis.hdel(keys.pending_steps_key(run), str(step))
        runtime.redis.hdel(keys.dead_steps_key(run), str(step))  # set aside before
        faults.point("diff.before_announce")
        announce_parent(runtime, manifest)
        announce(runtime, manifest)
        announced.append(manifest.version)
        faults.point("diff.after_announce")

    options = PublishOptions.from_settings(settings)
    # One store per run; a signing publisher signs the run's record too.
    run_binding.bind_store(runtime.redis, run, runtime.store, options.signing_key)
    with sharded_diff.diff_lease(runtime, run, step):
        if sharded:
            result = sharded_diff.publish_sharded_step(
                runtime, run, step, args.checkpoint, options, published, args.launch
            )
        else:
            result = publish_step(
                runtime.store,
                run,
                step,
                path,
                StateCache(settings.cache_dir, run),
                options,
                on_published=published,
                adopt=staged,
                link=settings.cache_link,
                on_part=lambda hint: publish_part(runtime.redis, hint),
            )
    if result.manifest is not None and result.manifest.version == step and not announced:
        # Also after a crash between the manifest and the event: announce once.
        published(result.manifest)
    runtime.redis.hdel(keys.pending_steps_key(run), str(step))
    if result.status == "published" and result.manifest is not None:
        since = metrics_http.since_step_s(runtime.redis, run, step)
        metrics.published(run, result.manifest.kind, result.bytes, since)
    elif result.manifest is None:
        metrics.refused(run, "diff", "stale-step")
    if result.status == "published":
        reason = policy_reason(runtime, run, step, result.manifest)
        # One policy compaction in flight per run: until it lands, every new step
        # would otherwise ask again.
        if reason is not None and claim_once(
            runtime.redis, keys.compaction_pending_key(run), config.POLICY_PENDING_TTL_S
        ):
            request_compaction(runtime, run, step, reason, requested_by="policy")
    if staged and result.status in ("published", "skipped") and path.exists():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    log.info("diff job done", status=result.status)
    return result.summary()


def check_checkpoint_root(settings: Settings, run: str, path: Path) -> None:
    """ConfigError (the step is set aside) for a checkpoint outside the run's staging
    folder and ``DELTASYNC_CHECKPOINT_ROOTS``, when that is set."""
    if settings.checkpoint_roots is None:
        return
    resolved = path.resolve()
    roots = [settings.staging_dir / run, *settings.checkpoint_roots]
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise ConfigError(
            f"checkpoint {str(path)[:200]} is outside the run's staging folder and "
            "DELTASYNC_CHECKPOINT_ROOTS: refused"
        )


def is_own_staging(settings: Settings, run: str, step: int, path: Path) -> bool:
    """True only for the folder the emitter writes this very step to,
    ``<staging>/<run>/step-<step>``, compared after resolving: never the staging root, another
    run's folder or a symlink out of it."""
    own = settings.staging_dir.resolve() / run / f"step-{step:010d}"
    return not path.is_symlink() and path.resolve() == own


def diff_part_job(
    run: str, step: int, checkpoint: str, part: str, parent_version: int
) -> dict[str, Any]:
    """rq entry point of one part of a sharded step, on its host's queue; arguments are
    JSON."""
    bind_context(run=run, version=step, job_id=current_job_id())
    done = sharded_diff.work_on_part(current(), run, step, checkpoint, part, parent_version)
    return {"run": run, "version": step, "part": part, "parts_encoded": done}


def request_compaction(
    runtime: Runtime, run: str, version: int, reason: str, *, requested_by: str
) -> str:
    """Enqueue a compaction job and announce it with ``compaction-requested``."""
    r = runtime.redis
    event = CompactionRequested.now(
        run=run, version=version, reason=reason, requested_by=requested_by
    )
    with r.pipeline(transaction=True) as pipe:
        # rq opens the transaction itself, so the job goes first.
        job_id = queues.enqueue_compaction(
            r, run, version, reason, requested_by=requested_by, pipeline=pipe
        )
        EventStream(r, run).publish(event, pipeline=pipe)
        pipe.execute()
    log.info("compaction requested", run=run, reason=reason, job_id=job_id)
    return job_id
