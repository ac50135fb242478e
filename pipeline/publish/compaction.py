"""Compaction (a chain becomes an anchor) and garbage collection."""

from __future__ import annotations

import structlog

from pipeline.errors import ChainError
from pipeline.format.manifest import Manifest
from pipeline.publish.version import (
    DEFAULT_OPTIONS,
    PublishOptions,
    publish_anchor,
    publish_pieced_anchor,
)
from pipeline.store.base import ObjectStore
from pipeline.store.trust import signer_store, store_key
from pipeline.versions import chain, retention

log = structlog.get_logger(__name__)


def compact(
    store: ObjectStore,
    run: str,
    version: int | None = None,
    options: PublishOptions = DEFAULT_OPTIONS,
) -> Manifest:
    """Publish version ``version`` (default: the head) as an anchor, rebuilt from its
    chain and checked against its delta manifest, in ``options.anchor_compression``.
    Idempotent. With ``options.signing_key`` every manifest of the chain must carry its
    signature: nothing unsigned is rebuilt into a signed anchor."""
    store = signer_store(store, options.signing_key)
    index = chain.list_versions(store, run)
    target = index.head if version is None else version
    if target is None:
        raise ChainError(f"run {run} has no published version to compact")
    if target in index.anchors:
        return chain.load_manifest(store, run, "anchor", target)
    plan = chain.resolve(store, run, target, index=index)
    delta = plan.target
    if delta.is_pieced:
        # A sharded run's anchor keeps its pieces, written part by part.
        return publish_pieced_anchor(
            store,
            run,
            target,
            chain.reconstruct_parts(store, run, target, plan=plan),
            delta,
            options,
            reason="compaction",
        )
    return publish_anchor(
        store,
        run,
        target,
        chain.reconstruct_tensors(store, run, target, plan=plan),
        options,
        parent=delta.parent,
        reason="compaction",
        layout=delta.parts(),
        expected=delta,
        parent_state_hash=delta.parent_state_hash,
    )


def collect_garbage(
    store: ObjectStore, run: str, keep_anchors: int, min_live_version: int | None
) -> list[str]:
    """Delete what no live replica and no bootstrap needs (see ``retention.gc_plan``), manifests
    first; also the remains of crashed delta publishes below the head, and of crashed
    compactions or collections below the newest anchor (callers hold the run's
    compaction lock, so no anchor is being written)."""
    index = chain.list_versions(store, run)
    if store_key(store) is not None and index.head is not None:
        # What stays must be genuine before what it replaces goes: a forged anchor
        # would otherwise get the signed chains below it deleted.
        chain.resolve(store, run, index.head, index=index)
    doomed = retention.gc_plan(index, keep_anchors, min_live_version)
    orphans = (
        retention.orphan_delta_folders(store, run, index.head) if index.head is not None else []
    )
    newest_anchor = max(index.anchors, default=None)
    if newest_anchor is not None:
        orphans += retention.orphan_anchor_folders(store, run, newest_anchor)
    deleted = retention.delete_versions(store, doomed, orphans)
    if deleted:
        log.info(
            "garbage collected",
            run=run,
            versions=len(doomed),
            orphans=len(orphans),
            keys=len(deleted),
        )
    return deleted
