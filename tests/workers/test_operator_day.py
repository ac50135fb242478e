"""An operator's day with real processes: the embedded Redis restarted under running
workers, a damaged delta repaired, a killed worker shown dead, typos that fail at once,
a set-aside step retried, a trainer whose Redis is down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import StepCompleted
from pipeline.coord.replicas import list_replicas, report
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, StepNotSentError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.manifest import object_key
from pipeline.format.signing import generate_keypair
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.repair import repair
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store import open_store
from pipeline.store.file import FileStore
from pipeline.store.trust import trusted
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, cli, deltasync_env, wait_for
from tests.servers import RedisServer
from tests.workers.test_faults_workers import Cluster, Procs, assert_rebuilds, cluster
from workers import queues
from workers.redis_launcher import ensure_redis, stop_redis
from workers.trainers.trainer import Emitter


def _status(env: dict[str, str], run: str) -> dict[str, Any]:
    done = cli(env, "status", "--run", run, "--json", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report_: dict[str, Any] = json.loads(done.stdout)
    return report_


def _dump_is(dump: Path, state: dict[str, torch.Tensor]) -> None:
    with CheckpointReader(dump) as reader:
        got = {n: content_hash(reader.get(n)) for n in reader.names()}
    assert got == {n: content_hash(t) for n, t in state.items()}


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text[-2000:]
    return lines[0]


# --------------------------------------------------------------------------- embedded Redis


@pytest.mark.slow
def test_workers_follow_the_embedded_redis_across_a_restart(tmp_path: Path) -> None:
    """`redis stop` under a running diff worker, then any command starts it again at the
    same URL: the worker reconnects by itself and the next step publishes."""
    env = deltasync_env("unused", tmp_path)
    del env["DELTASYNC_REDIS_URL"]  # the embedded server of DELTASYNC_HOME
    settings = Settings.from_env(env)
    store = open_store(settings.store_url)
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=3)
    procs = Procs(env, tmp_path / "logs")
    try:
        worker = procs.start("diff", "worker", "diff")
        first = generator.state()
        Emitter("follow", settings=settings).emit_state(0, first)
        wait_for(lambda: chain.list_versions(store, "follow").head == 0, "v0")
        url = cli(env, "redis", "url").stdout.strip()
        assert url.startswith("redis://:") and "***" not in url

        stopped = cli(env, "redis", "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert "client(s) still connected" in stopped.stdout, stopped.stdout
        assert cli(env, "redis", "url").stdout.strip() == url  # started again, same address

        second = generator.step()
        Emitter("follow", settings=settings).emit_state(1, second)
        wait_for(lambda: chain.list_versions(store, "follow").head == 1, "v1 after the restart")
        assert worker.poll() is None, "the worker was not restarted"
        assert_rebuilds(store, "follow", 1, second)
    finally:
        procs.close()
        stop_redis(settings.data_dir)


def test_a_wrong_redis_password_is_one_line_in_the_api_and_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    url = ensure_redis(home)
    try:
        wrong = url.replace(url.split("@")[0], "redis://:not-the-password")
        settings = Settings.from_env(
            {}, data_dir=home, redis_url=wrong, store_url=(tmp_path / "store").as_uri()
        )
        with pytest.raises(StepNotSentError, match="refused the password") as caught:
            Emitter("auth", settings=settings).emit_state(0, {"w": torch.zeros(4)})
        assert "\n" not in str(caught.value) and "not-the-password" not in str(caught.value)
        assert not (settings.staging_dir / "auth").exists() or not any(
            (settings.staging_dir / "auth").iterdir()
        )
        env = deltasync_env(wrong, tmp_path, DELTASYNC_HOME=str(home))
        done = cli(env, "status", "--run", "auth", timeout=60)
        assert done.returncode == 1
        assert "refused the password" in _one_line(done.stderr)
    finally:
        stop_redis(home)


# --------------------------------------------------------------------------- repair


def _published(c: Cluster, steps: int) -> None:
    c.procs.start("diff", "worker", "diff")
    for _ in range(steps):
        c.emit()
    wait_for(lambda: c.head() == steps - 1, f"v{steps - 1}")
    cache = StateCache(c.settings.cache_dir, c.run)
    wait_for(lambda: cache.version == steps - 1, "the diff worker's cache at the head")


def _flip_a_byte(c: Cluster, version: int) -> str:
    manifest = chain.load_manifest(c.store, c.run, "delta", version)
    entry = manifest.objects[0]
    key = object_key(c.run, "delta", version, entry.key)
    path = Path(c.settings.store_url.removeprefix("file://")) / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return key


@pytest.mark.slow
def test_a_flipped_byte_in_a_delta_is_repaired_and_a_new_node_reaches_the_head(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path) as c:
        _published(c, 4)  # anchor 0, deltas 1-3
        damaged = _flip_a_byte(c, 2)

        checked = cli(c.env, "repair", "--run", c.run, "--check")
        assert checked.returncode == 1, checked.stderr
        assert f"delta 2: object {damaged} does not match its sha256" in checked.stdout

        done = cli(c.env, "repair", "--run", c.run)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "published anchor 3 from the diff worker's state cache" in done.stdout
        assert "removed the damaged delta 2" in done.stdout
        index = chain.list_versions(c.store, c.run)
        assert 2 not in index.deltas and 3 in index.anchors  # never served again

        dump = tmp_path / "fresh.safetensors"
        node = cli(c.env, "rollout", "--run", c.run, "--node-id", "fresh", "--until", "3",
                   "--poll", "0.3", "--dump", str(dump))  # fmt: skip
        assert node.returncode == 0, node.stderr[-3000:]
        _dump_is(dump, c.states[3])

        status = _status(c.env, c.run)
        assert status["chain"] == {**status["chain"], "anchor": 3, "length": 0}
        assert "error" not in status["chain"]
        assert cli(c.env, "repair", "--run", c.run, "--check").returncode == 0

        c.emit()  # the run goes on from the repaired head
        wait_for(lambda: c.head() == 4, "v4 after the repair")
        assert_rebuilds(c.store, c.run, 4, c.states[4])


@pytest.mark.slow
def test_compaction_skips_past_a_damaged_delta_to_the_proven_cache(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        _published(c, 4)
        _flip_a_byte(c, 2)
        c.procs.start("compact", "worker", "compact")
        wait_for(
            lambda: any(w["state"] == "idle" for w in _status(c.env, c.run)["queues"][
                queues.COMPACT_QUEUE]["workers"]),
            "a compaction worker",
        )  # fmt: skip
        done = cli(c.env, "compact", "--run", c.run, "--version", "2", "--wait")
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout[done.stdout.index("{") :])["anchor"] == 3
        dump = tmp_path / "fresh.safetensors"
        node = cli(c.env, "rollout", "--run", c.run, "--node-id", "fresh", "--until", "3",
                   "--poll", "0.3", "--dump", str(dump))  # fmt: skip
        assert node.returncode == 0, node.stderr[-3000:]
        _dump_is(dump, c.states[3])


def test_a_signed_run_is_repaired_only_with_its_signing_key(tmp_path: Path) -> None:
    """In the library: the new anchor is signed, or nothing changes."""
    private, public = generate_keypair(tmp_path / "keys")
    key = private.read_bytes()
    store = FileStore(tmp_path / "store")
    cache = StateCache(tmp_path / "cache", "signed")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=4)
    states = [generator.state()] + [generator.step() for _ in range(2)]
    for version, state in enumerate(states):
        save_state(state, tmp_path / f"{version}.safetensors")
        publish_step(
            store,
            "signed",
            version,
            tmp_path / f"{version}.safetensors",
            cache,
            PublishOptions(signing_key=key),
        )
    entry = chain.load_manifest(store, "signed", "delta", 1).objects[0]
    path = tmp_path / "store" / object_key("signed", "delta", 1, entry.key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))

    with pytest.raises(ConfigError, match="is signed: repair needs its signing key"):
        repair(store, "signed", cache=cache)
    assert 1 in chain.list_versions(store, "signed").deltas  # nothing changed

    result = repair(store, "signed", cache=cache, options=PublishOptions(signing_key=key))
    assert result.anchor is not None and result.anchor.version == 2
    assert result.removed == ("delta 1",)
    verified = trusted(store, public.read_bytes())
    rebuilt = dict(chain.reconstruct_tensors(verified, "signed", 2))  # signatures checked
    assert {n: content_hash(t) for n, t in rebuilt.items()} == {
        n: content_hash(t) for n, t in states[2].items()
    }


# --------------------------------------------------------------------------- liveness


@pytest.mark.slow
def test_a_sigkilled_worker_shows_dead_then_leaves(tmp_path: Path) -> None:
    with cluster(tmp_path, DELTASYNC_WORKER_LEASE="3") as c:
        c.publish_here()  # a run to show

        def workers() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = _status(c.env, c.run)["queues"][queues.DIFF_QUEUE][
                "workers"
            ]
            return found

        worker = c.procs.start("diff", "worker", "diff")
        wait_for(lambda: [w["state"] for w in workers()] == ["idle"], "an idle worker")
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_for(lambda: [w["state"] for w in workers()] == ["dead"], "the worker dead")
        dead = workers()[0]
        assert dead["lease_s"] == 3 and dead["last_heartbeat"] and dead["job"] is None
        shown = cli(c.env, "status", "--run", c.run)
        assert "dead" in shown.stdout and "no heartbeat since" in shown.stdout
        wait_for(lambda: workers() == [], "the dead worker forgotten", timeout_s=300)


def test_a_silent_replica_is_dead_until_its_record_expires(redis_url: str) -> None:
    client = redis_client(redis_url)
    report(client, "quiet", "n1", 3, "ab" * 16, ttl_s=600, lease_s=0.3)
    assert not list_replicas(client, "quiet")[0].dead
    wait_for(lambda: list_replicas(client, "quiet")[0].dead, "the replica dead")
    assert list_replicas(client, "quiet")[0].version == 3  # still listed


# --------------------------------------------------------------------------- typos


def test_typos_fail_at_once_naming_what_exists(redis_url: str, tmp_path: Path) -> None:
    env = deltasync_env(redis_url, tmp_path)
    store = open_store(env["DELTASYNC_STORE"])
    state = UpdateGenerator(ModelConfig.preset("tiny"), seed=1).state()
    save_state(state, tmp_path / "0.safetensors")
    cache = StateCache(tmp_path / "cache", "grpo-7")
    publish_step(store, "grpo-7", 0, tmp_path / "0.safetensors", cache)
    EventStream(redis_client(redis_url), "other-run").publish(
        StepCompleted.now(run="other-run", version=0, checkpoint="/c/0", owned=False)
    )
    for args in (
        ("rollout", "--run", "grpo-8"),
        ("serve", "--run", "grpo-8", "--model", str(tmp_path)),
        ("status", "--run", "grpo-8"),
        ("tail", "--run", "grpo-8"),
        ("compact", "--run", "grpo-8"),
        ("repair", "--run", "grpo-8"),
    ):
        # The bound is the subprocess timeout: before, rollout and serve waited for ever.
        done = cli(env, *args, timeout=10)
        assert done.returncode == 1, (args, done.stdout, done.stderr[-2000:])
        line = _one_line(done.stderr)
        assert "'grpo-8' is unknown" in line and "grpo-7" in line and "other-run" in line

    done = cli(env, "tail", "--run", "grpo-7", "--type", "step-complete", timeout=30)
    assert done.returncode == 2 and "step-completed" in done.stderr
    assert "delta-available" in cli(env, "tail", "--help").stdout

    done = cli(env, "--store", "file//x", "status", "--run", "grpo-7", timeout=30)
    assert done.returncode == 1 and "ambiguous" in _one_line(done.stderr)

    done = cli(env, "compact", "--run", "grpo-7", "--wait", timeout=30)
    assert done.returncode == 1
    assert "no compaction worker listens" in _one_line(done.stderr)
    assert queues.queue(redis_client(redis_url), queues.COMPACT_QUEUE).count == 0


def test_a_mistyped_store_url_is_refused() -> None:
    for text in ("file//x", "file:/x", "s3:/bucket/p", "hf:buckets/a/b"):
        with pytest.raises(ConfigError, match="ambiguous"):
            Settings.from_env({}, store_url=text)
        with pytest.raises(ConfigError, match="ambiguous"):
            open_store(text)
    assert Settings.from_env({}, store_url="data//x").store_url.endswith("/data/x")


# --------------------------------------------------------------------------- set-aside steps


def _failed_for_good(c: Cluster, step: int) -> bool:
    """rq's own retries of the step's job are over (it is failed, not scheduled)."""
    job = Job.fetch(queues.diff_job_id(c.run, step), connection=c.redis, serializer=JSONSerializer)
    return job.get_status(refresh=True) == JobStatus.FAILED


def _set_aside(c: Cluster) -> list[int]:
    return [d["step"] for d in _status(c.env, c.run)["dead_steps"]]


@pytest.mark.slow
def test_retry_and_emitting_again_publish_set_aside_steps(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.procs.start("diff", "worker", "diff")
        c.emit()
        wait_for(lambda: c.head() == 0, "v0")
        step, state = c.next_state()
        one_short = dict(list(state.items())[1:])  # a tensor missing: the diff refuses it
        path = tmp_path / "ckpt-1.safetensors"
        save_state(one_short, path)
        c.emitter.emit_checkpoint(step, path)
        wait_for(lambda: _set_aside(c) == [step], "step 1 set aside")
        wait_for(lambda: _failed_for_good(c, step), "rq's retries of step 1 over")

        save_state(state, path)  # the cause fixed
        done = cli(c.env, "retry", "--run", c.run, "--step", str(step))
        assert done.returncode == 0, done.stderr[-2000:]
        wait_for(lambda: c.head() == step, "step 1 after retry")
        assert_rebuilds(c.store, c.run, step, state)
        assert _set_aside(c) == []
        assert cli(c.env, "retry", "--run", c.run, "--step", "1").returncode == 1  # not aside

        step, state = c.next_state()
        bad = tmp_path / "bad-2.safetensors"
        save_state(dict(list(state.items())[1:]), bad)
        c.emitter.emit_checkpoint(step, bad)
        wait_for(lambda: _set_aside(c) == [step], "step 2 set aside")
        good = tmp_path / "good-2.safetensors"
        save_state(state, good)
        done = cli(c.env, "emit", "--run", c.run, "--step", str(step), "--checkpoint", str(good))
        assert done.returncode == 0 and "emitted step 2" in done.stdout, done.stdout
        wait_for(lambda: c.head() == step, "step 2 emitted again")
        assert_rebuilds(c.store, c.run, step, state)


# --------------------------------------------------------------------------- Redis down


EMIT_WITH_REDIS_DOWN = """
import sys
import torch
from pipeline.config import Settings
from pipeline.errors import DeltasyncError
from workers.trainers.trainer import Emitter

emitter = Emitter("down", settings=Settings.from_env())
state = {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
print("ready", flush=True)
try:
    emitter.emit_state(0, state)
except DeltasyncError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
"""


def test_emit_state_with_redis_down_fails_in_one_line_and_stages_nothing(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    server.stop()  # its port, and nothing listening there
    env = deltasync_env(server.url, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", EMIT_WITH_REDIS_DOWN],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    # The bound is the subprocess timeout: before, it took about 26 s and raised redis's own.
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 3, err[-2000:]
    line = _one_line(out)
    assert line.startswith("StepNotSentError: redis at") and "emit it again" in line
    settings = Settings.from_env(env)
    staged = settings.staging_dir / "down"
    assert not staged.exists() or not any(staged.iterdir())

    server.start()  # same port: the step is emitted again
    try:
        emitted = Emitter("down", settings=settings).emit_state(
            0, {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
        )
        assert emitted.event_id is not None
    finally:
        server.stop()
