"""The version chain: resolve, reconstruct bit-exactly, verify, GC planning."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.errors import ChainError, CorruptObjectError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import TensorEntry, compute_state_hash, manifest_key
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.step import PublishResult, publish_step
from pipeline.publish.version import DEFAULT_OPTIONS, PublishOptions
from pipeline.store.base import ObjectStore
from pipeline.store.file import FileStore
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from pipeline.versions import chain, retention, verify
from pipeline.versions.policy import ChainTally, tally
from tests.format.test_checkpoint import same_bits, special_tensors

# About 150k parameters: real AdamW updates on a real loss, fast on two cores.
SMALL = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    intermediate_size=128,
    max_seq_len=32,
    batch_size=2,
)
PART_BYTES = 64 << 10  # several parts per version


class SyntheticRun:
    """A trainer stand-in: bf16 states of a model under AdamW, published step by step."""

    def __init__(
        self, tmp: Path, store: ObjectStore, run: str = "run-a", *, seed: int = 0, lr: float = 1e-5
    ) -> None:
        self.tmp, self.store, self.run = tmp, store, run
        self.gen = UpdateGenerator(SMALL, lr=lr, seed=seed)
        self.cache = StateCache(tmp / "cache", run)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.paths: dict[int, Path] = {}

    def checkpoint(self, step: int, *, sharded: bool = False) -> Path:
        """The trainer's weights after one more optimizer step, saved as ``step``."""
        state = self.gen.state() if not self.states else self.gen.step()
        self.states[step] = {k: v.clone() for k, v in state.items()}
        path = self.tmp / f"ckpt-{step}" if sharded else self.tmp / f"ckpt-{step}.safetensors"
        write_checkpoint(path, state.items(), max_shard_bytes=100_000 if sharded else None)
        self.paths[step] = path
        return path

    def publish(
        self, step: int, options: PublishOptions = DEFAULT_OPTIONS, **kwargs: object
    ) -> PublishResult:
        """Publish the next checkpoint as ``step`` with ``options`` in parts of PART_BYTES."""
        path = self.checkpoint(step)
        return publish_step(
            self.store,
            self.run,
            step,
            path,
            self.cache,
            replace(options, part_bytes=PART_BYTES),
            **kwargs,  # type: ignore[arg-type]
        )

    def assert_rebuilds(self, version: int) -> None:
        got = dict(chain.reconstruct_tensors(self.store, self.run, version))
        want = self.states[version]
        assert list(got) == list(want)
        for name, tensor in want.items():
            assert same_bits(got[name], tensor), (version, name)


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def test_a_carried_chain_tally_equals_one_resolved_from_the_store(
    file_store: FileStore, tmp_path: Path
) -> None:
    """The policy's tally, carried from step to step, against the chain read again."""
    trainer = SyntheticRun(tmp_path, file_store)
    carried: ChainTally | None = None
    for step in range(7):
        if step == 4:
            compact(file_store, trainer.run, 3)  # a new anchor under the next step
        published = trainer.publish(step).manifest
        carried = tally(file_store, trainer.run, step, last=carried, published=published)
        assert carried == tally(file_store, trainer.run, step), step
    assert carried == ChainTally(6, 3, carried.anchor_bytes, 3, carried.delta_bytes)
    assert carried.reason(max_chain=3, max_delta_fraction=1.0) == "chain of 3 deltas reached 3"
    assert carried.reason(max_chain=4, max_delta_fraction=1.0) is None
    # A tally that is not the parent's is not carried on.
    stale = ChainTally(5, 0, 1, 1, 10**12)
    assert tally(file_store, trainer.run, 6, last=stale, published=published) == carried


def test_every_version_rebuilds_bit_exactly(store: ObjectStore, tmp_path: Path) -> None:
    """Over every backend: anchors and deltas, gaps, a compaction mid-chain."""
    trainer = SyntheticRun(tmp_path, store)
    for step in (0, 1, 4):
        assert trainer.publish(step).status == "published"
    assert compact(store, trainer.run).version == 4
    for step in (6, 9):
        trainer.publish(step)
    index = chain.list_versions(store, trainer.run)
    assert index.deltas == (1, 4, 6, 9) and index.anchors == (0, 4) and index.head == 9
    plan = chain.resolve(store, trainer.run, 9)
    assert plan.anchor.version == 4 and [m.version for m in plan.deltas] == [6, 9]
    for version in (0, 1, 4, 6, 9):
        trainer.assert_rebuilds(version)
    out = chain.reconstruct(store, trainer.run, 9, tmp_path / "rebuilt.safetensors")
    assert out.version == 9
    with CheckpointReader(tmp_path / "rebuilt.safetensors") as reader:
        assert all(same_bits(reader.get(n), t) for n, t in trainer.states[9].items())
    report = verify.verify(store, trainer.run, 9, trainer.paths[9])
    assert report.ok, report.describe()
    assert report.tensors == len(trainer.states[9]) and report.objects > 0


