"""A run is bound to one store, and nodes never go back.

Two stores on one Redis: the second diff worker and a node on the second store refuse
with one line, nothing is published there, and the step stays pending for the right
worker. A new run under an old run's name and key does not accept the old run's
signed versions; deleting newer versions does not make a node serve an older one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.connection import redis_client
from pipeline.errors import ChainError, SignatureError
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import manifest_key
from pipeline.format.signing import generate_keypair, load_public_key, private_key_from
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import open_store
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers.trainers.trainer import Emitter

RUN = "bound"


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    w.view(torch.int16)[0, : step * 3] += 1
    return {"w": w}


def _publish(store: FileStore, tmp: Path, steps: range, key: Path | None = None) -> None:
    cache = StateCache(tmp / "cache", RUN)
    signing = private_key_from(key.read_bytes()) if key is not None else None
    for step in steps:
        path = tmp / f"ckpt-{step}.safetensors"
        write_checkpoint(path, _state(step).items())
        publish_step(store, RUN, step, path, cache, PublishOptions(signing_key=signing))


def _empty_target() -> TorchTarget:
    return TorchTarget({n: torch.empty_like(t) for n, t in _state(0).items()})


def test_every_manifest_carries_the_run_instance(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path, range(3))
    record = run_binding.read_instance(store, RUN)
    assert record is not None and record.since == 0
    index = chain.list_versions(store, RUN)
    for v in index.deltas:
        assert chain.load_manifest(store, RUN, "delta", v).instance == record.instance
    assert chain.load_manifest(store, RUN, "anchor", 0).instance == record.instance


@pytest.mark.slow
def test_a_worker_and_a_node_on_another_store_refuse(tmp_path: Path, redis_url: str) -> None:
    env_a = deltasync_env(redis_url, tmp_path / "a")
    env_b = deltasync_env(redis_url, tmp_path / "b")
    store_a = open_store(Settings.from_env(env_a).store_url)
    store_b = open_store(Settings.from_env(env_b).store_url)
    r = redis_client(redis_url)
    with processes(env_a, tmp_path / "logs-a", diff=["worker", "diff"]):
        Emitter(RUN, settings=Settings.from_env(env_a)).emit_state(0, _state(0))
        wait_for(lambda: chain.list_versions(store_a, RUN).head == 0, "version 0 in store a")
    bound = run_binding.bound(r, RUN)
    assert bound is not None and bound[0] == store_a.url

    with processes(env_b, tmp_path / "logs-b", diff=["worker", "diff"]):
        Emitter(RUN, settings=Settings.from_env(env_b)).emit_state(1, _state(1))

        def refused() -> bool:
            log = (tmp_path / "logs-b" / "diff.log").read_text()
            return "StoreBindingError" in log or "is bound to store" in log

        wait_for(refused, "the worker on store b to refuse")
    assert chain.list_versions(store_b, RUN).head is None  # no fork: nothing published
    assert not store_b.exists(run_binding.record_key(RUN))
    assert r.hexists(keys.pending_steps_key(RUN), "1")  # left for the right worker

    out = cli(env_b, "rollout", "--run", RUN, "--until", "0", "--poll", "0.3")
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert f"run {RUN} is bound to store {store_a.url}" in line, out.stderr[-2000:]

    # The right worker takes the pending step.
    with processes(env_a, tmp_path / "logs-a2", diff=["worker", "diff"]):
        Emitter(RUN, settings=Settings.from_env(env_a)).emit_state(2, _state(2))
        wait_for(lambda: chain.list_versions(store_a, RUN).head == 2, "version 2 in store a")
    assert 1 in chain.list_versions(store_a, RUN).deltas


def test_an_old_runs_signed_versions_are_not_replayed(tmp_path: Path) -> None:
    """The same name and key, a new instance: the old run's signed delta is refused."""
    private, public = generate_keypair(tmp_path / "keys")
    old = FileStore(tmp_path / "old")
    _publish(old, tmp_path / "t-old", range(3), private)
    new = FileStore(tmp_path / "new")
    _publish(new, tmp_path / "t-new", range(2), private)
    for key in old.list(f"{RUN}/deltas/0000000002/"):  # replayed as the new run's v2
        new.put(key, old.get(key))
    node = RolloutNode(new, RUN, _empty_target(), NodeOptions(public_key=load_public_key(public)))
    assert node.step_once() != 2
    assert isinstance(node.last_error, SignatureError)
    assert "another instance of the run" in str(node.last_error)


def test_a_node_refuses_to_go_back(tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "keys")
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path, range(3), private)
    node = RolloutNode(store, RUN, _empty_target(), NodeOptions(public_key=load_public_key(public)))
    assert node.step_once() == 2
    # Someone with store access deletes the newest versions.
    shutil.rmtree(store.root / RUN / "deltas" / "0000000002")
    assert not store.exists(manifest_key(RUN, "delta", 2))
    node.step_once()
    assert isinstance(node.last_error, ChainError)
    assert "refusing to go back" in str(node.last_error)
    assert node.applied_version == 2


def test_a_binding_made_between_the_store_read_and_the_redis_read_is_accepted(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node starting while the run's first publish binds it: its read of the store
    finds no instance, the publisher then records one and binds Redis, and the node's
    read of Redis sees that binding. The node reads the store again and accepts it
    (it used to refuse, naming its own store as holding no instance)."""
    store = FileStore(tmp_path / "store")
    client = redis_client(redis_url)
    real = run_binding.read_instance
    calls: list[int] = []

    def publisher_in_between(found_in: FileStore, run: str) -> run_binding.RunInstance | None:
        calls.append(1)
        if len(calls) == 1:  # the node's first read: nothing yet; the publisher binds now
            empty = real(found_in, run)
            run_binding.bind_store(client, run, store)
            return empty
        return real(found_in, run)

    monkeypatch.setattr(run_binding, "read_instance", publisher_in_between)
    instance = run_binding.check_store(client, RUN, store)
    monkeypatch.undo()
    assert instance is not None and instance == run_binding.read_instance(store, RUN)
    assert run_binding.bound(client, RUN) == (store.url, instance.instance)
    other = FileStore(tmp_path / "other")  # a store that never held the run still refuses
    with pytest.raises(run_binding.StoreBindingError, match="holds no instance of it"):
        run_binding.check_store(client, RUN, other)
