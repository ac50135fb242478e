"""The diff worker's scrub of a sharded run's rank caches: a changed byte in a cached
piece is found, the rank cache forgotten and rebuilt (proven) by the next step; a scrub
racing with the cache's advances never reports a false mismatch."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest
import torch

from pipeline.coord.connection import redis_client
from pipeline.coord.problems import list_cache_damage
from pipeline.format.hashes.scrub import Scrubber, ScrubPace
from pipeline.publish.caches.cache_scrub import CacheMovedError, CacheScrub, CacheScrubber
from pipeline.publish.caches.rank_cache import RankCache
from pipeline.publish.caches.state_cache import CacheBusyError
from pipeline.publish.ranks.sharded import HostSide, _ready
from pipeline.store.file import FileStore
from pipeline.testing.sharded import piece_of
from pipeline.versions import chain
from tests.pipeline_helpers import bits, wait_for
from tests.publish.test_gc_orphans import CompactsOnRead
from tests.sharded_store import PiecedRun, build_pieced_run

FAST = ScrubPace(period_s=0.0, cpu_fraction=1.0)
RANK = 1


@pytest.fixture
def built(tmp_path: Path) -> PiecedRun:
    return build_pieced_run(FileStore(tmp_path / "store"), "run-a", deltas=3)


def truth(built: PiecedRun, version: int, rank: int) -> dict[str, torch.Tensor]:
    return {r.name: piece_of(built.states[version], r) for r in built.ranges[rank]}


def assert_holds(cache: RankCache, pieces: dict[str, torch.Tensor]) -> None:
    with cache.reader() as reader:
        assert set(reader.names()) == set(pieces)
        for name, piece in pieces.items():
            assert torch.equal(bits(reader.get(name)), bits(piece)), name


def rebuilt(cache: RankCache, built: PiecedRun, version: int) -> None:
    manifest = built.manifests[version]
    with cache.locked():
        cache.rebuild(built.store, manifest, cache.keys_of(manifest))


def flip_unchanged_byte(
    cache: RankCache, held: dict[str, torch.Tensor], nxt: dict[str, torch.Tensor]
) -> str:
    """Flip one bit, in the file on disk, of a cached element the next version leaves
    unchanged; the tensor's name."""
    for name, before in held.items():
        same = bits(before) == bits(nxt[name])
        if not bool(same.any()):
            continue
        index = int(same.nonzero()[0])
        with cache.reader() as reader:
            path, offset, _ = reader.location(name)
        fd = os.open(path, os.O_RDWR)
        try:
            at = offset + index * before.element_size()
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
        finally:
            os.close(fd)
        return name
    raise AssertionError("no unchanged element")


