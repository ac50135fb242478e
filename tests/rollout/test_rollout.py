"""The rollout node against a real store, real publishing and a real redis-server.

Every check of the weights is bitwise (integer views) and by content hash.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from pipeline.codec import encode_delta, read_delta
from pipeline.coord.connection import redis_client
from pipeline.coord.events import CompactionRequested, DeltaApplied, DeltaAvailable, ReplicaError
from pipeline.coord.replicas import list_replicas
from pipeline.coord.stream import EventStream
from pipeline.errors import CorruptObjectError, MismatchError, SignatureError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import content_hash, sha256_bytes
from pipeline.format.manifest import (
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    manifest_key,
    to_json,
)
from pipeline.format.signing import generate_keypair, load_public_key, private_key_from
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.patching import int_view
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain
from tests.servers import RedisServer

RUN = "run1"
PART_BYTES = 2 << 20  # several parts per version


class Trainer:
    """Realistic bf16 states published as a run, remembered by version."""

    def __init__(
        self, store: FileStore, workdir: Path, lr: float = 1e-5, content_hash: str | None = None
    ) -> None:
        self.store = store
        self.content_hash = content_hash  # of the run (None: the default)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=lr, seed=0)
        self.cache = StateCache(workdir / "cache", RUN)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.current = self.generator.state()
        self.step = 0
        self.level = 1  # the codec level of its deltas

    def checkpoint(self, version: int, state: Mapping[str, torch.Tensor]) -> Path:
        path = self.workdir / f"step-{version}.safetensors"
        save_state(dict(state), path)
        return path

    def publish(self, steps: int = 1) -> int:
        """Train ``steps`` optimizer steps, publish the result; returns its version."""
        if self.states:
            for _ in range(steps):
                self.current = self.generator.step()
            self.step += steps
        result = publish_step(
            self.store,
            RUN,
            self.step,
            self.checkpoint(self.step, self.current),
            self.cache,
            PublishOptions(level=self.level, part_bytes=PART_BYTES, content_hash=self.content_hash),
        )
        assert result.status == "published"
        self.states[self.step] = {k: v.clone() for k, v in self.current.items()}
        return self.step

    def publish_anchor(self, steps: int = 1) -> int:
        """Train and publish the result as an anchor (a full version)."""
        head = chain.list_versions(self.store, RUN).head
        for _ in range(steps):
            self.current = self.generator.step()
        self.step += steps
        with CheckpointReader(self.checkpoint(self.step, self.current)) as reader:
            publish_anchor(
                self.store,
                RUN,
                self.step,
                reader,
                PublishOptions(part_bytes=PART_BYTES),
                parent=head,
                reason="test",
            )
        self.states[self.step] = {k: v.clone() for k, v in self.current.items()}
        return self.step


def empty_target(state: Mapping[str, torch.Tensor]) -> tuple[TorchTarget, dict[str, torch.Tensor]]:
    held = {n: torch.zeros_like(t) for n, t in state.items()}
    return TorchTarget(held), held


def assert_holds(held: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert sorted(held) == sorted(want)
    for name, tensor in want.items():
        got = held[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(int_view(got).view(-1), int_view(tensor).view(-1)), name
        assert content_hash(got) == content_hash(tensor), name


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture
def trainer(store: FileStore, tmp_path: Path) -> Trainer:
    return Trainer(store, tmp_path / "trainer")


@pytest.fixture
def stream(redis_url: str) -> Iterator[EventStream]:
    client = redis_client(redis_url)
    yield EventStream(client, RUN)
    client.close()


def events_of(stream: EventStream, cls: type) -> list[object]:
    return [e for _, e in stream.read("0-0", count=10_000) if isinstance(e, cls)]


# -- following a run ---------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_node_follows_a_run_bit_exact_through_compaction_and_gc(
    trainer: Trainer, store: FileStore, prefetch: bool
) -> None:
    trainer.publish()  # v0: the first anchor
    target, held = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target, NodeOptions(prefetch=prefetch, node_id="early"))
    assert node.step_once() == 0
    assert_holds(held, trainer.states[0])

    for _ in range(3):
        v = trainer.publish()
        assert node.step_once() == v
        assert_holds(held, trainer.states[v])
        assert target.hashes() == {t.name: t.hash for t in chain.load_manifest(
            store, RUN, "delta", v).tensors}  # fmt: skip

    # Compaction in the middle, then garbage collection down to that anchor.
    anchor = compact(store, RUN)
    v = trainer.publish(steps=2)  # versions need not be contiguous
    deleted = collect_garbage(store, RUN, keep_anchors=1, min_live_version=anchor.version)
    assert deleted  # v0's anchor and the deltas before the new anchor are gone
    assert node.step_once() == v
    assert_holds(held, trainer.states[v])

    # Two versions at once: the node replays both.
    trainer.publish()
    v = trainer.publish()
    assert node.step_once() == v
    assert_holds(held, trainer.states[v])

    # A node that starts late bootstraps from the newest anchor and replays the chain.
    late_target, late_held = empty_target(trainer.current)
    late = RolloutNode(store, RUN, late_target, NodeOptions(prefetch=prefetch, node_id="late"))
    assert late.step_once() == v
    assert_holds(late_held, trainer.states[v])
    assert late.applied_state_hash == node.applied_state_hash


def test_node_behind_a_collected_chain_rebootstraps(trainer: Trainer, store: FileStore) -> None:
    trainer.publish()
    target, held = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target)
    node.step_once()
    trainer.publish()
    trainer.publish()
    anchor = compact(store, RUN)
    collect_garbage(store, RUN, keep_anchors=1, min_live_version=None)
    v = trainer.publish()
    assert chain.list_versions(store, RUN).deltas[0] > 1  # v1 is gone: no chain from v0
    assert node.step_once() == v
    assert anchor.version < v
    assert_holds(held, trainer.states[v])


@pytest.mark.parametrize("held_before", [True, False], ids=["following", "bootstrapping"])
def test_versions_collected_after_the_nodes_listing_are_synced_past_unreported(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch, held_before: bool
) -> None:
    """A compaction's garbage collection between a node's listing and its reads (a
    replica bootstrapping or following while the chain is compacted) is not a failure:
    the node lists again and reaches the head, reporting nothing."""
    trainer.publish()
    target, held = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target)
    if held_before:
        assert node.step_once() == 0
    for _ in range(3):
        trainer.publish()
    stale = chain.list_versions(store, RUN)
    compact(store, RUN)
    collect_garbage(store, RUN, keep_anchors=1, min_live_version=None)
    v = trainer.publish()
    real = chain.list_versions
    listings = iter([stale])  # the node's first listing is from before the collection
    monkeypatch.setattr(chain, "list_versions", lambda *a: next(listings, None) or real(*a))
    assert node.step_once() == v
    assert node.last_error is None
    assert_holds(held, trainer.states[v])
    # An object of a version still listed that is gone is the store's fault: reported.
    lost = chain.load_manifest(store, RUN, "delta", trainer.publish())
    store.delete(lost.object_key(lost.objects[0].key))
    assert node.step_once() == v
    assert node.last_error is not None and "is missing" in str(node.last_error)


def test_a_nodes_sync_holds_the_collector_off_and_gives_it_back(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cyclic collection from a sync's listing to its last apply (pipeline/collector.py);
    the collector is back after it, whether the sync applied or failed."""
    trainer.publish()
    v = trainer.publish()
    target, held = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target)
    seen: list[bool] = []
    real = chain.list_versions

    def listing(*args: object) -> chain.VersionIndex:
        seen.append(gc.isenabled())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(chain, "list_versions", listing)
    gc.enable()
    assert node.step_once() == v
    assert_holds(held, trainer.states[v])
    assert seen and not any(seen)
    assert gc.isenabled()
    lost = chain.load_manifest(store, RUN, "delta", trainer.publish())
    store.delete(lost.object_key(lost.objects[0].key))
    assert node.step_once() == v
    assert node.last_error is not None
    assert gc.isenabled()


