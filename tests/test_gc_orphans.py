"""Garbage collection of part objects no manifest will ever name, on every store backend.

A parallel diff whose coordinator died leaves the parts its workers uploaded in the
version's folder without a manifest. Once a newer version is the head, that folder
can never be published (publish refuses steps not newer than the head), so GC
removes it; the parts of a version above the head may belong to a diff in flight
and are never touched.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.coord.connection import redis_client
from pipeline.format.manifest import Kind, manifest_key, version_prefix
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.diff import DeltaTask
from pipeline.publish.parallel import assemble, start_fanout, work_parts
from pipeline.store.base import ObjectStore
from pipeline.versions import chain
from tests.test_chain import SyntheticRun

RUN = "gc-orphans"


def _keys(store: ObjectStore, version: int) -> list[str]:
    return sorted(store.list(version_prefix(RUN, "delta", version)))


def _parts_of_a_fanout(trainer: SyntheticRun, redis_url: str, step: int) -> DeltaTask:
    """What the workers of a parallel diff of ``step`` upload before its manifest."""
    index = chain.list_versions(trainer.store, RUN)
    head = index.head
    assert head is not None
    kind: Kind = "anchor" if head in index.anchors else "delta"
    parent = chain.load_manifest(trainer.store, RUN, kind, head)
    fanout = DeltaTask(RUN, step, str(trainer.checkpoint(step)), head, kind, 1)
    r = redis_client(redis_url)
    start_fanout(r, fanout)
    assert work_parts(r, trainer.store, trainer.cache, fanout, parent) == len(parent.objects)
    return fanout


def test_gc_removes_a_dead_coordinators_parts_and_keeps_a_diff_in_flight(
    store: ObjectStore, redis_url: str, tmp_path: Path
) -> None:
    trainer = SyntheticRun(tmp_path, store, RUN)
    trainer.publish(0)
    trainer.publish(1)
    _parts_of_a_fanout(trainer, redis_url, 2)  # its coordinator dies here
    abandoned = _keys(store, 2)
    assert len(abandoned) >= 3 and manifest_key(RUN, "delta", 2) not in abandoned
    # Before a newer version exists, step 2 may still be redone: nothing is collected.
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == []
    assert _keys(store, 2) == abandoned

    trainer.publish(3)  # the run went on without step 2
    in_flight = _parts_of_a_fanout(trainer, redis_url, 4)
    waiting = _keys(store, 4)
    assert waiting

    deleted = collect_garbage(store, RUN, keep_anchors=1, min_live_version=None)
    assert sorted(deleted) == abandoned
    assert _keys(store, 2) == []
    assert _keys(store, 4) == waiting, "the parts of a diff in flight are kept"
    assert chain.list_versions(store, RUN).versions == (0, 1, 3)

    # A helper of the dead fan-out that uploads after the collection leaves one more
    # orphan; the next collection takes it.
    late = abandoned[0]
    store.put(late, b"late part")
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == [late]

    # The diff in flight completes from the parts GC kept, bit-exactly.
    parent = chain.load_manifest(store, RUN, "delta", 3)
    manifest = assemble(redis_client(redis_url), store, in_flight, parent, None)
    assert manifest.version == 4 and manifest.parent == 3
    assert collect_garbage(store, RUN, keep_anchors=1, min_live_version=None) == []
    for version in (0, 1, 3, 4):
        trainer.assert_rebuilds(version)


def test_gc_never_collects_the_folder_of_a_version_above_the_head(
    store: ObjectStore, redis_url: str, tmp_path: Path
) -> None:
    """Even with the head's chain compacted and old versions collected, a folder above
    the head without a manifest stays, however many times GC runs."""
    trainer = SyntheticRun(tmp_path, store, RUN)
    for step in (0, 1, 2):
        trainer.publish(step)
    compact(store, RUN, 2)
    _parts_of_a_fanout(trainer, redis_url, 7)
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