def test_a_flipped_byte_in_a_rank_cache_is_found_and_the_next_step_rebuilds_it_proven(
    built: PiecedRun, tmp_path: Path, redis_url: str
) -> None:
    cache_dir = tmp_path / "cache"
    cache = RankCache(cache_dir, built.run, RANK)
    one = built.manifests[1]
    keys = cache.keys_of(one)
    assert keys == [f"part-r{RANK:05d}-00000.safetensors"]
    rebuilt(cache, built, 1)
    assert cache.is_proven_for(one, keys)
    scrub = CacheScrub(cache, built.store)
    failed: list[str] = []
    scrubber = Scrubber(scrub, FAST, failed.append)
    assert sorted(scrub.scrub_names()) == sorted(truth(built, 1, RANK))
    assert scrubber.run_pass() == [] and failed == []  # the intact cache matches

    name = flip_unchanged_byte(cache, truth(built, 1, RANK), truth(built, 2, RANK))
    assert scrubber.run_pass() == [name] and failed == [name]
    assert scrub.damaged is not None and scrub.damaged[:2] == (1, name)
    assert cache.version is None and not cache.is_valid_for(one, keys), "forgotten"
    assert scrubber.run_pass() == []  # nothing held to scrub

    # The next step brings the cache to its parent: rebuilt from the store, proven.
    client = redis_client(redis_url)
    side = HostSide(client, built.store, "host-a", tmp_path / "staging", cache_dir, 1 << 20)
    assert _ready(side, cache, one, keys, rebuild=False) is True
    assert cache.is_proven_for(one, keys)
    assert_holds(cache, truth(built, 1, RANK))
    assert scrubber.run_pass() == []

    # Through the background scrubber (every run's rank caches under the folder):
    # counted, and recorded for `deltasync status`.
    rebuilt(RankCache(cache_dir, built.run, 0), built, 2)
    rebuilt(cache, built, 2)
    background = CacheScrubber(cache_dir, built.store, FAST, redis_client=client, host="host-a")
    assert background.caches() == [(built.run, 0), (built.run, RANK)]
    name = flip_unchanged_byte(cache, truth(built, 2, RANK), truth(built, 3, RANK))
    background.start()
    try:
        wait_for(lambda: bool(background.found), "the scrub to find the flipped byte", 60)
    finally:
        background.stop()
    assert background.found == [(built.run, 2, name)]
    assert cache.version is None
    assert RankCache(cache_dir, built.run, 0).version == 2, "the other rank is intact"
    damage = list_cache_damage(client, built.run)
    assert [(d.host, d.version, d.tensor, d.count) for d in damage] == [("host-a", 2, name, 1)]
    assert damage[0].note.startswith(f"rank {RANK}: ")
    two = built.manifests[2]
    assert _ready(side, cache, two, keys, rebuild=False) is True
    assert_holds(cache, truth(built, 2, RANK))


def test_a_scrub_racing_with_rank_cache_advances_reports_no_false_mismatch(
    built: PiecedRun, tmp_path: Path
) -> None:
    cache = RankCache(tmp_path / "cache", built.run, RANK)
    rebuilt(cache, built, 1)
    scrub = CacheScrub(cache, built.store)
    names = scrub.scrub_names()
    assert len(names) > 1 and scrub.scrub(names[0])
    rebuilt(cache, built, 2)  # advanced meanwhile
    with pytest.raises(CacheMovedError):
        scrub.scrub(names[1])
    again = scrub.scrub_names()
    assert all(scrub.scrub(n) for n in again)

    # An advance holds the lock: the scrub neither hashes nor judges meanwhile.
    fd = os.open(cache.root / RankCache.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CacheBusyError):
            scrub.scrub(again[0])
    finally:
        os.close(fd)
    assert scrub.scrub(again[0])

    # Advances on another thread, back and forth, while passes run: no finding.
    failed: list[str] = []
    scrubber = Scrubber(scrub, FAST, failed.append)
    stop = threading.Event()
    advances = [0]

    def advance() -> None:
        while not stop.is_set():
            rebuilt(cache, built, 2 + advances[0] % 2)
            advances[0] += 1

    thread = threading.Thread(target=advance)
    thread.start()
    passes = 0
    try:
        while advances[0] < 20 or passes < 20:
            try:
                if scrub.scrub_names():
                    scrubber.run_pass()
                    passes += 1
            except (CacheMovedError, CacheBusyError):
                passes += 1
    finally:
        stop.set()
        thread.join()
    assert failed == [] and scrub.damaged is None
    assert cache.version in (2, 3)


def test_a_rank_cache_rebuild_overtaken_by_a_compaction_starts_again_from_its_anchor(
    tmp_path: Path,
) -> None:
    """A host rebuilds a rank cache from the store while a compaction anchors the head
    and collects the chain it was reading: the rebuild starts over from the new anchor."""
    store = CompactsOnRead(tmp_path / "store", "run-a")
    store.fired = True  # no compaction while the chain is written
    built = build_pieced_run(store, "run-a", deltas=3)
    store.fired = False
    cache = RankCache(tmp_path / "cache", built.run, RANK)
    rebuilt(cache, built, 3)
    assert store.fired
    assert chain.list_versions(store, built.run).anchors == (3,)
    assert cache.version == 3
    assert_holds(cache, truth(built, 3, RANK))
