"""Crash tests with real processes: the diff and compaction workers are SIGKILLed at
named points of a job (``pipeline.testing.faults``) and at random moments; after a restart
and rq's retry of the abandoned job every version is published exactly once (or not
at all and redone), the chain stays linear and every version rebuilds bit-exactly.

The scenario functions take counts and a seed, so ``benchmarks/reliability.py``
reruns them many times; the tests here run each point once and a few random kills.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from pipeline.config import JOB_HEARTBEAT_TTL_S, Settings
from pipeline.coord import replicas
from pipeline.coord.connection import redis_client
from pipeline.coord.events import AnchorAvailable, DeltaAvailable
from pipeline.coord.stream import EventStream
from pipeline.format.hashes.hashing import content_hash
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain, retention
from tests.pipeline_helpers import REPO, deltasync_env, wait_for
from tests.servers import RedisServer
from workers import queues
from workers.jobs.diff import request_compaction
from workers.runtime import Runtime
from workers.trainers.trainer import Emitter

pytestmark = [pytest.mark.slow, pytest.mark.redis]  # each test starts its own redis-server

PART_BYTES = 1 << 20  # the tiny model in four parts: faults after each upload
DIFF_POINTS = (
    "publish.after_read",
    "publish.after_encode",
    "publish.after_upload",
    "publish.after_upload@3",
    "publish.before_manifest",
    "publish.after_manifest",
    "diff.before_announce",
    "diff.after_announce",
)
FIRST_ANCHOR_POINTS = (
    "anchor.after_read",
    "anchor.after_encode",
    "anchor.after_upload",
    "anchor.before_manifest",
    "anchor.after_manifest",
)
COMPACT_POINTS = (
    "anchor.after_read@2",
    "anchor.after_encode",
    "anchor.after_upload@3",
    "anchor.before_manifest",
    "anchor.after_manifest",
    "compact.before_event",
    "compact.before_gc",
    "gc.after_manifests",
)


# --------------------------------------------------------------------------- processes


class Procs:
    """``deltasync`` processes in their own sessions, so the whole group (rq forks its
    scheduler) is killed at the end, even after the leader was SIGKILLed."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str, **extra_env: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers", *args],
                env={**self.env, **extra_env},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        self.started.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
        """A warm shutdown of one process and its group (an rq worker finishes its
        job and releases its scheduler lock first). rq raises its stop request from
        the signal handler; one that lands inside a log call is swallowed by the
        logging module, so the signal is sent again (a cold shutdown) if the process
        is still there after ``timeout_s``: call it on an idle worker."""
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
                return
        proc.wait(timeout=timeout_s)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log")))

    def close(self) -> None:
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self.started:  # orphans of a killed leader (rq's scheduler)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def wait_killed(proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    """The process died by SIGKILL (its own fault point)."""
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: the fault never fired") from None
    assert code == -signal.SIGKILL, f"{what}: exited with {code}, not SIGKILL"


def retry_abandoned(r: redis.Redis, queue_name: str) -> int:
    """What rq's maintenance does for jobs of a dead worker once their heartbeat has
    expired (job timeout + 60 s) or they sat in its intermediate queue: retry them by
    their retry policy. The clock is moved forward instead of waiting. Call it while
    no worker runs, so only dead workers' jobs are found."""
    queue = queues.queue(r, queue_name)
    registry = StartedJobRegistry(queue=queue)
    started = registry.get_job_ids()
    registry.cleanup(timestamp=time.time() + queues.COMPACT_TIMEOUT_S + 3600)
    stuck = IntermediateQueue(queue.key, connection=r)
    dequeued = [j for j in stuck.get_job_ids() if j not in started]
    for job_id in dequeued:
        stuck.remove(job_id)
        job = queue.fetch_job(job_id)
        if job is not None and job.get_status(refresh=True) not in FINAL:
            with r.pipeline() as pipe:
                job.retry(queue, pipe)
                pipe.execute()
    return len(started) + len(dequeued)


FINAL = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED)


# --------------------------------------------------------------------------- the run


