"""The Redis ACLs of docs/RELIABILITY.md ("Redis ACLs"), applied as written to a real
redis-server: each role does its real work under its own user (a trainer emits, a
`deltasync worker diff` and a `deltasync worker compact` process publish and
anchor, a node and a serve host follow the run), and a node's user cannot queue a
job or touch a step."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.config import Settings
from pipeline.coord import keys, problems
from pipeline.coord.connection import redis_client
from pipeline.coord.stream import EventStream
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import manifest_key
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import open_store
from pipeline.targets.torch import TorchTarget
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env
from tests.servers import RedisServer, redis_executable, redis_version
from workers import queues
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.redis
DOC = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"
ROLES = ("trainer", "diff-worker", "compaction-worker", "node", "serve")
RUN = "acl"


def documented_acls() -> dict[str, list[str]]:
    """Role -> the arguments of its ``ACL SETUSER`` line in the doc."""
    section = DOC.read_text().split("### Redis ACLs", 1)[1]
    block = section.split("```", 2)[1]
    found = {}
    for line in block.splitlines():
        words = shlex.split(line)
        if words[:2] == ["ACL", "SETUSER"]:
            found[words[2]] = words[3:]
    return found


@pytest.fixture
def redis7(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of version 7 or later (the ACLs use its key selectors; compose
    runs 7.4): the tests' own if it is one, else one on PATH."""
    on_path = [Path(d) / "redis-server" for d in os.environ.get("PATH", "").split(os.pathsep)]
    found = [redis_executable(), *(str(p) for p in on_path if os.access(p, os.X_OK))]
    newer = [exe for exe in found if int(redis_version(exe).split(".")[0]) >= 7]
    if not newer:
        pytest.skip(f"no redis-server 7 or later (found {found})")
    server = RedisServer(tmp_path / "redis")
    server.executable = newer[0]
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g)}


@pytest.mark.slow
def test_each_role_works_with_its_documented_acl(redis7: RedisServer, tmp_path: Path) -> None:
    acls = documented_acls()
    assert sorted(acls) == sorted(ROLES)
    admin = redis.Redis(port=redis7.port)
    urls = {}
    for role, documented in acls.items():
        rules = [re.sub(r"^>[A-Z_]+PASSWORD$", f">pw-{role}", rule) for rule in documented]
        admin.execute_command("ACL", "SETUSER", role, *rules)
        urls[role] = f"redis://{role}:pw-{role}@127.0.0.1:{redis7.port}/0"
    env = {role: deltasync_env(url, tmp_path) for role, url in urls.items()}
    store = open_store(Settings.from_env(env["trainer"]).store_url)

    # The trainer emits two steps; a diff worker publishes both.
    emitter = Emitter(RUN, settings=Settings.from_env(env["trainer"]))
    for step in (1, 2):
        path = tmp_path / f"s{step}.safetensors"
        write_checkpoint(path, _state(step).items())
        emitter.emit_checkpoint(step, path)
    done = cli(env["diff-worker"], "worker", "diff", "--burst")
    assert done.returncode == 0, done.stdout + done.stderr
    assert chain.list_versions(store, RUN).head == 2, done.stdout + done.stderr

    # An operator (the default user) asks for an anchor; a compaction worker writes it.
    operator = deltasync_env(redis7.url, tmp_path)
    asked = cli(operator, "compact", "--run", RUN, "--version", "2")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    done = cli(env["compaction-worker"], "worker", "compact", "--burst")
    assert done.returncode == 0, done.stdout + done.stderr
    assert store.exists(manifest_key(RUN, "anchor", 2)), done.stdout + done.stderr

    # A node and a serve host follow the run: heartbeats, events, part hints, failures.
    specs = chain.load_manifest(store, RUN, "anchor", 2).tensors
    for role in ("node", "serve"):
        r = redis_client(urls[role])
        tensors = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in specs}
        node = RolloutNode(
            store,
            RUN,
            TorchTarget(tensors),
            NodeOptions(node_id=f"{role}-1", early_start=True),
            events=EventStream(r, RUN),
            redis=r,
        )
        assert node.run(until_version=2) == 2
        problems.report_failure(r, RUN, f"{role}-2", 2, "ChainError: a test")
        problems.clear_failure(r, RUN, f"{role}-2")
    nodes = {k.decode() for k in admin.smembers(keys.replicas_key(RUN))}
    assert nodes == {"node-1", "serve-1"}

    # What a node's user must not do: queue a job, add a step, take a run lock.
    r = redis_client(urls["node"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        Queue(queues.DIFF_QUEUE, connection=r, serializer=JSONSerializer).enqueue(
            queues.DIFF_JOB, run=RUN, step=3, checkpoint="/x"
        )
    for key in (keys.pending_steps_key(RUN), keys.lock_key(RUN, "diff")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.hset(key, "3", "{}")
    # Nor the trainer's: queue a compaction job or write the workers' records.
    r = redis_client(urls["trainer"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        Queue(queues.COMPACT_QUEUE, connection=r, serializer=JSONSerializer).enqueue(
            queues.COMPACT_JOB, run=RUN
        )
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.xadd(keys.refused_jobs_key(), {"job": "{}"})
