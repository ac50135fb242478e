"""Parallel diff: two real diff worker processes share the parts of each version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import chain, synthetic
from pipeline.config import Settings
from pipeline.events import EventStream
from pipeline.redis_server import redis_client
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
    available = sorted(e.version for _, e in events if e.type == "delta-available")  # type: ignore[attr-defined]
    assert available == list(range(STEPS)), "each version announced exactly once"