@dataclass
class Cluster:
    """A private Redis, a store, a trainer and worker processes for one run."""

    tmp: Path
    redis_server: RedisServer
    run: str = "faults"
    env_extra: dict[str, str] = field(default_factory=dict)
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fault_file = self.tmp / "fault"
        self.env = deltasync_env(
            self.redis_server.url,
            self.tmp,
            DELTASYNC_FAULT_FILE=str(self.fault_file),
            DELTASYNC_COMPACT_MAX_CHAIN="1000",
            DELTASYNC_COMPACT_MAX_FRACTION="1000",
            **self.env_extra,
        )
        self.settings = Settings.from_env(self.env)
        self.store: ObjectStore = open_store(self.settings.store_url)
        self.redis = redis_client(self.redis_server.url)
        self.runtime = Runtime(self.settings)
        self.emitter = Emitter(self.run, settings=self.settings)
        self.generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=11)
        self.procs = Procs(self.env, self.tmp / "logs")
        self.step = -1
        self.direct: set[int] = set()  # published in this process: never announced

    def next_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        state = self.generator.state() if self.step < 0 else self.generator.step()
        self.step += 1
        self.states[self.step] = {n: t.clone() for n, t in state.items()}
        return self.step, self.states[self.step]

    def publish_here(self) -> int:
        """Publish the next step in this process (setup, not under test)."""
        step, state = self.next_state()
        path = self.tmp / "direct" / f"{step}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_state(state, path)
        cache = StateCache(self.tmp / "direct-cache", self.run)
        publish_step(self.store, self.run, step, path, cache, PublishOptions(part_bytes=PART_BYTES))
        self.direct.add(step)
        return step

    def emit(self) -> int:
        step, state = self.next_state()
        self.emitter.emit_state(step, state)
        return step

    def arm(self, fault: str) -> None:
        self.fault_file.write_text(fault)

    def head(self) -> int | None:
        return chain.list_versions(self.store, self.run).head

    def events(self) -> list[object]:
        stream = EventStream(self.redis, self.run)
        out: list[object] = []
        last = "0-0"
        while batch := stream.read(after_id=last, count=500):
            out.extend(event for _, event in batch)
            last = batch[-1][0]
        return out

    def check_versions(self, expected: set[int], *, lossy_events: bool = False) -> None:
        """Published: exactly ``expected``; one linear chain; each version rebuilds
        bit-exactly to the trainer's state; announced once each (at most once when
        Redis lost its stream on the way)."""
        index = chain.list_versions(self.store, self.run)
        assert set(index.versions) == expected, (index.versions, sorted(expected))
        previous: int | None = None
        for version in index.versions:
            kind = "delta" if version in index.deltas else "anchor"
            manifest = chain.load_manifest(self.store, self.run, kind, version)
            if kind == "delta":
                assert manifest.parent == previous, f"v{version} follows v{manifest.parent}"
            previous = version
        for version in index.versions:
            assert_rebuilds(self.store, self.run, version, self.states[version])
        announced = Counter(e.version for e in self.events() if isinstance(e, DeltaAvailable))
        if lossy_events:
            assert all(n == 1 for n in announced.values()), announced
        else:
            assert announced == Counter(set(index.versions) - self.direct), announced

    def check_reachable(self, held: int) -> None:
        """A replica holding ``held`` reaches the head by deltas, and every version from
        the newest anchor on rebuilds bit-exactly (nothing it needs was collected)."""
        index = chain.list_versions(self.store, self.run)
        version = index.head
        assert version is not None
        while version != held:
            assert version in index.deltas, f"v{version} is gone; a replica at v{held} needs it"
            version = chain.load_manifest(self.store, self.run, "delta", version).parent
            assert version is not None and version >= held
        newest = index.anchor_at_or_below(index.head or 0)
        assert newest is not None
        for v in index.versions:
            if v >= newest:
                assert_rebuilds(self.store, self.run, v, self.states[v])

    def close(self) -> None:
        self.procs.close()
        self.redis.close()


