"""The event pipeline end to end: real redis-server, real rq workers in their own
processes, real safetensors checkpoints, realistic updates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord import replicas
from pipeline.coord.connection import redis_client
from pipeline.coord.events import StepCompleted
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError
from pipeline.publish.caches.state_cache import StateCache
from pipeline.store import open_store
from pipeline.testing import synthetic
from pipeline.versions import chain
from tests.pipeline_helpers import (
    assert_same_state,
    cli,
    deltasync_env,
    processes,
    wait_for,
)
from workers.jobs import diff
from workers.queues import diff_job_id
from workers.runtime import Runtime, set_current
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.slow

STEPS = 11


def _events(redis_url: str, run: str) -> list[tuple[str, object]]:
    stream = EventStream(redis_client(redis_url), run)
    out: list[tuple[str, object]] = []
    last = "0-0"
    while batch := stream.read(after_id=last, count=500):
        out.extend(batch)
        last = batch[-1][0]
    return out


def test_emit_diff_compact_tail_status(redis_url: str, tmp_path: Path) -> None:
    run = "e2e"
    env = deltasync_env(
        redis_url, tmp_path, DELTASYNC_COMPACT_MAX_CHAIN="4", DELTASYNC_KEEP_ANCHORS="100"
    )
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=3)
    trainer: dict[int, dict[str, torch.Tensor]] = {}
    store = open_store(settings.store_url)
    r = redis_client(redis_url)
    # A replica still at version 0: garbage collection must keep all it needs.
    replicas.report(r, run, "slow-node", 0, "-", ttl_s=3600)

    with processes(
        env,
        tmp_path / "logs",
        diff=["worker", "diff"],
        compact=["worker", "compact"],
    ):
        state = generator.state()
        for step in range(STEPS):
            if step:
                state = generator.step()
            trainer[step] = {n: t.clone() for n, t in state.items()}
            emitted = emitter.emit_state(step, state)
            assert emitted.event_id is not None
        wait_for(lambda: chain.list_versions(store, run).head == STEPS - 1, "the head")
        # By policy: a chain of 4 deltas becomes an anchor.
        wait_for(lambda: len(chain.list_versions(store, run).anchors) >= 2, "a policy anchor")

        # A step that is not newer than the head is refused with a clear error.
        with pytest.raises(ChainError, match="not newer than head"):
            emitter.emit_state(STEPS - 1, state)

        # The same job run again publishes nothing new.
        again = diff.diff_job(run, 3, str(tmp_path / "gone"), owned=False)
        assert again["status"] == "skipped"

        # By hand, through the real CLI, waiting for the worker.
        done = cli(env, "compact", "--run", run, "--version", "7", "--wait", "--timeout", "200")
        assert done.returncode == 0, done.stderr
        assert 7 in chain.list_versions(store, run).anchors
        assert json.loads(done.stdout[done.stdout.index("{") :])["anchor"] == 7

    index = chain.list_versions(store, run)
    assert index.versions == tuple(range(STEPS))
    for version, expected in trainer.items():
        rebuilt = dict(chain.reconstruct_tensors(store, run, version))
        assert_same_state(rebuilt, expected, f"version {version}")

    # Once the slow replica is gone, compaction collects what nobody needs.
    replicas.forget_replica(r, run, "slow-node")
    env["DELTASYNC_KEEP_ANCHORS"] = "1"
    with processes(env, tmp_path / "logs2", compact=["worker", "compact"]):
        done = cli(env, "compact", "--run", run, "--wait", "--timeout", "200")
        assert done.returncode == 0, done.stderr
    after = chain.list_versions(store, run)
    assert after.head == STEPS - 1 and STEPS - 1 in after.anchors
    assert 1 not in after.deltas and 0 not in after.anchors
    assert_same_state(
        dict(chain.reconstruct_tensors(store, run, STEPS - 1)), trainer[STEPS - 1], "head"
    )

    # Staging copies deltasync wrote are gone once published; nothing else is touched.
    assert not any((settings.staging_dir / run).glob("step-*"))

    events = _events(redis_url, run)
    assert all(event is not None for _, event in events)
    kinds = [(e.type, e.version) for _, e in events]  # type: ignore[attr-defined]
    steps = [v for t, v in kinds if t == "step-completed"]
    assert steps == list(range(STEPS))
    available = [v for t, v in kinds if t == "delta-available"]
    assert sorted(available) == list(range(STEPS)), "each version announced exactly once"
    assert ("anchor-available", 7) in kinds
    # The policy asks once per compaction it needs, not again for every step while one runs.
    policy_asked = sorted(
        e.version
        for _, e in events
        if e.type == "compaction-requested" and e.requested_by == "policy"  # type: ignore[attr-defined]
    )
    policy_made = sorted(
        e.version
        for _, e in events
        if e.type == "anchor-available" and e.reason != "manual"  # type: ignore[attr-defined]
    )
    assert policy_asked and policy_asked == policy_made
    ids = [event_id for event_id, _ in events]
    assert ids == sorted(ids, key=lambda i: tuple(int(x) for x in i.split("-")))

    # tail shows every event, in order, as JSON lines and as text.
    tailed = cli(env, "tail", "--run", run, "--json")
    assert tailed.returncode == 0, tailed.stderr
    lines = [json.loads(line) for line in tailed.stdout.splitlines()]
    assert [line["id"] for line in lines] == ids
    # The only run with events is the default.
    only = cli(env, "tail", "--type", "delta-available")
    assert len(only.stdout.splitlines()) == STEPS
    assert all("delta-available" in line for line in only.stdout.splitlines())

    status = cli(env, "status", "--run", run, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["head"] == STEPS - 1
    assert report["anchors"] == [STEPS - 1]
    assert report["queues"]["deltasync:diff"]["failed"] == 0
    assert report["chain"]["anchor"] in report["anchors"]
    text = cli(env, "status")
    assert text.returncode == 0 and f"head {STEPS - 1}" in text.stdout


def test_tail_and_status_without_a_run_name_the_runs_to_choose_from(
    redis_url: str, tmp_path: Path
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    for command in ("tail", "status"):
        none = cli(env, command)
        assert none.returncode != 0
        assert (
            none.stderr.strip()
            .splitlines()[-1]
            .endswith(f"--run is needed: no run has events in redis at {redis_url}")
        ), none.stderr
    r = redis_client(redis_url)
    for run in ("zeta", "alpha"):
        EventStream(r, run).publish(
            StepCompleted.now(run=run, version=1, checkpoint="/x", owned=False)
        )
    for command in ("tail", "status"):
        two = cli(env, command)
        assert two.returncode != 0
        last = two.stderr.strip().splitlines()[-1]
        assert last.endswith("--run is needed: runs with events in redis: alpha, zeta"), last
    named = cli(env, "tail", "--run", "zeta", "--json")
    assert named.returncode == 0 and json.loads(named.stdout)["run"] == "zeta"


def test_status_shows_the_job_each_worker_runs_and_the_steps_waiting(
    redis_url: str, tmp_path: Path
) -> None:
    """A diff job held up (here by the run's diff lock, taken by the test) is visible: its
    worker busy with it, the job running, its step waiting. Released, it publishes."""
    run = "held"
    env = deltasync_env(redis_url, tmp_path)
    settings = Settings.from_env(env)
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), seed=4)
    store = open_store(settings.store_url)
    r = redis_client(redis_url)
    lock = replicas.RunLock(r, run, "diff", 600)
    assert lock.acquire()

    def status() -> dict[str, Any]:
        done = cli(env, "status", "--run", run, "--json")
        assert done.returncode == 0, done.stderr
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    with processes(env, tmp_path / "logs", diff=["worker", "diff"]):
        emitter.emit_state(0, generator.state())
        job = diff_job_id(run, 0)
        seen: dict[str, Any] = {}

        def busy() -> bool:
            seen.update(status())
            workers = seen["queues"]["deltasync:diff"]["workers"]
            return [(w["state"], w["job"]) for w in workers] == [("busy", job)]

        wait_for(busy, "the worker busy with the held job")
        queue = seen["queues"]["deltasync:diff"]
        assert queue["running"] == [job] and queue["queued"] == 0, queue
        assert seen["pending_steps"] == [0] and seen["head"] is None, seen
        assert queue["workers"][0]["heartbeat_s_ago"] >= 0
        shown = cli(env, "status", "--run", run)
        assert f": busy {job}, heartbeat" in shown.stdout, shown.stdout
        assert "steps waiting to publish [0]" in shown.stdout, shown.stdout

        assert lock.release()
        wait_for(lambda: chain.list_versions(store, run).head == 0, "v0 once the lock is free")
        wait_for(lambda: status()["queues"]["deltasync:diff"]["running"] == [], "the job to finish")
    after = status()
    assert after["pending_steps"] == [] and after["head"] == 0, after


@pytest.mark.parametrize("link", ["0", "1"])
def test_user_checkpoint_is_never_removed(redis_url: str, tmp_path: Path, link: str) -> None:
    """Nor modified: copied into the diff worker's cache, or hard-linked with
    DELTASYNC_CACHE_LINK=1."""
    run = "byhand"
    env = deltasync_env(redis_url, tmp_path, DELTASYNC_CACHE_LINK=link)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), seed=1)
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    paths = []
    state = generator.state()
    for step in (10, 20):
        if step == 20:
            state = generator.step()
        path = tmp_path / "ckpt" / f"model-{step}.safetensors"
        path.parent.mkdir(exist_ok=True)
        write_checkpoint(path, state.items())
        paths.append(path)
        out = cli(env, "emit", "--run", run, "--step", str(step), "--checkpoint", str(path))
        assert out.returncode == 0, out.stderr
    before = [p.read_bytes() for p in paths]
    worked = cli(env, "worker", "diff", "--burst")
    assert worked.returncode == 0, worked.stderr
    assert [p.read_bytes() for p in paths] == before
    cache = StateCache(Settings.from_env(env).cache_dir, run)
    assert cache.version == 20 and cache.folder is not None
    cached = {f.stat().st_ino for f in cache.folder.iterdir()}
    assert (paths[1].stat().st_ino in cached) is (link == "1")
    store = open_store(Settings.from_env(env).store_url)
    assert chain.list_versions(store, run).versions == (10, 20)
    rebuilt = dict(chain.reconstruct_tensors(store, run, 20))
    assert_same_state(rebuilt, state, "version 20")


def test_cli_errors_are_one_line(redis_url: str, tmp_path: Path) -> None:
    env = deltasync_env(redis_url, tmp_path)
    missing = cli(env, "emit", "--run", "r", "--step", "1", "--checkpoint", str(tmp_path))
    assert missing.returncode != 0
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    bad_run = tmp_path / "x.safetensors"
    bad_run.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    out = cli(env, "emit", "--run", "../evil", "--step", "1", "--checkpoint", str(bad_run))
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    unreachable = deltasync_env("redis://127.0.0.1:1/0", tmp_path)
    for extra in ([], ["--hints"]):
        out = cli(unreachable, "tail", "--run", "r", *extra)
        assert out.returncode != 0
        assert "127.0.0.1:1" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_later_job_publishes_earlier_pending_steps_first(redis_url: str, tmp_path: Path) -> None:
    """With several diff workers the job of step 2 may run before step 1's: both are
    published, in order, and step 1's own job then finds it done."""
    run = "ordered"
    settings = Settings.from_env(deltasync_env(redis_url, tmp_path))
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    states = {0: generator.state()}
    emitted = {0: emitter.emit_state(0, states[0])}
    diff.diff_job(run, 0, emitted[0].checkpoint, owned=True)
    for step in (1, 2):
        states[step] = {n: t.clone() for n, t in generator.step().items()}
        emitted[step] = emitter.emit_state(step, states[step])

    later = diff.diff_job(run, 2, emitted[2].checkpoint, owned=True)
    assert later["status"] == "published"
    first = diff.diff_job(run, 1, emitted[1].checkpoint, owned=True)
    assert first["status"] == "skipped"

    store = open_store(settings.store_url)
    index = chain.list_versions(store, run)
    assert index.versions == (0, 1, 2)
    assert chain.load_manifest(store, run, "delta", 2).parent == 1
    for step in (1, 2):
        assert_same_state(
            dict(chain.reconstruct_tensors(store, run, step)), states[step], f"v{step}"
        )
    announced = [
        e.version
        for _, e in _events(redis_url, run)
        if e.type == "delta-available"  # type: ignore[attr-defined]
    ]
    assert announced == [0, 1, 2]


def test_workers_announcing_one_version_at_once_append_one_event(
    redis_url: str, tmp_path: Path
) -> None:
    """``publish_once`` from many threads at the same moment (as a job, its rq retry and
    the next step's job announcing one version may): the marker is WATCHed, so one
    event per version."""
    import threading

    from pipeline.coord.events import DeltaAvailable

    settings = Settings.from_env(deltasync_env(redis_url, tmp_path))
    run = "race"
    rounds, racers = 20, 6
    for version in range(rounds):
        barrier = threading.Barrier(racers)
        event = DeltaAvailable.now(
            run=run, version=version, kind="delta", parent=max(version - 1, 0), anchor=0,
            bytes=1, changed=1, total=2, manifest=f"{run}/deltas/{version}/manifest.json",
        )  # fmt: skip

        def announce(event: DeltaAvailable = event, barrier: threading.Barrier = barrier) -> None:
            runtime = Runtime(settings)  # a connection of its own, as a worker has
            barrier.wait()
            diff.publish_once(runtime, f"deltasync:run:{run}:announced:{event.version}", event)

        threads = [threading.Thread(target=announce) for _ in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    versions = [e.version for _, e in _events(redis_url, run)]  # type: ignore[attr-defined]
    assert sorted(versions) == list(range(rounds))
