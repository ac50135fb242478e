"""One diff path: a single worker is the case N=1 of the parallel diff.

The same steps published by one worker and by a coordinator whose parts are shared
with helpers (in process, each helper with its own readers of the shared state
cache, as the diff workers of one machine) give the same objects byte for byte and
the same manifests (but for their creation time and the run instance id, which a
store draws once per run).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaPart
from pipeline.coord.replicas import RunLock
from pipeline.errors import ConfigError
from pipeline.format.manifest import Manifest, to_json, version_prefix
from pipeline.publish.diff import DeltaTask
from pipeline.publish.parallel import (
    FanoutSpread,
    current_fanout,
    part_lock,
    route_parts,
    work_parts,
)
from pipeline.publish.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.testing import synthetic
from pipeline.versions import chain
from workers import queues

RUN = "one-path"
STEPS = 4
PART_BYTES = 1_600_000  # the tiny model (4.9 MB) in 4 parts


def _comparable(manifest: Manifest) -> str:
    return to_json(replace(manifest, created="", instance=None))


def _folder(store: ObjectStore, manifest: Manifest) -> dict[str, bytes]:
    prefix = version_prefix(RUN, manifest.kind, manifest.version)
    keys = sorted(k for k in store.list(prefix) if not k.endswith("manifest.json"))
    assert len(keys) == len(manifest.objects)
    return {key[len(prefix) :]: store.get(key) for key in keys}


def test_one_worker_and_several_publish_the_same_bytes(redis_url: str, tmp_path: Path) -> None:
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=11)
    paths = []
    for step in range(STEPS):
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(generator.state() if step == 0 else generator.step(), paths[-1])
    r = redis_client(redis_url)
    single = open_store(f"file://{tmp_path / 'single'}")
    shared = open_store(f"file://{tmp_path / 'shared'}")
    single_cache = StateCache(tmp_path / "cache-single", RUN)
    shared_cache = StateCache(tmp_path / "cache-shared", RUN)
    by_helpers: dict[int, int] = {}
    hints: dict[str, list[DeltaPart]] = {"single": [], "shared": []}

    def call_in(task: DeltaTask, parts: list[tuple[str, str | None]]) -> None:
        """One helper per part but the first, each finding every other part claimed
        (the first is left to the coordinator)."""
        assert current_fanout(r, RUN) == task
        parent = chain.load_manifest(shared, RUN, task.parent_kind, task.parent)
        done = 0
        for mine in range(1, len(parts)):
            others = [RunLock(r, RUN, part_lock(task.step, i), 60) for i in range(len(parts))]
            held = [lock for i, lock in enumerate(others) if i != mine and lock.acquire()]
            try:
                done += work_parts(
                    r, shared, shared_cache, task, parent, on_part=hints["shared"].append
                )
            finally:
                for lock in held:
                    lock.release()
        by_helpers[task.step] = done

    for step, path in enumerate(paths):
        one = publish_step(
            single,
            RUN,
            step,
            path,
            single_cache,
            level=1,
            part_bytes=PART_BYTES,
            on_part=hints["single"].append,
        ).manifest
        many = publish_step(
            shared,
            RUN,
            step,
            path,
            shared_cache,
            level=1,
            part_bytes=PART_BYTES,
            on_part=hints["shared"].append,
            spread=FanoutSpread(r, call_in),
        ).manifest
        assert one is not None and many is not None
        assert _comparable(one) == _comparable(many), f"manifest of version {step}"
        assert _folder(single, one) == _folder(shared, many), f"objects of version {step}"
        assert current_fanout(r, RUN) is None, "the fan-out ends with its manifest"

    parts = len(chain.load_manifest(shared, RUN, "anchor", 0).objects)
    assert parts >= 3
    assert by_helpers == {step: parts - 1 for step in range(1, STEPS)}, "helpers took parts"
    # Every stored part is hinted once, whoever encoded it.
    for name in ("single", "shared"):
        assert sorted((h.version, h.key) for h in hints[name]) == sorted(
            (v, f"part-{i:05d}.safetensors") for v in range(1, STEPS) for i in range(parts)
        ), name
    for version in range(STEPS):
        assert dict(chain.reconstruct_tensors(shared, RUN, version)).keys()


def test_parts_routed_to_hosts_are_encoded_there(redis_url: str, tmp_path: Path) -> None:
    """Issue 21's routing: each part is routed to a trainer host; only that host's
    worker claims it, a coordinator of no host waits for them, and the version is the
    single worker's, byte for byte."""
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=13)
    paths = []
    for step in range(2):
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(generator.state() if step == 0 else generator.step(), paths[-1])
    r = redis_client(redis_url)
    single = open_store(f"file://{tmp_path / 'single'}")
    shared = open_store(f"file://{tmp_path / 'shared'}")
    cache = StateCache(tmp_path / "cache-shared", RUN)
    for store, folder in ((single, "cache-single"), (shared, "cache-shared")):
        publish_step(
            store,
            RUN,
            0,
            paths[0],
            StateCache(tmp_path / folder, RUN),
            level=1,
            part_bytes=PART_BYTES,
        )
    anchor = chain.load_manifest(shared, RUN, "anchor", 0)
    hosts = {key: f"h{i % 2}" for i, (key, _) in enumerate(anchor.parts())}
    route_parts(r, RUN, 1, hosts)
    routed: list[tuple[str, str | None]] = []
    encoded: dict[str, int] = {}

    def call_in(task: DeltaTask, parts: list[tuple[str, str | None]]) -> None:
        routed.extend(parts)
        parent = chain.load_manifest(shared, RUN, task.parent_kind, task.parent)
        assert work_parts(r, shared, cache, task, parent) == 0, "no host: no routed part"
        for host in ("h0", "h1"):
            encoded[host] = work_parts(r, shared, cache, task, parent, host=host)

    one = publish_step(
        single, RUN, 1, paths[1], StateCache(tmp_path / "cache-single", RUN), level=1
    ).manifest
    many = publish_step(
        shared, RUN, 1, paths[1], cache, level=1, spread=FanoutSpread(r, call_in)
    ).manifest
    assert one is not None and many is not None
    assert routed == sorted(hosts.items())
    assert encoded == {"h0": (len(hosts) + 1) // 2, "h1": len(hosts) // 2}
    assert _comparable(one) == _comparable(many)
    assert _folder(single, one) == _folder(shared, many)


def test_part_jobs_go_to_their_hosts_queue(redis_url: str) -> None:
    r = redis_client(redis_url)
    routed = queues.enqueue_diff_part(r, RUN, 5, "/x", "part-00000.safetensors", 4, "h1")
    shared = queues.enqueue_diff_part(r, RUN, 5, "/x", "part-00001.safetensors", 4)
    assert routed in queues.queue(r, queues.diff_host_queue("h1")).job_ids
    assert shared in queues.queue(r, queues.DIFF_QUEUE).job_ids
    assert routed not in queues.queue(r, queues.DIFF_QUEUE).job_ids
    assert queues.diff_queues("h1") == [queues.diff_host_queue("h1"), queues.DIFF_QUEUE]
    assert queues.diff_queues(None) == [queues.DIFF_QUEUE]
    assert Settings.from_env({"DELTASYNC_DIFF_HOST": "trainer-3"}).diff_host == "trainer-3"
    assert Settings.from_env({}).diff_host is None
    with pytest.raises(ConfigError, match="DELTASYNC_DIFF_HOST"):
        Settings.from_env({"DELTASYNC_DIFF_HOST": "a/b"})
