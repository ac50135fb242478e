"""Publishing: parts, anchors, deltas, idempotency, the state cache, compaction, crashes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.errors import ChainError, CorruptObjectError, MismatchError, SignatureError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import manifest_key
from pipeline.publish import diff as publish
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import compact
from pipeline.publish.diff import publish_delta, shares_by_bytes
from pipeline.publish.parts import plan_parts
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.store.base import ObjectStore
from pipeline.store.file import FileStore
from pipeline.store.trust import trusted
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain
from tests.format.test_checkpoint import same_bits
from tests.publish.test_chain import PART_BYTES, SyntheticRun

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def snapshot(store: ObjectStore, run: str) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list(f"{run}/")}


def test_plan_parts() -> None:
    sizes = [("a", 40), ("b", 40), ("c", 40), ("big", 500), ("d", 10), ("e", 0)]
    assert plan_parts(sizes, 100) == [
        ("part-00000.safetensors", ["a", "b"]),
        ("part-00001.safetensors", ["c"]),
        ("part-00002.safetensors", ["big"]),
        ("part-00003.safetensors", ["d", "e"]),
    ]
    assert plan_parts([], 100) == []


def test_publish_step_sequence_and_idempotency(store: ObjectStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, store)
    first = trainer.publish(0)
    assert (first.status, first.kind, first.head) == ("published", "anchor", None)
    assert first.manifest is not None and len(first.manifest.objects) > 1
    second = trainer.publish(2)
    assert (second.status, second.kind, second.head) == ("published", "delta", 0)
    assert second.manifest is not None and second.manifest.parent == 0
    assert second.manifest.parent_state_hash == first.manifest.state_hash
    assert set(second.timings) >= {"read_s", "encode_s", "upload_s", "total_s"}
    assert second.summary()["status"] == "published"

    before = snapshot(store, trainer.run)
    again = publish_step(
        store,
        trainer.run,
        2,
        trainer.paths[2],
        trainer.cache,
        PublishOptions(part_bytes=PART_BYTES),
    )
    assert again.status == "skipped" and again.manifest == second.manifest
    stale = publish_step(
        store,
        trainer.run,
        1,
        trainer.paths[0],
        trainer.cache,
        PublishOptions(part_bytes=PART_BYTES),
    )
    assert stale.status == "skipped" and stale.manifest is None and "head is 2" in stale.reason
    # publish_delta itself is idempotent too, and refuses an old version.
    with CheckpointReader(trainer.paths[0]) as base, CheckpointReader(trainer.paths[2]) as new:
        assert publish_delta(store, trainer.run, 2, base, new, first.manifest) == (second.manifest)
        with pytest.raises(ChainError, match="step 1 is not newer than head 2"):
            publish_delta(store, trainer.run, 1, base, new, first.manifest)
    assert snapshot(store, trainer.run) == before  # nothing was written
    trainer.assert_rebuilds(2)


def test_partition_is_fixed_by_the_first_anchor(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    anchor = chain.load_manifest(file_store, trainer.run, "anchor", 0)
    path = trainer.checkpoint(1, sharded=True)  # a different file layout, too
    result = publish_step(
        file_store, trainer.run, 1, path, trainer.cache, PublishOptions(level=3, part_bytes=1 << 30)
    )
    assert result.manifest is not None
    assert result.manifest.parts() == anchor.parts()
    assert result.manifest.codec.level == 3
    compacted = compact(file_store, trainer.run)
    assert compacted.parts() == anchor.parts()
    trainer.assert_rebuilds(1)


def test_anchor_parts_are_plain_safetensors(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    manifest = trainer.publish(0).manifest
    assert manifest is not None and manifest.codec.name == "safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for entry in manifest.objects:
        loaded.update(safetensors.torch.load(file_store.get(manifest.object_key(entry.key))))
    assert set(loaded) == set(trainer.states[0])
    assert all(same_bits(loaded[n], t) for n, t in trainer.states[0].items())


@pytest.mark.parametrize("change", ["shape", "dtype", "missing", "extra"])
def test_mismatched_checkpoint_is_refused(
    file_store: FileStore, tmp_path: Path, change: str
) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    state = dict(trainer.gen.step())
    victim = "model.layers.0.mlp.up_proj.weight"
    if change == "shape":
        state[victim] = state[victim][:-1]
    elif change == "dtype":
        state[victim] = state[victim].float()
    elif change == "missing":
        del state[victim]
    else:
        victim = "model.extra.weight"
        state[victim] = torch.zeros(3, dtype=torch.bfloat16)
    path = write_checkpoint(tmp_path / "bad.safetensors", state.items())
    before = snapshot(file_store, trainer.run)
    with pytest.raises(MismatchError, match=victim):
        publish_step(file_store, trainer.run, 1, path, trainer.cache)
    assert snapshot(file_store, trainer.run) == before


def test_hash_shares_balance_bytes() -> None:
    def pair(name: str, numel: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        return name, torch.zeros(numel), torch.zeros(numel)

    pairs = [pair("a", 10), pair("b", 70), pair("c", 30), pair("d", 40), pair("e", 0)]
    shares = shares_by_bytes(pairs, 2)
    assert [[n for n, _, _ in s] for s in shares] == [["b", "a"], ["d", "c", "e"]]
    assert sorted(n for s in shares_by_bytes(pairs, 8) for n, _, _ in s) == list("abcde")
    assert len(shares_by_bytes(pairs, 8)) == 5 and shares_by_bytes([], 3) == []


@pytest.mark.parametrize("threads", [1, 3])
def test_wrong_base_is_refused_and_hashes_match_on_any_threads(
    file_store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(publish, "HASH_THREADS", threads)
    trainer = SyntheticRun(tmp_path, file_store)
    anchor = trainer.publish(0).manifest
    assert anchor is not None
    one = trainer.checkpoint(1)
    with (
        CheckpointReader(one) as base,
        CheckpointReader(one) as new,
        pytest.raises(MismatchError, match="does not match version 0"),
    ):
        publish_delta(file_store, trainer.run, 1, base, new, anchor)
    assert not file_store.exists(manifest_key(trainer.run, "delta", 1))
    with CheckpointReader(trainer.paths[0]) as base, CheckpointReader(one) as new:
        delta = publish_delta(file_store, trainer.run, 1, base, new, anchor)
        full = content_hashes.of(anchor).full  # the run's (updated from the changes)
        expected = {n: full(new.view(n)) for n in new.names()}
    assert {t.name: t.hash for t in delta.tensors} == expected
    assert {t.name: t.hash for t in delta.tensors} != {t.name: t.hash for t in anchor.tensors}


@pytest.mark.parametrize("damage", ["deleted", "stale", "garbled", "bytes"])
def test_cache_is_rebuilt_from_the_store(
    file_store: FileStore, tmp_path: Path, damage: str
) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    trainer.publish(1)
    state_file = trainer.cache.root / StateCache.STATE
    if damage == "deleted":
        shutil.rmtree(trainer.cache.root)
    elif damage == "stale":
        doc = json.loads(state_file.read_text())
        doc["version"] = 0
        state_file.write_text(json.dumps(doc))
    elif damage == "garbled":
        state_file.write_text("{not json")
    else:  # the cache claims version 1 but a weight's bytes rotted on disk
        folder = trainer.cache.folder
        assert folder is not None
        part = sorted(folder.glob("part-*.safetensors"))[0]
        data = bytearray(part.read_bytes())
        data[-1] ^= 0x10
        part.write_bytes(bytes(data))
    assert trainer.cache.version in (None, 0, 1)
    result = trainer.publish(3)
    assert result.status == "published" and trainer.cache.version == 3
    assert len([p for p in trainer.cache.root.iterdir() if p.is_dir()]) == 1
    trainer.assert_rebuilds(3)
    with trainer.cache.reader() as reader:
        assert all(same_bits(reader.get(n), t) for n, t in trainer.states[3].items())


def test_signed_versions(file_store: FileStore, tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0, PublishOptions(signing_key=key))
    trainer.publish(1, PublishOptions(signing_key=key))
    plan = chain.resolve(trusted(file_store, key.public_key()), trainer.run, 1)
    assert all(m.signature is not None for m in plan.manifests)
    anchor = compact(file_store, trainer.run, 1, PublishOptions(signing_key=key))
    assert anchor.signature is not None
    chain.load_manifest(trusted(file_store, key.public_key()), trainer.run, "anchor", 1)
    with pytest.raises(SignatureError):
        other = Ed25519PrivateKey.generate().public_key()
        chain.resolve(trusted(file_store, other), trainer.run, 1)


def test_compaction(store: ObjectStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, store)
    for step in (0, 1, 2):
        trainer.publish(step)
    anchor = compact(store, trainer.run)
    delta = chain.load_manifest(store, trainer.run, "delta", 2)
    assert (anchor.kind, anchor.version, anchor.parent) == ("anchor", 2, 1)
    assert anchor.state_hash == delta.state_hash
    assert anchor.parent_state_hash == delta.parent_state_hash
    before = snapshot(store, trainer.run)
    assert compact(store, trainer.run, 2) == anchor  # idempotent
    assert snapshot(store, trainer.run) == before
    assert chain.resolve(store, trainer.run, 2).deltas == ()
    trainer.assert_rebuilds(2)
    trainer.publish(3)
    assert chain.resolve(store, trainer.run, 3).anchor.version == 2
    trainer.assert_rebuilds(3)
    with pytest.raises(ChainError, match="no version 7"):
        compact(store, trainer.run, 7)


def test_compaction_of_a_damaged_chain_writes_no_anchor(
    file_store: FileStore, tmp_path: Path
) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    for step in (0, 1, 2):
        trainer.publish(step)
    m = chain.load_manifest(file_store, trainer.run, "delta", 1)
    key = m.object_key(m.objects[-1].key)
    data = file_store.get(key)
    file_store.put(key, data[:-1] + bytes([data[-1] ^ 0x40]))
    with pytest.raises(CorruptObjectError, match=key):
        compact(file_store, trainer.run, 2)
    assert chain.list_versions(file_store, trainer.run).anchors == (0,)


def test_anchor_must_match_what_it_replaces(file_store: FileStore, tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    trainer.publish(0)
    trainer.publish(1)
    delta = chain.load_manifest(file_store, trainer.run, "delta", 1)
    with (
        CheckpointReader(trainer.paths[0]) as wrong,
        pytest.raises(MismatchError, match="does not match"),
    ):
        publish_anchor(
            file_store,
            trainer.run,
            1,
            wrong,
            parent=0,
            reason="test",
            layout=delta.parts(),
            expected=delta,
        )
    assert chain.list_versions(file_store, trainer.run).anchors == (0,)


_CRASH_SCRIPT = """
import sys
from pathlib import Path
from pipeline.publish.step import publish_step
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore

