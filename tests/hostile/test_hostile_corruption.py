"""Damaged store objects: one flipped bit, truncated, deleted, or replaced by an older
version's object. A rollout node detects the damage before any weight changes,
publishes ``replica-error``, keeps serving the last good version and recovers once
the object is repaired; ``deltasync verify`` names the damaged key and exits non-zero.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pipeline.coord.connection import redis_client
from pipeline.coord.events import ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.manifest import manifest_key, object_key
from pipeline.publish.compaction import compact
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env
from tests.rollout.test_faults_rollout import RUN, PublishedRun, publish_run

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

Damage = Callable[[Path, Path], None]  # (object file, same object of an older version)


def flip_bit(path: Path, _older: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path, _older: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def delete(path: Path, _older: Path) -> None:
    path.unlink()


def older(path: Path, older_object: Path) -> None:
    shutil.copyfile(older_object, path)


DAMAGES: dict[str, Damage] = {
    "flipped-bit": flip_bit,
    "truncated": truncate,
    "deleted": delete,
    "older-version": older,
}
PART = "part-00001.safetensors"


def _file(store: FileStore, key: str) -> Path:
    return Path(store.root) / key


def _hashes(target: TorchTarget) -> dict[str, str]:
    return {name: content_hash(t) for name, t in target.export()}


def _state_hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: content_hash(t) for name, t in state.items()}


def _errors(stream: EventStream) -> list[ReplicaError]:
    return [e for _, e in stream.read(after_id="0-0", count=1000) if isinstance(e, ReplicaError)]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> PublishedRun:
    return publish_run(tmp_path_factory.mktemp("corruption"), versions=5)


def _copy_run(published: PublishedRun, tmp: Path) -> PublishedRun:
    shutil.copytree(published.store.root, tmp / "store")
    return PublishedRun(FileStore(tmp / "store"), published.states)


def _node(run: PublishedRun, redis_url: str) -> tuple[RolloutNode, TorchTarget, EventStream]:
    states = run.states[0]
    target = TorchTarget({n: torch.empty_like(t) for n, t in states.items()})
    stream = EventStream(redis_client(redis_url), RUN)
    node = RolloutNode(
        run.store, RUN, target, NodeOptions(node_id="victim", prefetch=False), events=stream
    )
    return node, target, stream


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_delta_is_refused_and_repair_recovers(
    published: PublishedRun, tmp_path: Path, redis_url: str, damage: str
) -> None:
    run = _copy_run(published, tmp_path)
    # The node holds v3; v4's second part is damaged.
    good = run.states
    victim = _file(run.store, object_key(RUN, "delta", 4, PART))
    saved = victim.read_bytes()
    hidden = tmp_path / "v4-manifest"
    shutil.move(_file(run.store, manifest_key(RUN, "delta", 4)), hidden)
    node, target, stream = _node(run, redis_url)
    assert node.step_once() == 3
    shutil.move(hidden, _file(run.store, manifest_key(RUN, "delta", 4)))
    DAMAGES[damage](victim, _file(run.store, object_key(RUN, "delta", 2, PART)))

    assert node.step_once() == 3
    assert node.last_error is not None and PART in str(node.last_error)
    assert _hashes(target) == _state_hashes(good[3]), "weights changed by a damaged delta"
    errors = _errors(stream)
    assert errors and errors[-1].node == "victim" and errors[-1].version == 3
    assert PART in errors[-1].error

    victim.write_bytes(saved)  # repaired
    assert node.step_once() == 4
    assert _hashes(target) == _state_hashes(good[4])


@pytest.mark.parametrize("damage", ["flipped-bit", "truncated", "deleted"])
def test_damaged_anchor_is_refused_and_repair_recovers(
    published: PublishedRun, tmp_path: Path, redis_url: str, damage: str
) -> None:
    run = _copy_run(published, tmp_path)
    victim = _file(run.store, object_key(RUN, "anchor", 0, PART))
    saved = victim.read_bytes()
    DAMAGES[damage](victim, victim)
    node, target, stream = _node(run, redis_url)
    assert node.step_once() is None
    assert node.last_error is not None and PART in str(node.last_error)
    assert node.applied_version is None  # a fresh node claims no version
    assert _errors(stream)
    victim.write_bytes(saved)
    assert node.step_once() == run.head
    assert _hashes(target) == _state_hashes(run.states[run.head])


def test_damaged_anchor_never_replaces_a_served_version(
    published: PublishedRun, tmp_path: Path, redis_url: str
) -> None:
    """A node serving v1 whose only way forward is a newer, damaged anchor keeps v1 bit
    for bit (never a mix of two versions), and moves on once the anchor is repaired."""
    run = _copy_run(published, tmp_path)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for v in (2, 3, 4):
        shutil.move(_file(run.store, manifest_key(RUN, "delta", v)), hidden / str(v))
    node, target, stream = _node(run, redis_url)
    assert node.step_once() == 1
    for v in (2, 3, 4):
        shutil.move(hidden / str(v), _file(run.store, manifest_key(RUN, "delta", v)))
    compact(run.store, RUN, 4)
    for v in (2, 3):  # the deltas are gone: the anchor is the only way to v4
        _file(run.store, manifest_key(RUN, "delta", v)).unlink()
    victim = _file(run.store, object_key(RUN, "anchor", 4, PART))
    saved = victim.read_bytes()
    truncate(victim, victim)
    assert node.step_once() == 1
    assert node.last_error is not None and PART in str(node.last_error)
    assert _hashes(target) == _state_hashes(run.states[1])
    assert _errors(stream)[-1].version == 1
    victim.write_bytes(saved)
    assert node.step_once() == 4
    assert _hashes(target) == _state_hashes(run.states[4])


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped-bit", "deleted", "older-version"])
def test_verify_names_the_damaged_key(
    published: PublishedRun, tmp_path: Path, redis_url: str, damage: str
) -> None:
    run = _copy_run(published, tmp_path)
    env = deltasync_env(redis_url, tmp_path)  # its store is tmp_path/store: the copy
    checkpoint = tmp_path / "v4.safetensors"
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    write_checkpoint(checkpoint, run.states[4].items())
    fine = cli(env, "verify", "--run", RUN, "--version", "4", "--against", str(checkpoint))
    assert fine.returncode == 0, fine.stderr
    assert "bit-identical" in fine.stdout
    key = object_key(RUN, "delta", 3, PART)
    DAMAGES[damage](_file(run.store, key), _file(run.store, object_key(RUN, "delta", 1, PART)))
    bad = cli(env, "verify", "--run", RUN, "--version", "4", "--against", str(checkpoint))
    assert bad.returncode != 0
    assert key in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    index = chain.list_versions(run.store, RUN)
    assert index.head == 4  # verify only reads
