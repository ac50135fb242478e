"""The diff worker's scrub of its state cache: a changed byte on disk is found, the cache
marked damaged and rebuilt by the next step; a scrub racing with advances never reports
a false mismatch; an unproven cache gets its one full proof from a pass."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from pipeline import config
from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.problems import list_cache_damage
from pipeline.errors import LockError
from pipeline.format.hashes.scrub import Scrubber, ScrubPace
from pipeline.format.manifest import Manifest
from pipeline.publish import dead_letters
from pipeline.publish.caches.cache_scrub import CacheMovedError, CacheScrub, CacheScrubber
from pipeline.publish.caches.state_cache import CacheBusyError, StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store import open_store
from pipeline.store.file import FileStore
from pipeline.testing import synthetic
from pipeline.versions import chain
from tests.format.test_checkpoint import same_bits
from tests.pipeline_helpers import assert_same_state, bits, cli, deltasync_env, processes, wait_for
from tests.publish.test_chain import PART_BYTES, SyntheticRun
from tests.workers.test_metrics import _free_port
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

FAST = ScrubPace(period_s=0.0, cpu_fraction=1.0)


@pytest.fixture
def trainer(tmp_path: Path) -> SyntheticRun:
    return SyntheticRun(tmp_path, FileStore(tmp_path / "store"))


def publish(trainer: SyntheticRun, step: int, **kw: object) -> Manifest:
    """Publish the trainer's next checkpoint as ``step`` (its path kept in ``paths``)."""
    path = trainer.paths.get(step) or trainer.checkpoint(step)
    got = publish_step(
        trainer.store,
        trainer.run,
        step,
        path,
        trainer.cache,
        PublishOptions(part_bytes=PART_BYTES),
        **kw,  # type: ignore[arg-type]
    )
    assert got.status == "published" and got.manifest is not None
    return got.manifest


def flip_unchanged_byte(
    cache: StateCache, held: dict[str, torch.Tensor], nxt: dict[str, torch.Tensor]
) -> str:
    """Flip one bit of a cached element that the next step leaves unchanged, in the
    file on disk; the tensor's name."""
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


def cache_at(cache: StateCache, version: int) -> bool:
    return cache.version == version


def assert_cache_holds(cache: StateCache, state: dict[str, torch.Tensor]) -> None:
    with cache.reader() as reader:
        assert set(reader.names()) == set(state)
        for name, tensor in state.items():
            assert same_bits(reader.get(name), tensor), name


def test_a_pass_proves_an_advanced_cache_then_finds_a_flipped_byte_and_the_next_step_rebuilds(
    trainer: SyntheticRun, redis_url: str
) -> None:
    publish(trainer, 0)
    one = publish(trainer, 1)  # advanced in place: not proven
    cache = trainer.cache
    assert cache.is_valid_for(one) and not cache.is_proven_for(one)
    scrub = CacheScrub(cache, trainer.store)
    failed: list[str] = []
    scrubber = Scrubber(scrub, FAST, failed.append)
    assert scrubber.run_pass() == [] and scrub.proofs == 1
    assert cache.is_proven_for(one), "a full pass is the cache's one proof"
    assert scrubber.run_pass() == [] and scrub.proofs == 1  # proven once

    trainer.checkpoint(2)  # the trainer's next state, not published yet
    name = flip_unchanged_byte(cache, trainer.states[1], trainer.states[2])
    assert scrubber.run_pass() == [name] and failed == [name]
    assert scrub.damaged is not None and scrub.damaged[:2] == (1, name)
    assert cache.version is None and not cache.is_valid_for(one), "marked damaged"
    assert scrubber.run_pass() == []  # nothing held to scrub

    two = publish(trainer, 2)  # rebuilds the cache from the store, then advances
    trainer.assert_rebuilds(2)
    trainer.assert_rebuilds(1)
    assert cache.is_valid_for(two)
    assert_cache_holds(cache, trainer.states[2])

    # Through the background scrubber: counted, and recorded for `deltasync status`.
    client = redis_client(redis_url)
    background = CacheScrubber(
        cache.root.parent, trainer.store, FAST, redis_client=client, host="host-a"
    )
    trainer.checkpoint(3)
    name = flip_unchanged_byte(cache, trainer.states[2], trainer.states[3])
    background.start()
    try:
        wait_for(lambda: bool(background.found), "the scrub to find the flipped byte", 60)
    finally:
        background.stop()
    assert background.found == [(trainer.run, 2, name)]
    assert cache.version is None
    damage = list_cache_damage(client, trainer.run)
    assert [(d.host, d.version, d.tensor, d.count) for d in damage] == [("host-a", 2, name, 1)]
    publish(trainer, 3)
    trainer.assert_rebuilds(3)
    assert_cache_holds(cache, trainer.states[3])