root, run, step, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
store = FileStore(Path(root) / "store")
cache = StateCache(Path(root) / "cache", run)
publish_step(store, run, step, ckpt, cache, PublishOptions(part_bytes=int(sys.argv[5])))
print("finished")
"""


def _publish_in_child(trainer: SyntheticRun, step: int, fault: str) -> int:
    env = {**os.environ, "DELTASYNC_FAULT": fault, "PYTHONPATH": str(REPO)}
    args = [str(trainer.tmp), trainer.run, str(step), str(trainer.paths[step]), str(PART_BYTES)]
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "finished" not in proc.stdout, proc.stderr
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize(
    ("step", "fault", "exists"),
    [
        (0, "anchor.after_upload", False),
        (0, "anchor.before_manifest", False),
        (1, "publish.after_read", False),
        (1, "publish.after_encode", False),
        (1, "publish.after_upload", False),
        (1, "publish.before_manifest", False),
        (1, "publish.after_manifest", True),
    ],
)
def test_a_crash_leaves_a_whole_version_or_none(
    file_store: FileStore, tmp_path: Path, step: int, fault: str, exists: bool
) -> None:
    trainer = SyntheticRun(tmp_path, file_store)
    if step == 1:
        trainer.publish(0)
    trainer.checkpoint(step)
    assert _publish_in_child(trainer, step, fault) == -signal.SIGKILL
    index = chain.list_versions(file_store, trainer.run)
    assert (index.head == step) is exists
    # The job runs again (the queue retries it): it publishes or sees it done.
    rerun = publish_step(
        file_store,
        trainer.run,
        step,
        trainer.paths[step],
        trainer.cache,
        PublishOptions(part_bytes=PART_BYTES),
    )
    assert rerun.status == ("skipped" if exists else "published")
    trainer.publish(step + 1)  # the cache recovers whatever state the crash left
    for version in range(step + 2):
        trainer.assert_rebuilds(version)


def test_a_delta_is_not_published_when_the_head_moved_while_it_was_encoded(
    tmp_path: Path,
) -> None:
    """A diff job that stalled past its lease can be overtaken: another job publishes
    a newer step while this one encodes. Its manifest must not be written."""
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=11)
    paths = []
    for step in range(3):
        state = generator.state() if step == 0 else generator.step()
        paths.append(tmp_path / f"s{step}.safetensors")
        save_state(state, paths[-1])
    plain = FileStore(tmp_path / "store")
    publish_step(plain, "r", 0, paths[0], StateCache(tmp_path / "a", "r"))
    other = StateCache(tmp_path / "b", "r")
    other.rebuild(plain, "r", 0)

    class Overtaken(FileStore):
        """The same folder; the first object of delta 1 lets another writer in."""

        overtaken = False

        def put(self, key: str, data: bytes) -> None:
            super().put(key, data)
            if "/deltas/0000000001/" in key and not self.overtaken:
                self.overtaken = True
                publish_step(plain, "r", 2, paths[2], other)

    slow = Overtaken(tmp_path / "store")
    with pytest.raises(ChainError, match="head moved to 2"):
        publish_step(slow, "r", 1, paths[1], StateCache(tmp_path / "a", "r"))
    assert slow.overtaken
    index = chain.list_versions(plain, "r")
    assert index.versions == (0, 2) and 1 not in index.deltas