def test_dump_writes_the_held_weights(trainer: Trainer, store: FileStore, tmp_path: Path) -> None:
    trainer.publish()
    v = trainer.publish()
    target, _ = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target)
    node.step_once()
    path = node.dump(tmp_path / "dump.safetensors")
    with CheckpointReader(path) as reader:
        assert_holds({n: reader.get(n) for n in reader.names()}, trainer.states[v])


class CountingTarget(TorchTarget):
    """A TorchTarget that counts full loads (to tell a resume from a bootstrap)."""

    loads = 0

    def load_state(self, tensors, hashes=None):  # type: ignore[no-untyped-def]
        self.loads += 1
        super().load_state(tensors, hashes)


# -- bad versions --------------------------------------------------------------------------


def _corrupt_object(trainer: Trainer, v: int) -> None:
    store = trainer.store
    manifest = chain.load_manifest(store, RUN, "delta", v)
    key = manifest.object_key(manifest.objects[0].key)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x55
    store.put(key, bytes(data))


def _rewrite_manifest(store: FileStore, v: int, tensors: tuple[TensorEntry, ...]) -> None:
    manifest = chain.load_manifest(store, RUN, "delta", v)
    bad = dataclasses.replace(manifest, tensors=tensors, state_hash=compute_state_hash(tensors))
    store.put(manifest_key(RUN, "delta", v), to_json(bad))


