"""Versions cost O(changed) with the incremental content hash (mixsum-128): the diff
worker and the replicas update hashes from the changes alone, full proofs happen at
bootstrap, on request and in the scrubber, and v1 (xxh3-128) stores still verify."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.codec import DeltaObject, apply_patch, encode_delta, read_delta
from pipeline.codec import api as codec_api
from pipeline.coord.connection import redis_client
from pipeline.coord.events import ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError, CodecError, CorruptObjectError, MismatchError
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.hashes.content_hashes import MIXSUM, XXH3
from pipeline.format.hashes.scrub import ScrubPace
from pipeline.format.manifest import manifest_key, to_json
from pipeline.format.manifest_parse import parse_manifest
from pipeline.publish.diff import scan_hasher
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets import confirmed, patching, proving
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain
from pipeline.versions.verify import verify
from tests.rollout.test_rollout import RUN, Trainer, assert_holds, empty_target

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture
def trainer(store: FileStore, tmp_path: Path) -> Trainer:
    return Trainer(store, tmp_path / "trainer")


def count_full_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements hashed in full by mixsum-128 from here on, one entry per tensor."""
    calls: list[int] = []
    real = mixsum.full_lanes

    def counted(tensor: torch.Tensor, offset: int = 0) -> tuple[int, int]:
        calls.append(tensor.numel())
        return real(tensor, offset)

    monkeypatch.setattr(mixsum, "full_lanes", counted)
    return calls


def test_new_runs_name_mixsum_and_hashes_match_a_full_hash(
    trainer: Trainer, store: FileStore
) -> None:
    """Schema 2 names the run's hash; the diff worker's hashes, updated from the
    changes, equal full hashes of the steps."""
    trainer.publish()
    for _ in range(2):
        v = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", v)
    assert manifest.schema == 2 and manifest.content_hash == MIXSUM
    assert chain.load_manifest(store, RUN, "anchor", 0).content_hash == MIXSUM
    for entry in manifest.tensors:
        assert entry.hash == mixsum.full(trainer.states[v][entry.name]), entry.name
    assert sum(e.changed for e in manifest.tensors) > 0


def test_an_adopted_proven_cache_is_not_hashed_again(
    store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adopted anchor, and a delta from a proven base adopted after it, leave the
    cache proven: no diff hashes anything in full; a rebuilt cache is proven too."""
    trainer = Trainer(store, tmp_path / "t")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    states = [generator.state()]
    for step in range(4):
        if step:
            states.append(generator.step())
        path = tmp_path / f"staged-{step}.safetensors"
        save_state(states[step], path)
        full = count_full_hashes(monkeypatch)
        result = publish_step(store, RUN, step, path, trainer.cache, adopt=True)
        assert result.status == "published" and not path.exists()
        if step == 0:
            assert len(full) == len(states[0])  # the anchor is hashed in full, once
        else:
            assert full == [], step  # its adopted file is proven: O(changed) since
        monkeypatch.undo()
    head = chain.load_manifest(store, RUN, "delta", 3)
    assert [e.hash for e in head.tensors] == [mixsum.full(states[3][e.name]) for e in head.tensors]
    trainer.cache.rebuild(store, RUN, 3)
    assert trainer.cache.is_proven_for(head)


@pytest.mark.parametrize("device", DEVICES)
def test_replica_applies_in_o_changed_and_full_proofs_where_they_belong(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The bootstrap hashes each anchor tensor in full once, as it streams; from then
    on an apply, the first included, hashes nothing in full (on a GPU the hash updates
    run on the device); ``--verify all`` hashes everything again."""
    trainer.publish()
    target_state = {n: torch.zeros_like(t, device=device) for n, t in trainer.states[0].items()}
    target = TorchTarget(target_state)
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="n"))
    full = count_full_hashes(monkeypatch)
    assert node.step_once() == 0
    assert len(full) == len(target_state)  # each anchor tensor checked as it came
    trainer.publish()
    full.clear()  # (the diff, in this process, hashes its copied cache in full)
    assert node.step_once() == 1
    assert full == [], "the first apply after the bootstrap hashed a tensor in full"
    for _ in range(2):
        v = trainer.publish()
        full.clear()  # (the diff, in this process, hashes its copied cache in full)
        assert node.step_once() == v
        assert full == [], "an apply hashed a tensor in full"
        assert_holds({n: t.cpu() for n, t in target_state.items()}, trainer.states[v])
    assert target.hashes(algorithm=MIXSUM) == {
        n: mixsum.full(t) for n, t in trainer.states[v].items()
    }
    node.verify = "all"
    v = trainer.publish()
    full.clear()
    assert node.step_once() == v
    touched = sum(1 for e in chain.load_manifest(store, RUN, "delta", v).tensors if e.changed)
    assert len(full) == len(target_state) + touched  # all before, the touched after
    assert_holds({n: t.cpu() for n, t in target_state.items()}, trainer.states[v])


