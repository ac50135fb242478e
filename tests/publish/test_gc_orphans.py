"""Garbage collection of part objects no manifest will ever name, on every store backend.

A diff job that died before its manifest (one worker's, or a sharded step's
coordinator) leaves the parts uploaded in the version's folder without a manifest.
Once a newer version is the head, that folder can never be published (publish
refuses steps not newer than the head), so GC removes it; the parts of a version
above the head may belong to a diff in flight and are never touched.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.manifest import Kind, manifest_key, version_prefix
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.diff import DeltaTask, LocalLedger, PartRecord, assemble_delta, encode_parts
from pipeline.store.base import ObjectStore
from pipeline.store.file import FileStore
from pipeline.versions import chain
from tests.publish.test_chain import SyntheticRun

RUN = "gc-orphans"


def _keys(store: ObjectStore, version: int) -> list[str]:
    return sorted(store.list(version_prefix(RUN, "delta", version)))


def _parts_before_the_manifest(
    trainer: SyntheticRun, step: int
) -> tuple[DeltaTask, dict[str, PartRecord]]:
    """What a diff job of ``step`` uploads before its manifest, and its part records."""
    index = chain.list_versions(trainer.store, RUN)
    head = index.head
    assert head is not None
    kind: Kind = "anchor" if head in index.anchors else "delta"
    parent = chain.load_manifest(trainer.store, RUN, kind, head)
    task = DeltaTask(RUN, step, str(trainer.checkpoint(step)), head, kind, 1)
    assert trainer.cache.is_valid_for(parent)
    ledger = LocalLedger()
    with CheckpointReader(task.checkpoint) as new, trainer.cache.reader() as base:
        done = encode_parts(trainer.store, task, parent, base, new, ledger)
    assert done == len(parent.objects)
    return task, ledger.records()


def test_gc_removes_a_dead_jobs_parts_and_keeps_a_diff_in_flight(
    store: ObjectStore, tmp_path: Path
) -> None:
    trainer = SyntheticRun(tmp_path, store, RUN)
    trainer.publish(0)
    trainer.publish(1)
    _parts_before_the_manifest(trainer, 2)  # its job dies here
    abandoned = _keys(store, 2)
    assert len(abandoned) >= 3 and manifest_key(RUN, "delta", 2) not in abandoned
    # Before a newer version exists, step 2 may still be redone: nothing is collected.
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == []
    assert _keys(store, 2) == abandoned

    trainer.publish(3)  # the run went on without step 2
    in_flight, records = _parts_before_the_manifest(trainer, 4)
    waiting = _keys(store, 4)
    assert waiting

    deleted = collect_garbage(store, RUN, keep_anchors=1, min_live_version=None)
    assert sorted(deleted) == abandoned
    assert _keys(store, 2) == []
    assert _keys(store, 4) == waiting, "the parts of a diff in flight are kept"
    assert chain.list_versions(store, RUN).versions == (0, 1, 3)

    # An upload of the dead job that lands after the collection (its request was in
    # flight) leaves one more orphan; the next collection takes it.
    late = abandoned[0]
    store.put(late, b"late part")
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == [late]

    # The diff in flight completes from the parts GC kept, bit-exactly.
    parent = chain.load_manifest(store, RUN, "delta", 3)
    manifest = assemble_delta(store, in_flight, parent, records)
    assert manifest.version == 4 and manifest.parent == 3
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == []
    for version in (0, 1, 3, 4):
        trainer.assert_rebuilds(version)


def test_gc_never_collects_the_folder_of_a_version_above_the_head(
    store: ObjectStore, tmp_path: Path
) -> None:
    """Even with the head's chain compacted and old versions collected, a folder above
    the head without a manifest stays, however many times GC runs."""
    trainer = SyntheticRun(tmp_path, store, RUN)
    for step in (0, 1, 2):
        trainer.publish(step)
    compact(store, RUN, 2)
    _parts_before_the_manifest(trainer, 7)
    waiting = _keys(store, 7)
    store.put(version_prefix(RUN, "delta", 9) + "part-00000.safetensors", b"x")
    deleted = collect_garbage(store, RUN, keep_anchors=1, min_live_version=None)
    assert manifest_key(RUN, "delta", 1) in deleted
    assert not any(k.startswith(version_prefix(RUN, "delta", 7)) for k in deleted)
    assert _keys(store, 7) == waiting
    assert store.exists(version_prefix(RUN, "delta", 9) + "part-00000.safetensors")
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == []
    assert _keys(store, 7) == waiting
    trainer.assert_rebuilds(2)


class CompactsOnRead(FileStore):
    """A file store that, on the first read of a delta object, lets a compaction of the
    head and its garbage collection run (another worker's, at that very moment)."""

    def __init__(self, root: Path, run: str) -> None:
        super().__init__(root)
        self.run, self.fired = run, False

    def get_bounded(self, key: str, limit: int) -> bytes:
        if not self.fired and "/deltas/" in key and not key.endswith("manifest.json"):
            self.fired = True
            compact(self, self.run)
            collect_garbage(self, self.run, keep_anchors=1, min_live_version=None)
        return super().get_bounded(key, limit)


def test_a_cache_rebuild_overtaken_by_a_compaction_starts_again_from_its_anchor(
    tmp_path: Path,
) -> None:
    """A second diff worker rebuilds its stale cache from the store while a compaction
    anchors the head and collects the chain it was reading: the rebuild starts over
    from the new anchor, and the step is published, not set aside."""
    store = CompactsOnRead(tmp_path / "store", RUN)
    trainer = SyntheticRun(tmp_path, store, RUN)
    store.fired = True  # no compaction while the chain is published
    for step in (0, 1, 2):
        assert trainer.publish(step).status == "published"
    trainer.cache = StateCache(tmp_path / "other-cache", RUN)  # another worker's
    store.fired = False
    result = trainer.publish(3)
    assert store.fired and result.status == "published"
    index = chain.list_versions(store, RUN)
    assert index.anchors == (2,) and index.deltas == (3,)
    assert trainer.cache.version == 3
    trainer.assert_rebuilds(3)