def _unknown_tensor(trainer: Trainer, v: int) -> None:
    store = trainer.store
    manifest = chain.load_manifest(store, RUN, "delta", v)
    first = manifest.tensors[0]
    extra = dataclasses.replace(first, name="model.extra.weight", changed=0)
    _rewrite_manifest(store, v, (*manifest.tensors, extra))


def _wrong_shape(trainer: Trainer, v: int) -> None:
    store = trainer.store
    manifest = chain.load_manifest(store, RUN, "delta", v)
    first = manifest.tensors[0]
    wrong = dataclasses.replace(first, shape=(first.shape[0] + 1, *first.shape[1:]))
    _rewrite_manifest(store, v, (wrong, *manifest.tensors[1:]))


def _wrong_base(trainer: Trainer, v: int) -> None:
    """Re-encode delta ``v`` against weights no replica held (its manifest still names
    the right parent and parent state hash)."""
    store = trainer.store
    manifest = chain.load_manifest(store, RUN, "delta", v)
    base = trainer.states[manifest.parent]
    new = trainer.states[v]
    other = {n: t.clone() for n, t in base.items()}
    int_view(other["model.embed_tokens.weight"]).view(-1)[:100] += 1
    objects, changed = [], {}
    for key, names in manifest.parts():
        data = encode_delta([(n, other[n], new[n]) for n in names], level=1)
        store.put(manifest.object_key(key), data)
        objects.append(ObjectEntry(key, len(data), sha256_bytes(data)))
        changed.update({i.name: i.changed for i in read_delta(data).tensors})
    tensors = tuple(dataclasses.replace(t, changed=changed[t.name]) for t in manifest.tensors)
    bad = dataclasses.replace(manifest, objects=tuple(objects), tensors=tensors)
    store.put(manifest_key(RUN, "delta", v), to_json(bad))


BREAKERS = {
    "wrong-base": (_wrong_base, MismatchError),
    "corrupt-object": (_corrupt_object, CorruptObjectError),
    "unknown-tensor": (_unknown_tensor, MismatchError),
    "wrong-shape": (_wrong_shape, MismatchError),
}


@pytest.mark.parametrize("breaker", list(BREAKERS))
def test_bad_version_is_reported_weights_untouched_and_node_recovers(
    trainer: Trainer, store: FileStore, stream: EventStream, breaker: str
) -> None:
    trainer.publish()
    good = trainer.publish()
    held = {n: torch.zeros_like(t) for n, t in trainer.current.items()}
    target = CountingTarget(held)
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="n1"), events=stream)
    assert node.step_once() == good

    bad = trainer.publish()
    mutate, expected_error = BREAKERS[breaker]
    mutate(trainer, bad)

    hashes = target.hashes()
    loads = []
    # A mismatch makes the second attempt re-bootstrap (the held weights may be what is
    # wrong) and replay up to `bad`; later attempts on the same store state do not.
    for attempt in range(3):
        assert node.step_once() == good, attempt
        assert isinstance(node.last_error, expected_error)
        assert target.hashes() == hashes
        assert_holds(held, trainer.states[good])
        loads.append(target.loads)
    assert loads[2] == loads[1] == (1 if expected_error is CorruptObjectError else 2)
    errors = events_of(stream, ReplicaError)
    assert errors and all(e.node == "n1" and e.recovering for e in errors)  # type: ignore[attr-defined]
    assert expected_error.__name__ in errors[0].error  # type: ignore[attr-defined]

    # A good version appears (a fresh anchor from the trainer): the node converges.
    fixed = trainer.publish_anchor()
    assert node.step_once() == fixed
    assert node.last_error is None
    assert_holds(held, trainer.states[fixed])


