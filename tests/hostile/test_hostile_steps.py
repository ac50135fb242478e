"""Poison steps and staging confinement, with a real diff worker.

A pending step that fails for a reason of its own (a malformed pending entry, a
checkpoint that is not safetensors) is set aside as a dead letter with a one-line
reason, shown by `deltasync status` and `deltasync tail`; later steps publish. A
pending entry naming the staging root or another run's folder never gets it deleted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.connection import redis_client
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.publish.dead_letters import list_dead
from pipeline.store import open_store
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers import queues
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.slow


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g).to(torch.bfloat16), "b": torch.randn(16)}


def test_poison_steps_are_set_aside_and_later_steps_publish(tmp_path: Path, redis_url: str) -> None:
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    run = "poison"
    r = redis_client(redis_url)
    store = open_store(settings.store_url)
    emitter = Emitter(run, settings=settings)
    pending = keys.pending_steps_key(run)

    # Other runs' unpublished work in staging, which must survive.
    other = settings.staging_dir / "other-run" / "step-0000000007"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"unpublished")
    bad = tmp_path / "not-safetensors.bin"
    bad.write_bytes(struct.pack("<Q", 2**40) + b"{}")

    with processes(env, tmp_path / "logs", diff=["worker", "diff"]) as procs:
        emitter.emit_state(0, _state(0))
        wait_for(lambda: chain.list_versions(store, run).head == 0, "version 0")
        # Pending entries whose jobs were lost or that someone with Redis access wrote.
        r.hset(pending, "1", json.dumps({"checkpoint": 12345, "owned": True}))  # TypeError
        r.hset(pending, "2", json.dumps({"checkpoint": str(bad), "owned": False}))
        r.hset(pending, "3", "{not json")
        root = {"checkpoint": str(settings.staging_dir), "owned": True}
        r.hset(pending, "0", json.dumps(root))  # stale: skipped, and once rmtree'd staging
        r.hset(pending, "4", json.dumps(root))
        r.hset(pending, "5", json.dumps({"checkpoint": str(other), "owned": True}))
        emitter.emit_state(6, _state(6))
        wait_for(lambda: chain.list_versions(store, run).head == 6, "version 6 past them")
        assert procs["diff"].poll() is None
    assert r.hlen(pending) == 0
    dead = {d.step: d.reason for d in list_dead(r, run)}
    assert set(dead) == {1, 2, 3, 4, 5}, dead
    assert dead[1].startswith("TypeError")
    assert "header length" in dead[2]
    assert all("\n" not in reason for reason in dead.values())
    # The staging root and the other run's folder were never removed.
    assert (other / "model.safetensors").read_bytes() == b"unpublished"
    assert settings.staging_dir.is_dir()

    status = cli(env, "status", "--run", run, "--json")
    assert status.returncode == 0, status.stderr
    shown = {d["step"]: d["reason"] for d in json.loads(status.stdout)["dead_steps"]}
    assert shown == dead
    text = cli(env, "status", "--run", run)
    assert "step 1 set aside: TypeError" in text.stdout
    tail = cli(env, "tail", "--run", run, "--type", "step-failed")
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout.count("step-failed") == 5
    assert r.hlen(keys.dead_steps_key(run)) == 5


def test_only_the_steps_own_staging_folder_is_removed(tmp_path: Path, redis_url: str) -> None:
    """An owned step published from ``<staging>/<run>/step-N`` is removed; the same
    step naming a folder elsewhere in staging is published but left in place."""
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    run = "confined"
    store = open_store(settings.store_url)
    emitter = Emitter(run, settings=settings)
    elsewhere = settings.staging_dir / "shared" / "ckpt"
    elsewhere.mkdir(parents=True)
    bf16 = {n: t.to(torch.bfloat16) for n, t in _state(1).items()}  # as the emitter writes
    write_checkpoint(elsewhere / "model.safetensors", bf16.items())
    r = redis_client(redis_url)
    with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
        emitter.emit_state(0, _state(0))
        wait_for(lambda: chain.list_versions(store, run).head == 0, "version 0")
        kwargs = {"run": run, "step": 1, "checkpoint": str(elsewhere), "owned": True}
        queues.enqueue_diff(r, queues.DiffArgs(**kwargs))
        wait_for(lambda: chain.list_versions(store, run).head == 1, "version 1")
    assert not emitter.staging_path(0).exists()  # its own folder: removed once published
    assert (elsewhere / "model.safetensors").is_file()