def test_a_replica_proves_level_3_records_from_their_decode(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Level 3's chunked records give the proof its positions, new and old contents
    from their one decode (``DeltaObject.gathered``), bit for bit; held contents
    that are not the base are refused."""
    trainer.level = 3
    trainer.publish()
    target, held = empty_target(trainer.states[0])
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="n"))
    assert node.step_once() == 0
    seen: list[tuple[str, bool]] = []
    real = DeltaObject.gathered

    def gathered(self: DeltaObject, name: str, base: torch.Tensor) -> Any:
        found = real(self, name, base)
        seen.append((self._records[name].encoding, found is not None))
        return found

    monkeypatch.setattr(DeltaObject, "gathered", gathered)
    for _ in range(2):
        v = trainer.publish()
        assert node.step_once() == v
        assert_holds(held, trainer.states[v])
    assert ("chunked", True) in seen and ("chunked", False) not in seen
    # An element the next delta changes, changed behind the node's back: its old
    # contents, read by the decode, do not add up to the manifest's hash.
    v = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", v)
    name = next(e.name for e in manifest.tensors if e.changed)
    before, after = (patching.int_view(trainer.states[k][name]).view(-1) for k in (v - 1, v))
    spot = int(torch.nonzero(before != after)[0])
    patching.int_view(held[name]).view(-1)[spot] += 1
    assert node.step_once() == v - 1
    assert isinstance(node.last_error, MismatchError)
    assert node.step_once() == v  # recovered from the store
    assert_holds(held, trainer.states[v])


def test_a_patch_written_to_a_wrong_position_is_caught_and_rolled_back(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back of the written positions catches it; the node then recovers
    from the store (an element written outside the patch is not in the undo log)."""
    trainer.publish()
    target, held = empty_target(trainer.states[0])
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="n"))
    assert node.step_once() == 0
    v = trainer.publish()
    real = apply_patch
    monkeypatch.setattr(confirmed, "ENABLED", False)  # the separate write and read-back

    def misplaced(tensor: torch.Tensor, patch: Any) -> None:
        shifted = patch.positions.clone()
        shifted[0] = (shifted[0] + 1) % tensor.numel()  # one element one place off
        real(tensor, type(patch)(**{**patch.__dict__, "positions": shifted}))

    monkeypatch.setattr("pipeline.targets.patching.apply_patch", misplaced)
    assert node.step_once() == 0
    assert isinstance(node.last_error, MismatchError) and "read back" in str(node.last_error)
    monkeypatch.undo()
    assert node.step_once() == v  # recovered from the store
    assert_holds(held, trainer.states[v])