def test_signed_run_needs_the_right_key(store: FileStore, tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "keys")
    _, other_public = generate_keypair(tmp_path / "other")
    trainer = Trainer(store, tmp_path / "trainer")
    key = private_key_from(private.read_bytes())
    for step in range(2):
        state = trainer.current if step == 0 else trainer.generator.step()
        path = trainer.checkpoint(step, state)
        publish_step(store, RUN, step, path, trainer.cache, PublishOptions(signing_key=key))
        trainer.states[step] = state

    target, held = empty_target(trainer.states[0])
    wrong = RolloutNode(store, RUN, target, NodeOptions(public_key=load_public_key(other_public)))
    assert wrong.step_once() is None
    assert isinstance(wrong.last_error, SignatureError)
    assert all(not t.any() for t in held.values())  # nothing was loaded

    right = RolloutNode(store, RUN, target, NodeOptions(public_key=load_public_key(public)))
    assert right.step_once() == 1
    assert_holds(held, trainer.states[1])


# -- restart -------------------------------------------------------------------------------


def test_restarted_node_resumes_when_its_weights_prove_out(
    trainer: Trainer, store: FileStore, tmp_path: Path
) -> None:
    state_path = tmp_path / "node-state.json"
    trainer.publish()
    v = trainer.publish()
    held = {n: torch.zeros_like(t) for n, t in trainer.current.items()}
    first = RolloutNode(store, RUN, CountingTarget(held), NodeOptions(state_path=state_path))
    assert first.step_once() == v

    # Same weights (the server kept its model), new node object: no bootstrap.
    target = CountingTarget(held)
    again = RolloutNode(store, RUN, target, NodeOptions(state_path=state_path))
    assert again.start() == v
    v2 = trainer.publish()
    assert again.step_once() == v2
    assert target.loads == 0
    assert_holds(held, trainer.states[v2])

    # Weights that do not match the recorded version: bootstrap.
    int_view(held["lm_head.weight"]).view(-1)[0] += 1
    target = CountingTarget(held)
    third = RolloutNode(store, RUN, target, NodeOptions(state_path=state_path))
    assert third.start() is None
    assert third.step_once() == v2
    assert target.loads == 1
    assert_holds(held, trainer.states[v2])


def test_heartbeats_report_the_applied_version(
    trainer: Trainer, store: FileStore, redis_url: str
) -> None:
    client = redis_client(redis_url)
    trainer.publish()
    v = trainer.publish()
    target, _ = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="hb-node"), redis=client)
    node.step_once()
    (info,) = list_replicas(client, RUN)
    assert (info.node, info.version) == ("hb-node", v)
    assert info.state_hash == chain.load_manifest(store, RUN, "delta", v).state_hash
    client.close()


# -- following events: gaps, duplicates, a Redis restart, a trimmed stream ------------------