def test_a_pass_interrupted_by_an_advance_starts_over_and_a_busy_cache_is_not_hashed(
    trainer: SyntheticRun,
) -> None:
    publish(trainer, 0)
    publish(trainer, 1)
    scrub = CacheScrub(trainer.cache, trainer.store)
    names = scrub.scrub_names()
    assert len(names) > 2 and scrub.scrub(names[0])
    two = publish(trainer, 2)  # advanced in place meanwhile
    with pytest.raises(CacheMovedError):
        scrub.scrub(names[1])
    again = scrub.scrub_names()
    assert again[0] == names[1], "coverage goes on where it left off"
    assert sorted(again) == sorted(names)
    assert all(scrub.scrub(n) for n in again)
    assert trainer.cache.is_proven_for(two)

    # A write holds the lock: the scrub does not hash (nor judge) meanwhile.
    fd = os.open(trainer.cache.root / StateCache.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CacheBusyError):
            scrub.scrub(names[0])
    finally:
        os.close(fd)
    assert scrub.scrub(names[0])


def test_a_writer_waits_a_bounded_time_for_a_lock_nobody_lets_go(
    trainer: SyntheticRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that never lets go (a forked child once kept a scrub's shared lock for
    good) costs a writer a logged wait, then a LockError its job is retried on, not a
    job stuck for ever under its run's diff lease; a holder that lets go in time does not."""
    publish(trainer, 0)
    monkeypatch.setattr(config, "CACHE_LOCK_WAIT_S", 1.0)
    monkeypatch.setattr(config, "CACHE_LOCK_LOG_S", 0.2)
    fd = os.open(trainer.cache.root / StateCache.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as a scrub hashing a tensor
        with capture_logs() as logs, pytest.raises(LockError, match="still held") as refused:
            trainer.cache.rebuild(trainer.store, trainer.run, 0)
        assert str(trainer.cache.root / StateCache.LOCK) in str(refused.value)
        assert dead_letters.is_transient(refused.value)
        waits = [e for e in logs if e["event"] == "waiting for the state cache lock"]
        assert waits and waits[0]["log_level"] == "warning", logs
        monkeypatch.setattr(config, "CACHE_LOCK_WAIT_S", 120.0)
        threading.Timer(0.3, os.close, (fd,)).start()  # released in time: written
        fd = -1
        assert trainer.cache.rebuild(trainer.store, trainer.run, 0).version == 0
    finally:
        if fd >= 0:
            os.close(fd)
    assert trainer.cache.version == 0


def test_damage_found_while_a_diff_encodes_from_it_publishes_nothing_wrong(
    trainer: SyntheticRun,
) -> None:
    """The diff trusts a proven base without hashing it; a scrub that finds the base
    damaged before the manifest makes that diff start over from a rebuilt cache."""
    publish(trainer, 0)
    publish(trainer, 1)
    scrub = CacheScrub(trainer.cache, trainer.store)
    scrubber = Scrubber(scrub, FAST, lambda n: None)
    assert scrubber.run_pass() == [] and scrub.proven  # the next diff skips base hashes
    trainer.checkpoint(2)
    name = flip_unchanged_byte(trainer.cache, trainer.states[1], trainer.states[2])
    found: list[list[str]] = []

    def on_part(_hint: object) -> None:
        if not found:  # the scrub reaches the damage while the diff is under way
            found.append(scrubber.run_pass())

    two = publish(trainer, 2, on_part=on_part)
    assert found == [[name]]
    trainer.assert_rebuilds(2)  # encoded again from the rebuilt cache
    assert trainer.cache.is_valid_for(two)
    assert_cache_holds(trainer.cache, trainer.states[2])


def test_a_linked_cache_gets_its_one_full_proof_from_the_scrub(trainer: SyntheticRun) -> None:
    publish(trainer, 0)
    one = publish(trainer, 1, link=True)
    state = json.loads((trainer.cache.root / StateCache.STATE).read_text())
    assert state["linked"] and not trainer.cache.is_proven_for(one)
    scrub = CacheScrub(trainer.cache, trainer.store)
    assert Scrubber(scrub, FAST, lambda n: None).run_pass() == []
    assert trainer.cache.is_proven_for(one)
    two = publish(trainer, 2, link=True)  # the proven base is not hashed again
    assert not trainer.cache.is_proven_for(two)
    trainer.assert_rebuilds(2)


def test_a_scrub_racing_with_many_advances_reports_no_false_mismatch(
    trainer: SyntheticRun,
) -> None:
    publish(trainer, 0)
    scrubber = CacheScrubber(trainer.cache.root.parent, trainer.store, FAST).start()
    try:
        for step in range(1, 16):
            way = step % 3
            if way == 1:  # deltasync's own copy, moved in
                manifest = publish(trainer, step, adopt=True)
            elif way == 2:  # the trainer's files, linked
                manifest = publish(trainer, step, link=True)
            else:  # copied in place (or rewritten)
                manifest = publish(trainer, step)
            assert trainer.cache.is_valid_for(manifest)
    finally:
        scrubber.stop()
    assert scrubber.found == [], "no false mismatch"
    assert scrubber.hashed > 0
    assert trainer.cache.version == 15
    assert_cache_holds(trainer.cache, trainer.states[15])
    trainer.assert_rebuilds(15)


def test_the_scrub_yields_to_a_running_job(trainer: SyntheticRun) -> None:
    publish(trainer, 0)
    job = threading.Event()
    job.set()
    scrubber = CacheScrubber(
        trainer.cache.root.parent, trainer.store, FAST, busy=job.is_set, max_yield_s=0.5
    ).start()
    try:
        time.sleep(1.2)
        during = scrubber.hashed
        # The first tensor, then at most one per wait: no full-speed pass under a job.
        assert during <= 1 + 1.2 / 0.5 + 1
        job.clear()
        wait_for(lambda: scrubber.hashed > during + 40, "the scrub at full speed", 60)
    finally:
        scrubber.stop()
    assert scrubber.found == []


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
def test_a_real_diff_worker_scrubs_its_cache_and_the_next_step_rebuilds_it(
    redis_url: str, tmp_path: Path
) -> None:
    run = "scrubbed"
    port = _free_port()
    env = deltasync_env(
        redis_url,
        tmp_path,
        DELTASYNC_SCRUB_MINUTES="0.005",  # a pass every 0.3 s
        DELTASYNC_SCRUB_CPU="1",
        DELTASYNC_METRICS_PORT=str(port),
    )
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=7)
    store = open_store(settings.store_url)
    cache = StateCache(settings.cache_dir, run)
    mismatches = ("deltasync_scrub_mismatches_total", (("role", "diff"), ("run", run)))
    states: dict[int, dict[str, torch.Tensor]] = {}

    with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
        state = generator.state()
        for step in range(6):  # scrubbed all along, advancing: no false mismatch
            if step:
                state = generator.step()
            states[step] = {n: t.clone() for n, t in state.items()}
            emitter.emit_state(step, state)
            wait_for(functools.partial(cache_at, cache, step), f"the cache at v{step}")
        assert _scrape(port).get(mismatches) is None

        states[6] = {n: t.clone() for n, t in generator.step().items()}
        name = flip_unchanged_byte(cache, states[5], states[6])
        wait_for(lambda: cache.version is None, "the scrub to mark the cache damaged", 60)
        assert _scrape(port).get(mismatches) == 1.0
        status = cli(env, "status", "--run", run, "--json")
        assert status.returncode == 0, status.stderr
        damage = json.loads(status.stdout)["cache_damage"]
        assert [(d["version"], d["tensor"], d["count"]) for d in damage] == [(5, name, 1)]
        text = cli(env, "status", "--run", run)
        assert "failed its scrub" in text.stdout and name in text.stdout

        emitter.emit_state(6, states[6])
        wait_for(lambda: cache.version == 6, "the next step's cache")
        assert chain.list_versions(store, run).head == 6

    log = (tmp_path / "logs" / "diff.log").read_text()
    assert "state cache damaged" in log and "state cache rebuilt" in log
    for version in (5, 6):
        assert_same_state(
            dict(chain.reconstruct_tensors(store, run, version)), states[version], f"v{version}"
        )
