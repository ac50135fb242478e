"""Parallel diff: two real diff worker processes share the parts of each version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import chain, synthetic
from pipeline.config import Settings
from pipeline.errors import ChainError
from pipeline.event_stream import EventStream
from pipeline.events import DeltaAvailable
from pipeline.manifest import manifest_key, version_prefix
from pipeline.parallel import Fanout, assemble, parts_key, start_fanout, work_parts
from pipeline.publish import publish_step
from pipeline.redis_server import redis_client
from pipeline.state_cache import StateCache
from pipeline.store import open_store
from tests.pipeline_helpers import assert_same_state, deltasync_env, processes, wait_for
from workers.runtime import Runtime, set_current
from workers.trainer import Emitter

pytestmark = pytest.mark.slow

STEPS = 6
PART_BYTES = 1_600_000  # the tiny model (4.9 MB) in 4 parts


def _parts_encoded(log: Path) -> list[tuple[int, str]]:
    done = []
    for line in log.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == "part encoded":
            done.append((int(doc["version"]), str(doc["part"])))
    return done


def test_two_workers_diff_parts_of_each_version(redis_url: str, tmp_path: Path) -> None:
    run = "par"
    env = deltasync_env(
        redis_url,
        tmp_path,
        DELTASYNC_PARALLEL_PARTS="1",
        DELTASYNC_PART_BYTES=str(PART_BYTES),
        DELTASYNC_COMPACT_MAX_CHAIN="100",
    )
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    store = open_store(settings.store_url)
    trainer: dict[int, dict[str, torch.Tensor]] = {}
    logs = tmp_path / "logs"
    with processes(env, logs, diff1=["worker", "diff"], diff2=["worker", "diff"]):
        state = generator.state()
        for step in range(STEPS):
            if step:
                state = generator.step()
            trainer[step] = {n: t.clone() for n, t in state.items()}
            assert emitter.emit_state(step, state).event_id is not None
        wait_for(lambda: chain.list_versions(store, run).head == STEPS - 1, "the head")

    index = chain.list_versions(store, run)
    assert index.versions == tuple(range(STEPS)), "every step published, in order"
    assert index.anchors == (0,)
    for version, expected in trainer.items():
        rebuilt = dict(chain.reconstruct_tensors(store, run, version))
        assert_same_state(rebuilt, expected, f"version {version}")
        manifest = chain.load_manifest(store, run, "anchor" if version == 0 else "delta", version)
        assert 3 <= len(manifest.objects) <= 4

    by_worker = {name: _parts_encoded(logs / f"{name}.log") for name in ("diff1", "diff2")}
    assert all(by_worker.values()), f"both workers encode parts: {by_worker}"
    every = sorted(by_worker["diff1"] + by_worker["diff2"])
    parts = len(chain.load_manifest(store, run, "delta", 1).objects)
    expected_parts = sorted(
        (v, f"part-{i:05d}.safetensors") for v in range(1, STEPS) for i in range(parts)
    )
    assert every == expected_parts, "each part of each delta encoded exactly once"

    stream = EventStream(redis_client(redis_url), run)
    events = stream.read(after_id="0-0", count=1000)
    available = sorted(e.version for _, e in events if isinstance(e, DeltaAvailable))
    assert available == list(range(STEPS)), "each version announced exactly once"


def test_parts_equal_the_single_job_and_manifest_waits_for_every_part(
    redis_url: str, tmp_path: Path
) -> None:
    """In process: the parallel parts are byte-identical to the single-job delta's, each
    part is encoded once, and no manifest is written while a part is unrecorded."""
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=7)
    paths = []
    for step in range(2):
        state = generator.state() if step == 0 else generator.step()
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(state, paths[-1])
    r = redis_client(redis_url)
    stores = {}
    for name in ("single", "parallel"):
        store = open_store(f"file://{tmp_path / name}")
        cache = StateCache(tmp_path / f"cache-{name}", "run")
        publish_step(store, "run", 0, paths[0], cache, level=1, part_bytes=PART_BYTES)
        stores[name] = (store, cache)
    store, cache = stores["single"]
    single = publish_step(store, "run", 1, paths[1], cache, level=1).manifest
    assert single is not None

    store, cache = stores["parallel"]
    parent = chain.load_manifest(store, "run", "anchor", 0)
    fanout = Fanout("run", 1, str(paths[1]), 0, "anchor", 1)
    start_fanout(r, fanout)
    assert work_parts(r, store, cache, fanout, parent) == len(parent.objects) >= 3
    assert work_parts(r, store, cache, fanout, parent) == 0, "each part encoded once"
    missing = parent.objects[1].key
    record = r.hget(parts_key("run", 1), missing)
    r.hdel(parts_key("run", 1), missing)
    with pytest.raises(ChainError, match="not recorded"):
        assemble(r, store, fanout, parent, None)
    assert not store.exists(manifest_key("run", "delta", 1))
    assert record is not None
    r.hset(parts_key("run", 1), missing, record)
    manifest = assemble(r, store, fanout, parent, None)
    assert manifest.objects == single.objects
    assert manifest.tensors == single.tensors and manifest.state_hash == single.state_hash
    for obj in manifest.objects:
        key = version_prefix("run", "delta", 1) + obj.key
        assert store.get(key) == stores["single"][0].get(key)