def assert_rebuilds(
    store: ObjectStore, run: str, version: int, want: dict[str, torch.Tensor]
) -> None:
    rebuilt = dict(chain.reconstruct_tensors(store, run, version))
    assert sorted(rebuilt) == sorted(want), f"v{version}: tensor names differ"
    for name, tensor in want.items():
        got = rebuilt[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, f"v{version} {name}"
        assert content_hash(got) == content_hash(tensor), f"v{version}: {name} differs"


@contextlib.contextmanager
def cluster(tmp: Path, **env_extra: str) -> Iterator[Cluster]:
    server = RedisServer(tmp / "redis")
    server.start()
    made = Cluster(tmp, server, env_extra=env_extra)
    try:
        yield made
    finally:
        made.close()
        server.stop()


# --------------------------------------------------------------------------- scenarios


@dataclass
class Outcome:
    runs: int = 0
    recovered: int = 0
    lost: int = 0  # versions neither published nor redone
    duplicated: int = 0  # versions announced more than once or published twice

    def add(self, other: Outcome) -> None:
        self.runs += other.runs
        self.recovered += other.recovered
        self.lost += other.lost
        self.duplicated += other.duplicated


def _recover(c: Cluster, kind: str, step: int, what: str) -> subprocess.Popen[bytes]:
    """A fresh worker; the abandoned job retried as rq would; the step published."""
    retry_abandoned(c.redis, queues.DIFF_QUEUE if kind == "diff" else queues.COMPACT_QUEUE)
    worker = c.procs.start(f"{kind}-{step}", "worker", kind)
    if kind == "diff":
        wait_for(lambda: c.head() == step, f"step {step} after {what}")
        wait_for(lambda: _job_done(c.redis, queues.diff_job_id(c.run, step)), f"job {step}")
    return worker


def _job_done(r: redis.Redis, job_id: str) -> bool:
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    return job.get_status(refresh=True) == JobStatus.FINISHED


def diff_crash_scenario(tmp: Path, points: tuple[str, ...], first: str | None) -> Outcome:
    """One run: the first version (an anchor) crashes at ``first``, then each delta step
    crashes once at its point; each is recovered before the next."""
    outcome = Outcome()
    with cluster(tmp) as c:
        published: set[int] = set()
        worker: subprocess.Popen[bytes] | None = None
        if first is None:
            published.add(c.publish_here())
        for fault in ((first,) if first else ()) + points:
            c.arm(fault)
            if worker is None or worker.poll() is not None:
                worker = c.procs.start(f"diff-armed-{c.step + 1}", "worker", "diff")
            step = c.emit()
            wait_killed(worker, fault)
            worker = _recover(c, "diff", step, fault)
            published.add(step)
            outcome.runs += 1
            outcome.recovered += 1
        c.check_versions(published)
    return outcome


def random_kill_scenario(tmp: Path, kills: int, seed: int) -> Outcome:
    """Kill the diff worker at random moments while steps are published."""
    rng = random.Random(seed)
    outcome = Outcome()
    with cluster(tmp) as c:
        c.publish_here()
        worker = c.procs.start("diff-0", "worker", "diff")
        wait_for(lambda: _worker_ready(c.redis), "a diff worker")
        for i in range(kills):
            step = c.emit()
            time.sleep(rng.uniform(0.0, 2.5))
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            retry_abandoned(c.redis, queues.DIFF_QUEUE)
            worker = c.procs.start(f"diff-{i + 1}", "worker", "diff")
            wait_for(lambda s=step: c.head() == s, f"step {step} after a random kill")
            # A kill between the manifest and the event leaves the announce to rq's retry
            # of the job, a moment after the version appears.
            job_id = queues.diff_job_id(c.run, step)
            wait_for(lambda j=job_id: _job_done(c.redis, j), f"job {job_id} after a kill")
            outcome.runs += 1
            outcome.recovered += 1
        c.check_versions(set(range(c.step + 1)))
    return outcome


def _worker_ready(r: redis.Redis) -> bool:
    from rq import Worker

    return bool(Worker.all(connection=r))


def workers_idle(r: redis.Redis, queue_name: str) -> bool:
    """Nothing queued or being taken, every live worker waiting for work (a dead
    worker's job may still be in the started registry)."""
    from rq import Worker

    queue = queues.queue(r, queue_name)
    return (
        queue.count == 0
        and not IntermediateQueue(queue.key, connection=r).get_job_ids()
        and all(w.get_state() == "idle" for w in Worker.all(connection=r) if _alive(w.pid))
    )


def _alive(pid: int | None) -> bool:
    """A worker process of this machine still runs (a killed one stays registered)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def compaction_crash_scenario(tmp: Path, points: tuple[str, ...]) -> Outcome:
    """Compactions killed at each point, with a replica holding an old version: the
    anchor appears whole (or not at all, then redone), nothing it needs is collected."""
    outcome = Outcome()
    with cluster(tmp, DELTASYNC_KEEP_ANCHORS="1") as c:
        for _ in range(3):
            c.publish_here()
        slow = 1  # a live replica still at v1 keeps every delta after it
        replicas.report(c.redis, c.run, "slow-node", slow, "-", ttl_s=3600)
        worker: subprocess.Popen[bytes] | None = None
        for fault in points:
            version = c.publish_here()
            c.publish_here()  # the head moves past the compacted version
            c.arm(fault)
            if worker is None or worker.poll() is not None:
                worker = c.procs.start(f"compact-armed-{version}", "worker", "compact")
            job_id = request_compaction(c.runtime, c.run, version, "test", requested_by="test")
            wait_killed(worker, fault)
            c.check_reachable(slow)
            worker = _recover(c, "compact", version, fault)
            wait_for(lambda j=job_id: _job_done(c.redis, j), f"compaction {version} ({fault})")
            index = chain.list_versions(c.store, c.run)
            assert version in index.anchors, f"{fault}: no anchor {version}"
            assert_rebuilds(c.store, c.run, version, c.states[version])
            c.check_reachable(slow)
            outcome.runs += 1
            outcome.recovered += 1
        anchored = Counter(e.version for e in c.events() if isinstance(e, AnchorAvailable))
        assert all(n == 1 for n in anchored.values()), anchored
        index = chain.list_versions(c.store, c.run)
        assert index.head == c.step
        # The run's folders hold nothing but published versions (no half anchors left
        # below the newest one, no orphan delta objects).
        assert not retention.orphan_delta_folders(c.store, c.run, c.step)
        assert not retention.orphan_anchor_folders(c.store, c.run, max(index.anchors))
    return outcome


# --------------------------------------------------------------------------- tests


def test_diff_worker_killed_at_every_point(tmp_path: Path) -> None:
    outcome = diff_crash_scenario(tmp_path, DIFF_POINTS, first=None)
    assert outcome.recovered == len(DIFF_POINTS)


@pytest.mark.parametrize("first", FIRST_ANCHOR_POINTS[1::2])
def test_diff_worker_killed_while_writing_the_first_anchor(tmp_path: Path, first: str) -> None:
    outcome = diff_crash_scenario(tmp_path, (), first=first)
    assert outcome.recovered == 1


def test_diff_worker_killed_at_random_moments(tmp_path: Path) -> None:
    outcome = random_kill_scenario(tmp_path, kills=3, seed=1234)
    assert outcome.recovered == 3


def test_a_killed_workers_last_job_is_retried_by_the_next_worker_unaided(tmp_path: Path) -> None:
    """A running job's lease in rq's started registry is a heartbeat renewed by its
    worker, lapsing JOB_HEARTBEAT_TTL_S after the worker dies, not rq's job timeout + 60 s
    (an hour). Killed on the last step (no later step's job publishes it first), its job
    is retried by the next worker's own maintenance: no clock moved, nothing by hand."""
    with cluster(tmp_path) as c:
        c.publish_here()
        held = replicas.RunLock(c.redis, c.run, "diff", 600)  # the job waits for it
        assert held.acquire()
        worker = c.procs.start("diff-killed", "worker", "diff")
        step = c.emit()
        job_id = queues.diff_job_id(c.run, step)
        registry = StartedJobRegistry(queue=queues.queue(c.redis, queues.DIFF_QUEUE))

        def lease_ends() -> float:
            ends = [sc for m, sc in c.redis.zrange(registry.key, 0, -1, withscores=True)
                    if m.decode().startswith(f"{job_id}:")]  # fmt: skip
            return max(ends, default=0.0)

        wait_for(lambda: lease_ends() > 0, "the job running")
        first = lease_ends()
        assert first - time.time() <= JOB_HEARTBEAT_TTL_S + 5, "a lease of rq's job timeout"
        wait_for(lambda: lease_ends() > first + 5, "the lease renewed while the job runs")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_for(lambda: time.time() > lease_ends() + 1, "the dead worker's lease to lapse")
        assert held.release()
        c.procs.start("diff-next", "worker", "diff")
        wait_for(lambda: c.head() == step, f"step {step} retried by the next worker")
        wait_for(lambda: _job_done(c.redis, job_id), f"job {job_id}")
        c.check_versions({0, step})


def test_compaction_worker_killed_at_every_point(tmp_path: Path) -> None:
    outcome = compaction_crash_scenario(tmp_path, COMPACT_POINTS)
    assert outcome.recovered == len(COMPACT_POINTS)