def counted_walks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(name, whether its writes were read back) of each tensor written by walking its
    delta (no patch kept) from here on."""
    calls: list[tuple[str, bool]] = []
    real, real_many = DeltaObject.apply_to, DeltaObject.apply_many

    def apply_to(self: DeltaObject, name: str, tensor: torch.Tensor, **kw: Any) -> Any:
        calls.append((name, bool(kw.get("confirm"))))
        return real(self, name, tensor, **kw)

    def apply_many(self: DeltaObject, items: Any, **kw: Any) -> Any:  # small ones, batched
        calls.extend((name, bool(kw.get("confirm"))) for name, _ in items)
        return real_many(self, items, **kw)

    monkeypatch.setattr(DeltaObject, "apply_to", apply_to)
    monkeypatch.setattr(DeltaObject, "apply_many", apply_many)
    return calls


@pytest.mark.parametrize("threads", [1, 2])
def test_a_replica_over_its_patch_budget_walks_its_writes_in_o_changed(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """With no memory for patches (``DELTASYNC_PATCH_MEMORY_MB=0``) a mixsum-128
    replica keeps only hashes: its tensors are proven from the changes, then written
    by walking their deltas, each batch read back in the walk, hashing nothing in
    full; bit for bit."""
    trainer.publish()
    held = {n: torch.zeros_like(t) for n, t in trainer.states[0].items()}
    node = RolloutNode(
        store, RUN, TorchTarget(held, patch_memory_bytes=0), NodeOptions(node_id="n")
    )
    assert node.step_once() == 0
    trainer.publish()
    assert node.step_once() == 1  # (the first apply proves the bootstrap in full)
    for _ in range(2):
        v = trainer.publish()
        monkeypatch.setattr(proving, "PROVE_THREADS", threads)  # (2: the proving pool)
        full = count_full_hashes(monkeypatch)
        walked = counted_walks(monkeypatch)
        assert node.step_once() == v
        monkeypatch.undo()
        assert full == [], "an apply hashed a tensor in full"
        changed = [e.name for e in chain.load_manifest(store, RUN, "delta", v).tensors if e.changed]
        assert walked and {n for n, _ in walked} <= set(changed)
        assert all(confirmed for _, confirmed in walked), "a walked write was not read back"
        assert_holds(held, trainer.states[v])


def test_a_replica_over_its_patch_budget_verifying_all_rehashes_with_the_runs_hash(
    trainer: Trainer, store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--verify all`` rehashes every written tensor in full: walked ones too, with
    the run's content hash (mixsum-128), not the default one."""
    trainer.publish()
    held = {n: torch.zeros_like(t) for n, t in trainer.states[0].items()}
    target = TorchTarget(held, patch_memory_bytes=0)
    node = RolloutNode(store, RUN, target, NodeOptions(node_id="n", verify="all"))
    assert node.step_once() == 0
    walked = counted_walks(monkeypatch)
    for _ in range(2):
        v = trainer.publish()
        assert node.step_once() == v
        assert_holds(held, trainer.states[v])
        assert target.hashes() == {n: mixsum.full(t) for n, t in trainer.states[v].items()}
    assert walked, "no tensor was walked"


@pytest.fixture
def events(redis_url: str) -> Iterator[EventStream]:
    client = redis_client(redis_url)
    yield EventStream(client, RUN)
    client.close()


def test_scrubber_catches_a_corrupted_untouched_element_and_the_node_repairs_it(
    trainer: Trainer, store: FileStore, events: EventStream
) -> None:
    trainer.publish()
    v = trainer.publish()
    target, held = empty_target(trainer.states[0])
    pace = ScrubPace(period_s=0.0, cpu_fraction=1.0)
    node = RolloutNode(
        store, RUN, target, NodeOptions(node_id="scrubbed", scrub=pace), events=events
    )
    assert node.scrubber is not None
    node.scrubber.stop()  # passes are run here, one at a time
    assert node.step_once() == v
    manifest = chain.load_manifest(store, RUN, "delta", v)
    untouched = next(e.name for e in manifest.tensors if e.changed == 0)
    assert node.scrubber.run_pass() == []  # known hashes hold (every tensor proven)
    patching.int_view(held[untouched]).view(-1)[7] ^= 1  # memory changed behind our back
    assert node.scrubber.run_pass() == [untouched]
    assert node.step_once() == v  # reported, then recovered from the store
    errors = [e for _, e in events.read("0-0", count=1000) if isinstance(e, ReplicaError)]
    assert errors and "scrub" in errors[-1].error and errors[-1].node == "scrubbed"
    assert_holds(held, trainer.states[v])
    assert node.scrubber.run_pass() == []
    node.close()