class GatedTarget(TorchTarget):
    """A TorchTarget whose applies can be held at the door by the test."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(weights)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def apply_delta(self, manifest, objects, verify="touched", early=()):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().apply_delta(manifest, objects, verify, early)


def wait_for_version(node: RolloutNode, version: int, thread: threading.Thread) -> None:
    """Wait (bounded, generously) until the node holds ``version``."""
    for _ in range(1200):
        if node.applied_version is not None and node.applied_version >= version:
            return
        assert thread.is_alive(), "the node stopped"
        time.sleep(0.05)
    raise AssertionError(f"node holds {node.applied_version}, never reached {version}")


def announce(stream: EventStream, store: FileStore, version: int) -> None:
    kind = "anchor" if version in chain.list_versions(store, RUN).anchors else "delta"
    manifest = chain.load_manifest(store, RUN, kind, version)
    stream.publish(
        DeltaAvailable(
            run=RUN,
            version=version,
            kind=kind,
            parent=manifest.parent,
            anchor=manifest.anchor,
            bytes=manifest.total_bytes,
            changed=sum(t.changed for t in manifest.tensors),
            total=sum(t.numel for t in manifest.tensors),
            manifest=manifest.key,
        )
    )


def test_node_follows_events_through_gaps_duplicates_restart_and_trim(
    trainer: Trainer, store: FileStore, private_redis: RedisServer
) -> None:
    trainer_client = redis_client(private_redis.url)
    node_client = redis_client(private_redis.url)
    stream = EventStream(trainer_client, RUN)
    trainer.publish()
    held = {n: torch.zeros_like(t) for n, t in trainer.current.items()}
    target = GatedTarget(held)
    # Polling is off in practice (an hour): only events, and the gap check, wake the node.
    node = RolloutNode(
        store, RUN, target, NodeOptions(node_id="follower", poll_interval_s=3600),
        events=EventStream(node_client, RUN), redis=node_client,
    )  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=node.run, kwargs={"stop": stop}, daemon=True)
    thread.start()
    try:
        wait_for_version(node, 0, thread)  # the start-up sync bootstraps

        v1 = trainer.publish()
        announce(stream, store, v1)
        wait_for_version(node, v1, thread)
        assert_holds(held, trainer.states[v1])

        # A lost event: v2 is never announced; v3's event makes the node fill the gap.
        trainer.publish()
        v3 = trainer.publish()
        announce(stream, store, v3)
        wait_for_version(node, v3, thread)
        assert_holds(held, trainer.states[v3])

        # Duplicates and out-of-order events change nothing.
        for v in (v1, v3, v1 + 1, v3):
            announce(stream, store, v)
        v4 = trainer.publish()
        announce(stream, store, v4)
        wait_for_version(node, v4, thread)
        assert_holds(held, trainer.states[v4])
        applied = [e for e in events_of(stream, DeltaApplied) if e.node == "follower"]  # type: ignore[attr-defined]
        assert [e.version for e in applied] == [0, v1, v1 + 1, v3, v4]  # type: ignore[attr-defined]
        assert applied[1].latency_s is not None  # type: ignore[attr-defined]

        # Redis restarts without persistence: the stream and heartbeats are gone.
        private_redis.restart()
        v5 = trainer.publish()
        announce(stream, store, v5)
        wait_for_version(node, v5, thread)
        assert_holds(held, trainer.states[v5])

        # Trimmed past the node's position: while the node is busy applying v6, v7 is
        # published and announced, then the stream is trimmed; the next (unrelated)
        # event shows the gap and the node catches up from the store.
        target.gate.clear()
        target.entered.clear()
        v6 = trainer.publish()
        announce(stream, store, v6)
        assert target.entered.wait(60)
        v7 = trainer.publish()
        announce(stream, store, v7)
        stream.trim(0, approximate=False)
        stream.publish(CompactionRequested(run=RUN, version=v7, reason="t", requested_by="t"))
        target.gate.set()
        wait_for_version(node, v7, thread)
        assert_holds(held, trainer.states[v7])
    finally:
        target.gate.set()
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    applied = [e for e in events_of(stream, DeltaApplied) if e.node == "follower"]  # type: ignore[attr-defined]
    assert [e.version for e in applied] == [v6, v7]  # type: ignore[attr-defined]
    (replica,) = list_replicas(trainer_client, RUN)
    assert replica.version == v7
    trainer_client.close()
    node_client.close()


def test_run_until_version_returns_once_applied(trainer: Trainer, store: FileStore) -> None:
    trainer.publish()
    v = trainer.publish()
    target, held = empty_target(trainer.current)
    node = RolloutNode(store, RUN, target, NodeOptions(poll_interval_s=0.05))
    assert node.run(until_version=v) == v
    assert_holds(held, trainer.states[v])