def test_changed_fraction_is_realistic(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store, lr=1e-6)
    trainer.publish(0)
    result = trainer.publish(1)
    assert result.manifest is not None
    assert 0 < result.changed < result.total * 0.5
    assert result.bytes < 0.5 * chain.load_manifest(file_store, "run-a", "anchor", 0).total_bytes


def test_resolve_with_gaps_and_several_anchors(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    for step in (0, 3, 4, 8):
        trainer.publish(step)
    compact(file_store, trainer.run, 4)
    trainer.publish(10)
    trainer.publish(15)
    compact(file_store, trainer.run, 15)
    run = trainer.run

    def shape(v: int) -> tuple[int, list[int]]:
        plan = chain.resolve(file_store, run, v)
        return plan.anchor.version, [m.version for m in plan.deltas]

    assert shape(3) == (0, [3])
    assert shape(4) == (4, [])
    assert shape(8) == (4, [8])
    assert shape(10) == (4, [8, 10])
    assert shape(15) == (15, [])
    with pytest.raises(ChainError, match="no version 7"):
        chain.resolve(file_store, run, 7)

    # Without anchor 4 the chain falls back to anchor 0 through delta 4.
    file_store.delete(manifest_key(run, "anchor", 4))
    assert shape(10) == (0, [3, 4, 8, 10])
    trainer.assert_rebuilds(10)

    # A missing delta breaks every chain through it, and the error names it.
    file_store.delete(manifest_key(run, "delta", 8))
    with pytest.raises(ChainError, match="version 8"):
        chain.resolve(file_store, run, 10)
    assert shape(15) == (15, [])  # an anchor above the gap still serves
    trainer.assert_rebuilds(15)


def _first_object_key(store: ObjectStore, run: str, kind: str, version: int) -> str:
    m = chain.load_manifest(store, run, kind, version)  # type: ignore[arg-type]
    return m.object_key(m.objects[0].key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_object_is_named(file_store: FileStore, tmp_path: Path, damage: str) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    for step in (0, 1, 2):
        trainer.publish(step)
    key = _first_object_key(file_store, trainer.run, "delta", 1)
    data = file_store.get(key)
    if damage == "flip":
        file_store.put(key, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        file_store.put(key, data[:-1])
    else:
        file_store.delete(key)
    with pytest.raises(CorruptObjectError, match=key):
        list(chain.reconstruct_tensors(file_store, trainer.run, 2))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptObjectError, match=key):
        chain.reconstruct(file_store, trainer.run, 2, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    report = verify.verify(file_store, trainer.run, 2, trainer.paths[2])
    assert not report.ok and key in report.bad_objects[0]
    trainer.assert_rebuilds(0)  # versions that do not need the object still rebuild


def test_damaged_manifest_is_named(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    trainer.publish(1)
    key = manifest_key(trainer.run, "delta", 1)
    file_store.put(key, file_store.get(key)[:-10])
    with pytest.raises(CorruptObjectError, match=key):
        chain.resolve(file_store, trainer.run, 1)


def test_manifest_hash_is_enforced(file_store: FileStore, tmp_path: Path) -> None:
    """A well-formed manifest whose tensor hash disagrees with the data stops the rebuild."""
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    trainer.publish(1)
    key = manifest_key(trainer.run, "delta", 1)
    doc = json.loads(file_store.get(key))
    victim = doc["tensors"][2]
    victim["hash"] = "0" * 32
    entries = [
        TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["hash"], t["object"], t["changed"])
        for t in doc["tensors"]
    ]
    doc["state_hash"] = compute_state_hash(entries)
    file_store.put(key, json.dumps(doc).encode())
    with pytest.raises(CorruptObjectError, match=victim["name"]):
        list(chain.reconstruct_tensors(file_store, trainer.run, 1))
    report = verify.verify(file_store, trainer.run, 1, trainer.paths[1])
    assert [(d.name, d.reason) for d in report.differences] == [(victim["name"], "manifest-hash")]


def test_verify_names_differing_tensors(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    trainer.publish(1)
    state = {k: v.clone() for k, v in trainer.states[1].items()}
    name = "model.layers.1.mlp.down_proj.weight"
    flat = state[name].view(-1).view(torch.int16)
    flat[5] ^= 1  # one unit in the last place
    flat[7] ^= -0x8000  # only the sign bit: 0.0 vs -0.0 must count
    dropped = "model.norm.weight"
    del state[dropped]
    write_checkpoint(tmp_path / "other.safetensors", state.items())
    report = verify.verify(file_store, trainer.run, 1, tmp_path / "other.safetensors")
    assert not report.ok
    found = {d.name: d for d in report.differences}
    assert found[name].reason == "content" and found[name].differing == 2
    assert found[dropped].reason == "missing"
    assert len(found) == 2
    assert name in report.describe()


def test_gc_plan() -> None:
    index = chain.VersionIndex("r", deltas=(1, 2, 3, 5, 6, 8, 9), anchors=(0, 5, 8))

    def versions(keep: int, live: int | None) -> list[str]:
        return [
            k.split("/")[1][0] + str(int(k.split("/")[2]))
            for k in retention.gc_plan(index, keep, live)
        ]

    # Nothing live: keep the newest anchor and the head's chain after it.
    assert versions(1, None) == ["a0", "a5", "d1", "d2", "d3", "d5", "d6", "d8"]
    # A replica at 3 still needs 5, 6, 8, 9; anchors kept by count.
    assert versions(2, 3) == ["a0", "d1", "d2", "d3"]
    # A replica at the head needs nothing old; keep_anchors < 1 still keeps one.
    assert versions(0, 9) == ["a0", "a5", "d1", "d2", "d3", "d5", "d6", "d8"]
    assert retention.gc_plan(chain.VersionIndex("r", (), ()), 1, None) == []
    assert retention.gc_plan(chain.VersionIndex("r", (1, 2), ()), 1, None) == []


def test_collect_garbage_keeps_what_is_needed(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    for step in (0, 1, 2):
        trainer.publish(step)
    compact(file_store, trainer.run, 2)
    # Remains of a publish of step 3 that crashed before its manifest.
    orphan = f"{trainer.run}/deltas/{3:010d}/part-00000.safetensors"
    file_store.put(orphan, b"x")
    trainer.publish(5)
    stray = f"{trainer.run}/deltas/{5:010d}/part-00099.safetensors"
    file_store.put(stray, b"x")
    deleted = collect_garbage(file_store, trainer.run, keep_anchors=1, min_live_version=1)
    index = chain.list_versions(file_store, trainer.run)
    assert index.anchors == (2,) and index.deltas == (2, 5)
    assert manifest_key(trainer.run, "delta", 1) in deleted
    assert manifest_key(trainer.run, "anchor", 0) in deleted
    assert orphan in deleted and not file_store.exists(orphan)
    assert file_store.exists(stray)  # inside a published version: not GC's to judge
    # Manifests are deleted before their objects.
    first_object = next(i for i, k in enumerate(deleted) if not k.endswith("manifest.json"))
    assert all(k.endswith("manifest.json") for k in deleted[:first_object])
    assert not list(file_store.list(f"{trainer.run}/deltas/{1:010d}/"))
    assert not list(file_store.list(f"{trainer.run}/anchors/{0:010d}/"))
    for version in (2, 5):
        trainer.assert_rebuilds(version)
    assert collect_garbage(file_store, trainer.run, keep_anchors=1, min_live_version=1) == []


def test_every_dtype_and_bit_pattern_survives_the_chain(
    file_store: FileStore, tmp_path: Path
) -> None:
    """NaN payloads, -0.0, infinities, fp8, bool and integers: bit-exact at every version."""
    cache = StateCache(tmp_path / "cache", "odd")
    states = {}
    for step, seed in ((0, 10), (5, 11), (6, 11), (9, 12)):
        state = special_tensors(seed)
        if step == 6:  # a version where only one element moves
            state["bf16.specials"].view(torch.int16)[0] ^= 1
        states[step] = state
        path = write_checkpoint(tmp_path / f"odd-{step}.safetensors", state.items())
        publish_step(file_store, "odd", step, path, cache, PublishOptions(level=3, part_bytes=512))
    assert chain.load_manifest(file_store, "odd", "delta", 6).extra["changed"] == 1
    for step, state in states.items():
        got = dict(chain.reconstruct_tensors(file_store, "odd", step))
        assert list(got) == list(state)
        assert all(same_bits(got[n], t) for n, t in state.items()), step