def test_an_apply_reads_only_changed_elements_and_the_scrubber_repairs_the_rest(
    trainer: Trainer, store: FileStore, events: EventStream
) -> None:
    """An element of a TOUCHED tensor that the delta does not change is corrupted
    before the apply: the O(changed) proof never reads it, so the version applies
    (the corruption is still there, unseen); the scrubber's full pass then finds it,
    the node reports it and recovers from the store."""
    trainer.publish()
    trainer.publish()
    target, held = empty_target(trainer.states[0])
    pace = ScrubPace(period_s=0.0, cpu_fraction=1.0)
    node = RolloutNode(
        store, RUN, target, NodeOptions(node_id="scrubbed", scrub=pace), events=events
    )
    assert node.scrubber is not None
    node.scrubber.stop()  # passes are run here, one at a time
    assert node.step_once() == 1  # bootstrap, and every held hash proven in full
    v = trainer.publish()
    manifest = chain.load_manifest(store, RUN, "delta", v)
    name = max((e for e in manifest.tensors if e.changed), key=lambda e: e.changed).name
    before = patching.int_view(trainer.states[v - 1][name]).view(-1)
    after = patching.int_view(trainer.states[v][name]).view(-1)
    kept = int(torch.nonzero(before == after)[0])  # an element this delta leaves alone
    patching.int_view(held[name]).view(-1)[kept] ^= 1  # memory changed behind our back
    assert node.step_once() == v
    flat = patching.int_view(held[name]).view(-1)
    assert int(flat[kept]) != int(after[kept]), "the apply read (and repaired) it"
    assert node.scrubber.run_pass() == [name]
    assert node.step_once() == v  # reported, then recovered from the store
    errors = [e for _, e in events.read("0-0", count=1000) if isinstance(e, ReplicaError)]
    assert errors and "scrub" in errors[-1].error and name in errors[-1].error
    assert_holds(held, trainer.states[v])
    assert node.scrubber.run_pass() == []
    node.close()


def test_a_scrubber_thread_at_its_pace_finds_a_change(trainer: Trainer) -> None:
    """The background thread: a pass at a bounded pace reports the changed tensor."""
    import threading

    from pipeline.format.hashes.scrub import Scrubber

    trainer.publish()
    target, held = empty_target(trainer.states[0])
    target.load_state(trainer.states[0].items())
    target.hashes(algorithm=MIXSUM)  # every hash known, as after a proven apply
    found = threading.Event()
    names: list[str] = []

    def mismatch(name: str) -> None:
        names.append(name)
        found.set()

    scrubber = Scrubber(target, ScrubPace(period_s=0.5, cpu_fraction=0.5), mismatch)
    name = sorted(held)[-1]
    patching.int_view(held[name]).view(-1)[0] ^= 1
    scrubber.start()
    assert found.wait(120), "the scrubber never reported the change"
    scrubber.stop()
    assert names[0] == name


def _downgrade_to_v1(store: FileStore) -> None:
    """Rewrite every manifest of the run as schema 1 (names no content hash)."""
    index = chain.list_versions(store, RUN)
    for kind, versions in (("anchor", index.anchors), ("delta", index.deltas)):
        for version in versions:
            key = manifest_key(RUN, kind, version)
            doc = json.loads(store.get(key))
            assert doc.pop("content_hash") == XXH3
            doc["schema"] = 1
            store.delete(key)
            store.put(key, json.dumps(doc).encode())


def test_v1_stores_still_verify_and_apply(
    store: FileStore, tmp_path: Path, trainer: Trainer
) -> None:
    trainer.content_hash = XXH3
    trainer.publish()
    for _ in range(2):
        v = trainer.publish()
    _downgrade_to_v1(store)
    head = chain.load_manifest(store, RUN, "delta", v)
    assert head.schema == 1 and head.content_hash == XXH3
    path = trainer.checkpoint(v, trainer.states[v])
    assert verify(store, RUN, v, path).ok
    target, held = empty_target(trainer.states[0])
    assert RolloutNode(store, RUN, target).step_once() == v
    assert_holds(held, trainer.states[v])
    # New versions of a v1 run keep its hash (schema 2 naming xxh3-128).
    v2 = trainer.publish()
    after = chain.load_manifest(store, RUN, "delta", v2)
    assert (after.schema, after.content_hash) == (2, XXH3)
    assert verify(store, RUN, v2, trainer.checkpoint(v2, trainer.states[v2])).ok


