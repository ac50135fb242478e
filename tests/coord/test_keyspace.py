"""The Redis keyspace: every key a short real run writes matches a declared template,
and the templates still build the very strings running deployments hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord import keys, problems, replicas
from pipeline.coord.connection import redis_client
from pipeline.coord.keys import TEMPLATES, template_of
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError
from pipeline.publish import dead_letters
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import open_store
from pipeline.targets.torch import TorchTarget
from pipeline.testing import synthetic
from pipeline.versions import chain
from tests.pipeline_helpers import deltasync_env
from workers.jobs import compaction, diff
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

# Deployed strings: a template that builds anything else breaks running runs.
PINNED = {
    keys.runs_key(): "deltasync:runs",
    keys.stream_key("r"): "deltasync:run:r:events",
    keys.stream_added_key("r"): "deltasync:run:r:events:added",
    keys.replica_key("r", "n:1"): "deltasync:run:r:replica:n:1",
    keys.replicas_key("r"): "deltasync:run:r:replicas",
    keys.failing_key("r", "n"): "deltasync:run:r:failing:n",
    keys.failing_index_key("r"): "deltasync:run:r:failing",
    keys.lock_key("r", "part-3-1"): "deltasync:run:r:lock:part-3-1",
    keys.binding_key("r"): "deltasync:run:r:store",
    keys.part_hints_channel("r"): "deltasync:run:r:parts",
    keys.dead_steps_key("r"): "deltasync:run:r:dead-steps",
    keys.fanout_key("r"): "deltasync:run:r:fanout",
    keys.part_records_key("r", 3, 2): "deltasync:run:r:parts:3:2",
    keys.pending_steps_key("r"): "deltasync:run:r:pending-steps",
    keys.emitted_key("r", 4): "deltasync:run:r:emitted:4",
    keys.announced_key("r", 4): "deltasync:run:r:announced:4",
    keys.announced_head_key("r"): "deltasync:run:r:announced-head",
    keys.anchored_key("r", 4): "deltasync:run:r:anchored:4",
    keys.compaction_pending_key("r"): "deltasync:run:r:compaction-pending",
    keys.compaction_failed_key("r"): "deltasync:run:r:compaction-failed",
    keys.diff_waiting_key("r"): "deltasync:run:r:diff-waiting",
    keys.diff_waiting_lease_key("r", 5): "deltasync:run:r:diff-waiting:5",
    keys.part_hosts_key("r", 6): "deltasync:run:r:part-hosts:6",
    keys.shards_key("r", 7): "deltasync:run:r:shards:7",
    keys.cache_damage_key("r"): "deltasync:run:r:cache-damage",
    keys.refused_jobs_key(): "deltasync:refused-jobs",
    keys.DIFF_QUEUE_NAME: "deltasync:diff",
    keys.diff_host_queue("h1"): "deltasync:diff:host:h1",
    keys.COMPACT_QUEUE_NAME: "deltasync:compact",
}


def test_templates_build_the_deployed_strings() -> None:
    for built, deployed in PINNED.items():
        assert built == deployed
    assert len(PINNED) == len(TEMPLATES), "every template is pinned"
    assert len({t.pattern for t in TEMPLATES}) == len(TEMPLATES)


def test_builders_refuse_names_that_would_reach_other_keys() -> None:
    for bad in ("", "a:b", "a b", "../x", "r*"):
        with pytest.raises(ConfigError):
            keys.pending_steps_key(bad)
    with pytest.raises(ConfigError):
        keys.replica_key("r", "n\n")
    with pytest.raises(ConfigError):
        keys.emitted_key("r", True)


def test_every_template_matches_what_it_builds_and_nothing_foreign() -> None:
    for built, deployed in PINNED.items():
        template = template_of(built)
        if deployed.endswith((":parts", ":diff", ":compact")) or ":diff:host:" in deployed:
            continue  # a channel and rq queue names, not keys
        assert template is not None and template.regex().fullmatch(deployed), deployed
    assert template_of("deltasync:run:r:other") is None
    assert template_of("rq:queue:deltasync:diff") is None


def test_a_short_run_writes_only_declared_keys(redis_url: str, tmp_path: Path) -> None:
    run = "keys"
    env = deltasync_env(redis_url, tmp_path, DELTASYNC_COMPACT_MAX_CHAIN="2")
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    r = redis_client(redis_url)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    emitter = Emitter(run, settings=settings)
    state = generator.state()
    for step in range(4):  # emitted, then diffed here as a worker would
        if step:
            state = generator.step()
        emitter.emit_state(step, state)
        diff.diff_job(run, step, str(emitter.staging_path(step)), owned=True)
    compaction.compact_job(run, 3, reason="manual")
    store = open_store(settings.store_url)
    assert chain.list_versions(store, run).head == 3

    # A rollout node bootstraps, reports its heartbeat, and one that fails.
    specs = chain.load_manifest(store, run, "anchor", 3).tensors
    tensors = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in specs}
    node = RolloutNode(
        store,
        run,
        TorchTarget(tensors),
        NodeOptions(node_id="n-1"),
        events=EventStream(r, run),
        redis=r,
    )
    assert node.run(until_version=3) == 3
    problems.report_failure(r, run, "n-2", None, "ChainError: test")
    with replicas.run_lock(r, run, "diff", 60):
        held = {k.decode() for k in r.scan_iter(match="deltasync:*")}
    r.hset(keys.pending_steps_key(run), "9", "{}")
    dead_letters.record(r, run, 9, "/x", ValueError("bad"), keys.pending_steps_key(run))

    found = {k.decode() for k in r.scan_iter()} | held
    ours = {k for k in found if not k.startswith("rq:")}
    undeclared = sorted(k for k in ours if template_of(k) is None)
    assert not undeclared, f"keys without a template in pipeline/coord/keys.py: {undeclared}"
    used = {template_of(k) for k in ours}
    expected = [keys.EVENTS, keys.REPLICA, keys.FAILING, keys.LOCK, keys.DEAD_STEPS]
    for template in expected:
        assert template in used, template.pattern
