"""Garbage collection of a run's versions: what may go, and deleting it safely.

Manifests go first, so no half-version is ever visible; objects of folders without a
manifest (remains of a crashed publish or compaction) are collected with them.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from pipeline.errors import DeltasyncError
from pipeline.format.manifest import Kind, manifest_key, version_prefix
from pipeline.store.base import ObjectStore
from pipeline.testing import faults
from pipeline.versions.index import VersionIndex, version_folders, with_manifest

log = structlog.get_logger(__name__)


def gc_plan(index: VersionIndex, keep_anchors: int, min_live_version: int | None) -> list[str]:
    """Manifest keys of the versions that may be deleted.

    Kept: the newest ``keep_anchors`` anchors (at least one), every delta after the
    newest anchor (the head's chain), and every delta after ``min_live_version`` (the
    oldest version a live replica holds) so that it can still reach the head.
    """
    head = index.head
    if head is None:
        return []
    newest_anchor = index.anchor_at_or_below(head)
    if newest_anchor is None:
        return []  # without an anchor every delta is part of the only chain
    kept_anchors = set(sorted(index.anchors)[-max(1, keep_anchors) :])
    cutoff = newest_anchor if min_live_version is None else min(newest_anchor, min_live_version)
    doomed = [manifest_key(index.run, "anchor", a) for a in index.anchors if a not in kept_anchors]
    doomed += [manifest_key(index.run, "delta", d) for d in index.deltas if d <= cutoff]
    return sorted(doomed)


def orphan_delta_folders(store: ObjectStore, run: str, below: int) -> list[str]:
    """Delta folders under ``below`` (the head) holding objects but no manifest: remains
    of a publish, or of a sharded step's coordinator, that died. None can be published
    any more (publish refuses steps not newer than the head) and a diff in flight writes
    above the head. A host worker of a dead fan-out may still upload into such a folder
    after it is collected; the next collection takes that object too."""
    return _orphans(store, run, "delta", below)


def orphan_anchor_folders(store: ObjectStore, run: str, below: int) -> list[str]:
    """Anchor folders under ``below`` holding objects but no manifest: remains of a
    compaction or a garbage collection that crashed. Only safe to collect while holding
    the run's compaction lock (no anchor is being written then)."""
    return _orphans(store, run, "anchor", below)


def _orphans(store: ObjectStore, run: str, kind: Kind, below: int) -> list[str]:
    folders = version_folders(store, run, kind)
    published = set(with_manifest(folders))
    return [
        version_prefix(run, kind, v) for v in sorted(folders) if v < below and v not in published
    ]


def delete_versions(
    store: ObjectStore, manifest_keys: Iterable[str], folders: Iterable[str]
) -> list[str]:
    """Delete manifests first (so no half-version is ever visible), then the objects of
    their folders and of the orphan ``folders``; returns every deleted key."""
    deleted: list[str] = []
    keys = list(manifest_keys)
    for key in keys:
        store.delete(key)
        deleted.append(key)
    faults.point("gc.after_manifests")
    for prefix in [k.rsplit("/", 1)[0] + "/" for k in keys] + list(folders):
        for key in list(store.list(prefix)):
            try:
                store.delete(key)
            except DeltasyncError as e:
                log.warning("could not delete object", key=key, error=str(e))
                continue
            deleted.append(key)
    return deleted
