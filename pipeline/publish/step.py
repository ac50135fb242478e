"""The diff job in the library: one trainer step published as one version.

``publish_step`` reads the run's head from the store, publishes the step's
checkpoint as the first anchor or as a delta against the worker's state cache
(rebuilt from the store when it does not hold the head), and then brings the
cache up to the new version. It is the step routine of every diff worker for an
unsharded run: one worker encodes every part itself (its threads use the cores).
rq, leases and events stay in ``workers/jobs/diff.py``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import structlog

from pipeline import collector
from pipeline.codec.dtypes import info_for
from pipeline.coord.events import DeltaPart
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.manifest import Kind, Manifest
from pipeline.format.manifest_parse import check_tensor_name
from pipeline.format.matching import check_tensors
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.diff import StaleBaseError, publish_delta
from pipeline.publish.uploads import PublishTimings
from pipeline.publish.version import DEFAULT_OPTIONS, PublishOptions, publish_anchor
from pipeline.store.base import ObjectStore
from pipeline.store.trust import signer_store
from pipeline.versions import chain

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PublishResult:
    run: str
    version: int
    status: Literal["published", "skipped"]
    kind: Kind | None = None  # what was published
    manifest: Manifest | None = None  # the version's manifest (None for a stale step)
    head: int | None = None  # the head before this job
    reason: str = ""
    bytes: int = 0
    changed: int = 0
    total: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def published(
        cls, manifest: Manifest, head: int | None, timings: dict[str, float]
    ) -> PublishResult:
        return cls(
            run=manifest.run,
            version=manifest.version,
            status="published",
            kind=manifest.kind,
            manifest=manifest,
            head=head,
            bytes=manifest.total_bytes,
            changed=sum(t.changed for t in manifest.tensors),
            total=sum(t.numel for t in manifest.tensors),
            timings=timings,
        )

    def summary(self) -> dict[str, Any]:
        """JSON-friendly summary (the rq job result): every field but the manifest."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "manifest"}


def already_done(
    store: ObjectStore, run: str, step: int, index: chain.VersionIndex
) -> PublishResult | None:
    """The skipped result of a step at or behind the head (published, or stale)."""
    head = index.head
    if head is None or step > head:
        return None
    existing = None
    if step in index.versions:
        kind: Kind = "delta" if step in index.deltas else "anchor"
        existing = chain.load_manifest(store, run, kind, step)
    reason = "already published" if existing else f"stale: head is {head}"
    log.info("step skipped", run=run, step=step, reason=reason)
    return PublishResult(run, step, "skipped", None, existing, head, reason)


def publish_step(
    store: ObjectStore,
    run: str,
    step: int,
    checkpoint_path: str | os.PathLike[str],
    cache: StateCache,
    options: PublishOptions = DEFAULT_OPTIONS,
    *,
    on_published: Callable[[Manifest], None] | None = None,
    adopt: bool = False,
    link: bool = False,
    on_part: Callable[[DeltaPart], None] | None = None,
) -> PublishResult:
    """The whole diff job: publish ``checkpoint_path`` as version ``step`` of ``run``
    as ``options`` say (a new run's anchor fixes its partition, compression and hash).

    ``on_published`` runs once the version's manifest is in the store and before the
    state cache catches up with it (still under the caller's lock): announcing there
    keeps the cache update off the replicas' critical path. With ``adopt`` the
    checkpoint is deltasync's own staging copy: it is moved into the state cache
    instead of copied (no byte is read or written), and is gone from its path after.
    With ``link`` the trainer's own checkpoint files are hard-linked into the cache
    instead of copied; the trainer must then not rewrite them in place (a rewrite is
    detected, the cache rebuilt from the store, and linking turned off for the run).
    ``on_part`` gets a hint for each delta object once it is stored, before the
    manifest. With ``options.signing_key`` the head is verified with its public half
    before anything builds on it."""
    store = signer_store(store, options.signing_key)
    index = chain.list_versions(store, run)
    head = index.head
    done = already_done(store, run, step, index)
    if done is not None:
        return done
    timings = PublishTimings()
    started = time.perf_counter()
    with CheckpointReader(checkpoint_path) as new, contextlib.ExitStack() as announcing:
        # No cyclic collection until the version is announced: a full one walks every
        # object of the worker (80 ms at 785 tensors) on the replicas' critical path.
        announcing.enter_context(collector.held_off())
        for name in new.names():  # refused before anything is written
            check_tensor_name(name, f"checkpoint {new.path}")
        if head is None:  # a dtype the next step's delta could not carry: refuse version 0
            for name, spec in new.specs().items():
                info_for(spec.dtype, name)
        if head is None:
            manifest = publish_anchor(
                store, run, step, new, options, parent=None, reason="first version", timings=timings
            )
        else:
            parent_kind: Kind = "anchor" if head in index.anchors else "delta"
            parent = chain.load_manifest(store, run, parent_kind, head)
            check_tensors(parent, new.specs(), holder=f"checkpoint {new.path}", complete=True)
            if not cache.is_valid_for(parent):
                log.info(
                    "state cache is stale, rebuilding", run=run, head=head, cached=cache.version
                )
                cache.rebuild(store, run, head)

            def delta(parent: Manifest = parent) -> Manifest:
                proven = cache.is_proven_for(parent)
                with cache.reader() as base:
                    return publish_delta(
                        store,
                        run,
                        step,
                        base,
                        new,
                        parent,
                        options,
                        timings=timings,
                        index=index,
                        base_unchanged=cache.still_holds_state,
                        on_part=on_part,
                        base_proven=proven,
                    )

            try:
                manifest = delta()
            except StaleBaseError as e:
                # The cache claimed the head's state but its bytes disagree: rebuild
                # once, and encode every part again.
                rewritten = not cache.linked_files_unchanged()  # turns linking off if so
                log.warning(
                    "state cache is damaged, rebuilding",
                    run=run,
                    error=str(e),
                    linked_checkpoint_rewritten=rewritten,
                )
                cache.rebuild(store, run, head)
                manifest = delta()
        published_s = time.perf_counter() - started
        if on_published is not None:
            on_published(manifest)
        announcing.close()  # the collector runs again, off the replicas' path
        cache_started = time.perf_counter()
        new.close()
        checkpoint = Path(checkpoint_path)
        # An anchor hashed this very file; a delta's base was proven (or hashed in full
        # by it) and its encoding compared every element: deltasync owns the adopted
        # checkpoint, so what was hashed or encoded is what the cache holds.
        moved = adopt and cache.adopt(checkpoint, manifest, proven=True)
        if not (moved or (link and cache.link(checkpoint, manifest))):
            cache.advance(new, manifest)
        timings.cache_s = time.perf_counter() - cache_started
    elapsed = {
        **timings.as_dict(),
        "published_s": round(published_s, 4),
        "total_s": round(time.perf_counter() - started, 4),
    }
    return PublishResult.published(manifest, head, elapsed)
