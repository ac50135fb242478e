"""The state cache linked to the trainer's own checkpoints (DELTASYNC_CACHE_LINK).

Linking must never write into a trainer's file, and a trainer that rewrites a
linked checkpoint in place must cost a rebuild, never a wrong version.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

from pipeline.errors import MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.manifest import manifest_key
from pipeline.publish import diff as publish
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.diff import publish_delta
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore
from pipeline.versions import chain
from tests.publish.test_chain import SyntheticRun


def digests(path: Path) -> dict[str, str]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def cached_files(cache: StateCache) -> list[Path]:
    folder = cache.folder
    assert folder is not None
    return sorted(folder.iterdir())


@pytest.fixture
def trainer(tmp_path: Path) -> SyntheticRun:
    return SyntheticRun(tmp_path, FileStore(tmp_path / "store"))


def publish_linked(trainer: SyntheticRun, step: int, *, sharded: bool = False, **kw: Any) -> Path:
    path = trainer.checkpoint(step, sharded=sharded)
    got = publish_step(
        trainer.store, trainer.run, step, path, trainer.cache, PublishOptions(part_bytes=4096), **kw
    )
    assert got.status == "published"
    return path


@pytest.mark.parametrize("sharded", [False, True])
def test_linked_cache_copies_nothing_and_never_writes_the_trainers_files(
    trainer: SyntheticRun, sharded: bool
) -> None:
    written = {}
    for step in range(4):
        path = publish_linked(trainer, step, sharded=sharded, link=True)
        written[step] = digests(path)
        ours = {f.stat().st_ino for f in cached_files(trainer.cache)}
        theirs = {f.stat().st_ino for f in (path.iterdir() if sharded else [path])}
        assert ours == theirs  # links, not copies
        if step > 0:  # the trainer deletes what it no longer needs; the cache keeps it
            old = trainer.paths[step - 1]
            assert digests(old) == written[step - 1]
            for f in old.iterdir() if sharded else [old]:
                f.unlink()
    for step in range(4):
        trainer.assert_rebuilds(step)
    assert digests(trainer.paths[3]) == written[3]


def test_a_checkpoint_rewritten_in_place_costs_a_rebuild_not_a_wrong_version(
    trainer: SyntheticRun,
) -> None:
    publish_linked(trainer, 0, link=True)
    one = publish_linked(trainer, 1, link=True)
    inode = one.stat().st_ino
    # The trainer reuses the path for other weights, truncating the same inode.
    other = {k: v.clone() for k, v in trainer.gen.step().items()}
    with one.open("wb") as f:  # as torch.save and most writers do
        f.write(safetensors.torch.save(other))
    assert one.stat().st_ino == inode
    rewritten = digests(one)
    publish_linked(trainer, 2, link=True)
    assert (trainer.cache.root / StateCache.LINKS_OFF).exists()
    assert digests(one) == rewritten  # the rebuild did not write into the trainer's file
    for step in (0, 1, 2):  # the store still holds what was published, bit for bit
        trainer.assert_rebuilds(step)
    three = publish_linked(trainer, 3, link=True)
    assert all(f.stat().st_nlink == 1 for f in cached_files(trainer.cache))  # copied now
    assert three.stat().st_nlink == 1
    trainer.assert_rebuilds(3)


def test_a_cache_that_cannot_link_copies_without_writing_into_the_linked_one(
    trainer: SyntheticRun,
) -> None:
    zero = publish_linked(trainer, 0, link=True)
    before = digests(zero)
    assert zero.stat().st_nlink == 2
    publish_linked(trainer, 1, link=False)  # as when linking fails (another file system)
    assert digests(zero) == before
    assert all(f.stat().st_nlink == 1 for f in cached_files(trainer.cache))
    with CheckpointReader(trainer.paths[1]) as new, trainer.cache.reader() as cached:
        assert all(cached.view(n).equal(new.view(n)) for n in new.names())
    trainer.assert_rebuilds(1)


@pytest.mark.parametrize("when", ["before its hashes", "after its hashes"])
def test_a_base_rewritten_while_it_is_encoded_is_never_published(
    trainer: SyntheticRun, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The trainer writes into the linked base during the diff: caught by the base's
    hashes, or, once a part's hashes are taken, by the files' fingerprints."""
    zero = publish_linked(trainer, 0, link=True)
    parent = chain.load_manifest(trainer.store, trainer.run, "anchor", 0)
    with CheckpointReader(zero) as reader:
        _, offset, _ = reader.location(parent.parts()[0][1][0])  # first part's first tensor
    hook = "encode_delta" if when == "before its hashes" else "sha256_bytes"
    real = getattr(publish, hook)
    calls = []

    def trainer_writes_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if not calls:
            with zero.open("r+b") as f:
                byte = os.pread(f.fileno(), 1, offset)[0]
                os.pwrite(f.fileno(), bytes([byte ^ 0x01]), offset)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(publish, hook, trainer_writes_meanwhile)
    publish_linked(trainer, 1, link=True)
    assert calls
    assert (trainer.cache.root / StateCache.LINKS_OFF).exists()
    trainer.assert_rebuilds(1)


def test_publish_delta_refuses_a_base_that_changed(trainer: SyntheticRun) -> None:
    publish_linked(trainer, 0)
    path = trainer.checkpoint(1)
    parent = chain.load_manifest(trainer.store, trainer.run, "anchor", 0)
    with (
        trainer.cache.reader() as base,
        CheckpointReader(path) as new,
        pytest.raises(MismatchError, match="was modified while delta 1 was encoded"),
    ):
        publish_delta(
            trainer.store, trainer.run, 1, base, new, parent, base_unchanged=lambda: False
        )
    assert not trainer.store.exists(manifest_key(trainer.run, "delta", 1))