def test_manifest_schema_2_names_a_known_hash(trainer: Trainer, store: FileStore) -> None:
    trainer.publish()
    manifest = chain.load_manifest(store, RUN, "anchor", 0)
    data = to_json(manifest)
    assert parse_manifest(data) == manifest
    doc = json.loads(data)
    for bad, error in (("no-such-hash", CorruptObjectError), (None, CorruptObjectError)):
        changed = dict(doc)
        if bad is None:
            changed.pop("content_hash")
        else:
            changed["content_hash"] = bad
        with pytest.raises(error, match="content_hash"):
            parse_manifest(json.dumps(changed).encode())
    v1 = dict(doc, schema=1)
    with pytest.raises(CorruptObjectError, match="names no content_hash"):
        parse_manifest(json.dumps(v1).encode())
    with pytest.raises(CodecError, match="unsupported schema"):
        parse_manifest(json.dumps(dict(doc, schema=4)).encode())


def test_a_chain_mixing_hashes_is_refused(trainer: Trainer, store: FileStore) -> None:
    trainer.publish()
    v = trainer.publish()
    key = manifest_key(RUN, "delta", v)
    doc = json.loads(store.get(key))
    doc["content_hash"] = XXH3  # as if the run changed its hash midway
    store.delete(key)
    store.put(key, json.dumps(doc).encode())
    with pytest.raises(ChainError, match="hashes tensors with"):
        list(chain.reconstruct_tensors(store, RUN, v))


@pytest.mark.parametrize("level", [1, 3])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.bool]
)
def test_the_diff_workers_hashes_from_the_encoders_scan_are_the_full_hashes(
    level: int, dtype: torch.dtype
) -> None:
    """The encode's own scan (``on_changes``) gives each changed tensor's new hash from
    its base's; sparse, dense (every element changed) and untouched tensors alike."""
    gen = torch.Generator().manual_seed(level)
    pairs = []
    for name, numel, share in (("sparse", 50_000, 0.02), ("dense", 3000, 1.0), ("same", 500, 0.0)):
        width = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=gen)
        base = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
        flat = patching.int_view(base.clone()).view(-1)
        hit = torch.rand(numel, generator=gen) < share
        flat[hit] ^= 1  # the lowest bit: 0/1 stays a bool
        pairs.append((name, base, flat.view(dtype)))
    held = {name: mixsum.full(base) for name, base, _ in pairs}
    hook, counts, scanned = scan_hasher(pairs, held, content_hashes.get(MIXSUM))
    data = encode_delta(pairs, level, on_changes=hook)
    assert set(scanned) == set(counts) == {"sparse", "dense"}
    got = {name: scanned.get(name, held[name]) for name, _, _ in pairs}
    assert got == {name: mixsum.full(new) for name, _, new in pairs}
    # The counts are the object's, so the diff worker records them without parsing it.
    encoded = {t.name: t.changed for t in read_delta(data, object_name="p").tensors}
    assert encoded == {name: counts.get(name, 0) for name, _, _ in pairs}
    assert counts["dense"] == 3000


def test_an_encoder_that_leaves_changes_untold_fails_the_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The diff worker takes counts and hashes from what the encoder tells its hook: an
    encoding that changed a tensor without telling (here: the hook dropped) fails the
    object instead of publishing the base's hash for new contents."""
    base = torch.zeros(1000, dtype=torch.bfloat16)
    new = base.clone()
    new[::7] = 1.0
    untold = codec_api.encode_tensor

    def dropping(*args: Any) -> Any:
        return untold(*args[:4], None, *args[5:])

    monkeypatch.setattr(codec_api, "encode_tensor", dropping)
    hook, counts, scanned = scan_hasher([("w", base, new)], {"w": mixsum.full(base)}, None)
    with pytest.raises(CodecError, match=r"tensor 'w': the encoder reported 0 changes for 143"):
        encode_delta([("w", base, new)], 1, on_changes=hook)
    assert not counts and not scanned
