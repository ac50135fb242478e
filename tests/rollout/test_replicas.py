"""Replica heartbeats, run locks and once-only claims on a real Redis server."""

from __future__ import annotations

import threading

import pytest
import redis

from pipeline.coord.connection import redis_client
from pipeline.coord.replicas import (
    RunLock,
    claim_once,
    forget_replica,
    list_replicas,
    min_live_version,
    replica_key,
    replicas_key,
    report,
    run_lock,
)
from pipeline.errors import ConfigError, LockError

RUN = "run-r"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis_client(redis_url)


def server_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def test_heartbeats_are_listed_and_expire(client: redis.Redis) -> None:
    assert list_replicas(client, RUN) == []
    assert min_live_version(client, RUN) is None
    report(client, RUN, "node-b", 7, "hash-b", ttl_s=600)
    report(client, RUN, "node-a", 5, "hash-a", ttl_s=600)
    report(client, RUN, "node-a", 6, "hash-a2", ttl_s=600)  # a newer report replaces
    report(client, "other-run", "node-c", 1, "hash-c")

    infos = list_replicas(client, RUN)
    assert [(i.node, i.version, i.state_hash) for i in infos] == [
        ("node-a", 6, "hash-a2"),
        ("node-b", 7, "hash-b"),
    ]
    now = server_now(client)
    for info in infos:
        assert 0 <= info.age_s <= 600
        assert abs(info.time.timestamp() - now) <= 600
    assert min_live_version(client, RUN, 600) == 6

    ttl_ms = client.pttl(replica_key(RUN, "node-a"))
    assert 0 < ttl_ms <= 600_000

    client.delete(replica_key(RUN, "node-a"))  # what expiry does
    assert [i.node for i in list_replicas(client, RUN)] == ["node-b"]
    assert client.smembers(replicas_key(RUN)) == {b"node-b"}  # the index was pruned
    assert min_live_version(client, RUN, 600) == 7

    forget_replica(client, RUN, "node-b")
    assert list_replicas(client, RUN) == []
    assert [i.node for i in list_replicas(client, "other-run")] == ["node-c"]


def test_min_live_version_ignores_stale_reports(client: redis.Redis) -> None:
    report(client, RUN, "fresh", 10, "h")
    report(client, RUN, "stale", 3, "h")
    # A replica last heard from an hour ago (by the server's clock).
    client.hset(replica_key(RUN, "stale"), "time", f"{server_now(client) - 3600:.6f}")
    ages = {i.node: i.age_s for i in list_replicas(client, RUN)}
    assert ages["stale"] >= 3600 > ages["fresh"]
    assert min_live_version(client, RUN, 600) == 10
    assert min_live_version(client, RUN, 7200) == 3


def test_report_validates_its_input(client: redis.Redis) -> None:
    with pytest.raises(ConfigError):
        report(client, RUN, "bad node", 1, "h")
    with pytest.raises(ConfigError):
        report(client, "bad/run", "n", 1, "h")
    with pytest.raises(ConfigError):
        report(client, RUN, "n", -1, "h")
    with pytest.raises(ConfigError):
        report(client, RUN, "n", 1, "h", ttl_s=0)
    assert list_replicas(client, RUN) == []


def test_two_holders_exclude_each_other(client: redis.Redis) -> None:
    first = RunLock(client, RUN, "diff", timeout_s=600)
    second = RunLock(client, RUN, "diff", timeout_s=600)
    other_name = RunLock(client, RUN, "compact", timeout_s=600)
    assert first.acquire()
    assert not second.acquire(wait_s=0.1)
    assert other_name.acquire()  # different lock, no conflict
    assert first.owned() and not second.owned()
    with pytest.raises(LockError, match="diff"), run_lock(client, RUN, "diff", 600, wait_s=0):
        pass
    assert first.release()
    assert second.acquire()
    assert second.release()
    assert other_name.release()


def test_run_lock_context_releases_on_exit_and_error(client: redis.Redis) -> None:
    with run_lock(client, RUN, "diff", timeout_s=600) as lock:
        assert lock.owned()
    assert client.exists(lock.key) == 0
    with pytest.raises(RuntimeError), run_lock(client, RUN, "diff", timeout_s=600) as lock:
        raise RuntimeError("job failed")
    assert client.exists(lock.key) == 0


def test_expired_lock_can_be_taken_and_only_its_owner_releases(client: redis.Redis) -> None:
    old = RunLock(client, RUN, "compact", timeout_s=0.001)  # expires at once
    assert old.acquire()
    new = RunLock(client, RUN, "compact", timeout_s=600)
    assert new.acquire(wait_s=30)  # polls until the old lock has expired
    assert not old.owned()
    assert not old.release()  # the expired holder must not release the new one's lock
    assert not old.extend()
    assert new.owned()
    assert new.extend(900)
    assert 600_000 < client.pttl(new.key) <= 900_000
    assert new.release()
    assert not new.owned()


def test_waiting_holder_gets_the_lock_once_released(redis_url: str) -> None:
    client = redis_client(redis_url)
    first = RunLock(client, RUN, "diff", timeout_s=600)
    assert first.acquire()
    acquired = threading.Event()
    owned_inside: list[bool] = []

    def wait_for_lock() -> None:
        with run_lock(redis_client(redis_url), RUN, "diff", timeout_s=600, wait_s=60) as lock:
            acquired.set()
            owned_inside.append(lock.owned())

    thread = threading.Thread(target=wait_for_lock)
    thread.start()
    try:
        assert not acquired.is_set()  # cannot have it while first holds it
        assert first.owned()
        assert first.release()
    finally:
        thread.join()
    assert owned_inside == [True]
    assert not first.owned()


def test_claim_once(client: redis.Redis) -> None:
    key = f"deltasync:run:{RUN}:claim:diff:5"
    assert claim_once(client, key, ttl_s=600)
    assert not claim_once(client, key, ttl_s=600)
    assert not claim_once(client, key, ttl_s=600, value="worker-2")
    assert claim_once(client, key + "x", ttl_s=600)
    assert 0 < client.pttl(key) <= 600_000


def test_lua_is_sent_once_and_reloaded_after_a_flush(client: redis.Redis) -> None:
    client.script_flush()
    report(client, RUN, "node-a", 1, "h1")
    sent_before = _eval_calls(client)
    report(client, RUN, "node-a", 2, "h2")
    lock = RunLock(client, RUN, "diff", timeout_s=5)
    assert lock.acquire() and lock.extend() and lock.release()
    # Later calls go by sha1 only: no EVAL carries the script text again.
    assert _eval_calls(client) == sent_before
    client.script_flush()  # a restarted server has no scripts loaded
    report(client, RUN, "node-a", 3, "h3")
    assert [i.version for i in list_replicas(client, RUN)] == [3]


def _eval_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_eval", {}).get("calls", 0))
