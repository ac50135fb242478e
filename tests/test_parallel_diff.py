"""Parallel diff: real diff worker processes share the parts of each version; a helper
or the coordinator SIGKILLed mid-version still leaves each version published once.

The crash scenario functions take a folder (and a fault point), so
``benchmarks/reliability.py`` reruns them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaAvailable, DeltaPart, parse_event
from pipeline.coord.hints import channel as part_channel
from pipeline.coord.hints import publish_part
from pipeline.coord.replicas import RunLock
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import manifest_key, version_prefix
from pipeline.publish.diff import DeltaTask, LocalLedger, StaleBaseError, encode_parts
from pipeline.publish.parallel import (
    assemble,
    current_fanout,
    part_lock,
    start_fanout,
    work_parts,
)
from pipeline.publish.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store import open_store
from pipeline.testing import synthetic
from pipeline.versions import chain, retention
from tests.pipeline_helpers import assert_same_state, deltasync_env, processes, wait_for
from tests.test_faults_workers import (
    Cluster,
    Outcome,
    _job_done,
    _worker_ready,
    cluster,
    retry_abandoned,
    wait_killed,
    workers_idle,
)
from workers import queues
from workers.runtime import Runtime, set_current
from workers.trainer import Emitter

pytestmark = pytest.mark.slow

STEPS = 6
PART_BYTES = 1_600_000  # the tiny model (4.9 MB) in 4 parts


def _parts_encoded(log: Path) -> list[tuple[int, str]]:
    done = []
    for line in log.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == "part encoded":
            done.append((int(doc["version"]), str(doc["part"])))
    return done


def _workers_up(redis_url: str) -> int:
    from rq import Worker

    return len(Worker.all(connection=redis_client(redis_url)))


def test_two_workers_diff_parts_of_each_version(redis_url: str, tmp_path: Path) -> None:
    run = "par"
    env = deltasync_env(
        redis_url,
        tmp_path,
        DELTASYNC_PARALLEL_PARTS="1",
        DELTASYNC_PART_BYTES=str(PART_BYTES),
        DELTASYNC_COMPACT_MAX_CHAIN="100",
    )
    settings = Settings.from_env(env)
    set_current(Runtime(settings))
    emitter = Emitter(run, settings=settings)
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    store = open_store(settings.store_url)
    trainer: dict[int, dict[str, torch.Tensor]] = {}
    logs = tmp_path / "logs"
    with processes(env, logs, diff1=["worker", "diff"], diff2=["worker", "diff"]):
        # Both up, and one step at a time: a worker still importing torch, or
        # holding a later step's job while it waits for the run's diff lease, cannot
        # help, and the tiny model's parts take milliseconds. With every step emitted
        # at once the coordinator sometimes encoded every part of every version.
        wait_for(lambda: _workers_up(redis_url) == 2, "both diff workers")
        state = generator.state()
        for step in range(STEPS):
            if step:
                state = generator.step()
            trainer[step] = {n: t.clone() for n, t in state.items()}
            assert emitter.emit_state(step, state).event_id is not None
            wait_for(lambda s=step: chain.list_versions(store, run).head == s, f"version {step}")

    index = chain.list_versions(store, run)
    assert index.versions == tuple(range(STEPS)), "every step published, in order"
    assert index.anchors == (0,)
    for version, expected in trainer.items():
        rebuilt = dict(chain.reconstruct_tensors(store, run, version))
        assert_same_state(rebuilt, expected, f"version {version}")
        manifest = chain.load_manifest(store, run, "anchor" if version == 0 else "delta", version)
        assert 3 <= len(manifest.objects) <= 4
        assert manifest.tensor_form == "given"  # a mapping, published as given

    by_worker = {name: _parts_encoded(logs / f"{name}.log") for name in ("diff1", "diff2")}
    assert all(by_worker.values()), f"both workers encode parts: {by_worker}"
    every = sorted(by_worker["diff1"] + by_worker["diff2"])
    parts = len(chain.load_manifest(store, run, "delta", 1).objects)
    expected_parts = sorted(
        (v, f"part-{i:05d}.safetensors") for v in range(1, STEPS) for i in range(parts)
    )
    assert every == expected_parts, "each part of each delta encoded exactly once"

    stream = EventStream(redis_client(redis_url), run)
    events = stream.read(after_id="0-0", count=1000)
    available = sorted(e.version for _, e in events if isinstance(e, DeltaAvailable))
    assert available == list(range(STEPS)), "each version announced exactly once"


def test_parts_equal_the_single_job_and_manifest_waits_for_every_part(
    redis_url: str, tmp_path: Path
) -> None:
    """In process: the parallel parts are byte-identical to the single-job delta's, each
    part is encoded once and hinted once stored, and no manifest is written while a part
    is unrecorded."""
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=7)
    paths = []
    for step in range(2):
        state = generator.state() if step == 0 else generator.step()
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(state, paths[-1])
    r = redis_client(redis_url)
    stores = {}
    for name in ("single", "parallel"):
        store = open_store(f"file://{tmp_path / name}")
        cache = StateCache(tmp_path / f"cache-{name}", "run")
        publish_step(store, "run", 0, paths[0], cache, level=1, part_bytes=PART_BYTES)
        stores[name] = (store, cache)
    store, cache = stores["single"]
    single = publish_step(store, "run", 1, paths[1], cache, level=1).manifest
    assert single is not None

    store, cache = stores["parallel"]
    parent = chain.load_manifest(store, "run", "anchor", 0)
    fanout = DeltaTask("run", 1, str(paths[1]), 0, "anchor", 1)
    start_fanout(r, fanout)
    hints = r.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    hints.subscribe(part_channel("run"))

    def hint(part: DeltaPart) -> None:
        publish_part(r, part)

    assert work_parts(r, store, cache, fanout, parent, on_part=hint) == len(parent.objects) >= 3
    assert work_parts(r, store, cache, fanout, parent, on_part=hint) == 0, "each part once"
    missing = parent.objects[1].key
    record = r.hget(keys.part_records_key("run", 1, 0), missing)
    r.hdel(keys.part_records_key("run", 1, 0), missing)
    with pytest.raises(ChainError, match="not recorded"):
        assemble(r, store, fanout, parent, None)
    assert not store.exists(manifest_key("run", "delta", 1))
    assert record is not None
    r.hset(keys.part_records_key("run", 1, 0), missing, record)
    manifest = assemble(r, store, fanout, parent, None)
    assert manifest.objects == single.objects
    heard = []
    deadline = time.monotonic() + 30
    while len(heard) < len(manifest.objects) and time.monotonic() < deadline:
        message = hints.get_message(timeout=1.0)  # None also for the subscribe reply
        if message is not None:
            heard.append(parse_event(message["data"]))
    hints.close()
    assert sorted((h.version, h.parent, h.key, h.size, h.sha256) for h in heard) == sorted(  # type: ignore[attr-defined]
        (1, 0, o.key, o.size, o.sha256) for o in manifest.objects
    )
    assert manifest.tensors == single.tensors and manifest.state_hash == single.state_hash
    for obj in manifest.objects:
        key = version_prefix("run", "delta", 1) + obj.key
        assert store.get(key) == stores["single"][0].get(key)


def test_a_part_against_the_wrong_base_is_refused(tmp_path: Path) -> None:
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    paths = []
    for step in range(3):
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(generator.state() if step == 0 else generator.step(), paths[-1])
    store = open_store(f"file://{tmp_path / 'store'}")
    cache = StateCache(tmp_path / "cache", "run")
    publish_step(store, "run", 0, paths[0], cache, level=1, part_bytes=PART_BYTES)
    anchor = chain.load_manifest(store, "run", "anchor", 0)
    fanout = DeltaTask("run", 2, str(paths[2]), 0, "anchor", 1)
    with (
        CheckpointReader(paths[1]) as base,
        CheckpointReader(paths[2]) as new,
        pytest.raises(StaleBaseError, match="does not match version 0"),
    ):
        encode_parts(store, fanout, anchor, base, new, LocalLedger())
    assert list(store.list("run/deltas/")) == []
    ledger = LocalLedger()
    with CheckpointReader(paths[0]) as base, CheckpointReader(paths[2]) as new:
        assert encode_parts(store, fanout, anchor, base, new, ledger) == len(anchor.objects)
        full = content_hashes.of(anchor).full
        entries = [e for r in ledger.records().values() for e in r.tensors]
        assert sorted((e.name, e.hash) for e in entries) == sorted(
            (n, full(new.view(n))) for n in new.names()
        )


def test_a_step_redone_against_a_newer_head_encodes_its_parts_again(
    redis_url: str, tmp_path: Path
) -> None:
    """A coordinator of step 2 died with every part of 2 recorded against version 0;
    step 1 was published since. The next coordinator of 2 (parent 1) must not reuse
    those records or objects, and the dead fan-out can no longer be assembled."""
    generator = synthetic.UpdateGenerator(synthetic.ModelConfig.preset("tiny"), lr=1e-5, seed=3)
    states, paths = [], []
    for step in range(3):
        state = generator.state() if step == 0 else generator.step()
        states.append({n: t.clone() for n, t in state.items()})
        paths.append(tmp_path / f"step-{step}.safetensors")
        synthetic.save_state(states[-1], paths[-1])
    r = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    cache = StateCache(tmp_path / "cache", "redo")
    publish_step(store, "redo", 0, paths[0], cache, level=1, part_bytes=PART_BYTES)
    anchor = chain.load_manifest(store, "redo", "anchor", 0)
    dead = DeltaTask("redo", 2, str(paths[2]), 0, "anchor", 1)
    assert work_parts(r, store, cache, dead, anchor) == len(anchor.objects)
    stale = {o.key: store.get(version_prefix("redo", "delta", 2) + o.key) for o in anchor.objects}

    assert publish_step(store, "redo", 1, paths[1], cache, level=1).status == "published"
    with pytest.raises(ChainError, match="head moved to 1"):
        assemble(r, store, dead, anchor, None)
    assert not store.exists(manifest_key("redo", "delta", 2))

    parent = chain.load_manifest(store, "redo", "delta", 1)
    redo = DeltaTask("redo", 2, str(paths[2]), 1, "delta", 1)
    start_fanout(r, redo)
    assert work_parts(r, store, cache, redo, parent) == len(parent.objects)
    manifest = assemble(r, store, redo, parent, None)
    assert manifest.parent == 1
    fresh = {o.key: store.get(version_prefix("redo", "delta", 2) + o.key) for o in manifest.objects}
    assert fresh != stale, "the objects encoded against version 0 were replaced"
    for version, state in enumerate(states):
        rebuilt = dict(chain.reconstruct_tensors(store, "redo", version))
        assert_same_state(rebuilt, state, f"version {version}")


# --------------------------------------------------------------------------- crashes

COORDINATOR_POINTS = ("publish.after_upload@2", "publish.before_manifest")
# A claim held by a helper on another machine: never taken over, only lapses.
FOREIGN_HOLDER = "another-machine:0:1:0:"
FOREIGN_LAPSE_S = 4.0


def _claim_key(c: Cluster, step: int, index: int) -> str:
    return RunLock(c.redis, c.run, part_lock(step, index), 60).key


def _holder_pid(c: Cluster, key: str) -> int | None:
    raw = c.redis.get(key)
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    fields = text.split(":")
    return int(fields[2]) if len(fields) == 5 and fields[2].isdigit() else None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """What a supervisor does: the worker's whole process group (rq's scheduler too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _step_done(c: Cluster, step: int, what: str) -> None:
    wait_for(lambda: c.head() == step, f"step {step} {what}")
    job_id = queues.diff_job_id(c.run, step)
    wait_for(lambda: _job_done(c.redis, job_id), f"job {job_id} {what}")


def helper_kill_scenario(tmp: Path) -> Outcome:
    """A helper is SIGKILLed while it holds a part claim; another part's claim belongs to
    a helper on another machine that vanished. The coordinator takes the dead local
    claim over at once, waits for the foreign lease to lapse, encodes both parts and
    publishes the version once; the next step follows."""
    outcome = Outcome()
    with cluster(tmp, DELTASYNC_PARALLEL_PARTS="1") as c:
        c.publish_here()
        parts = chain.load_manifest(c.store, c.run, "anchor", 0).parts()
        coordinator = c.procs.start("coordinator", "worker", "diff")
        wait_for(lambda: _worker_ready(c.redis), "the coordinator")
        step = c.step + 1
        # Gate every part until the coordinator is stopped, so the helper gets one.
        gates = [_claim_key(c, step, i) for i in range(len(parts))]
        for key in gates:
            c.redis.set(key, FOREIGN_HOLDER + "gate", px=120_000)
        assert c.emit() == step
        diff_queue = queues.queue(c.redis, queues.DIFF_QUEUE)
        wait_for(
            lambda: current_fanout(c.redis, c.run) is not None and diff_queue.count == len(parts),
            "the fan-out and its part jobs",
        )
        os.kill(coordinator.pid, signal.SIGSTOP)
        try:
            for key in gates[:-1]:
                c.redis.delete(key)
            helper = c.procs.start(
                "helper", "worker", "diff", DELTASYNC_FAULT="publish.after_encode"
            )
            wait_killed(helper, "the helper")
            _kill_group(helper)
            held = [k for k in gates if _holder_pid(c, k) == helper.pid]
            assert len(held) == 1, "the helper died holding a part claim"
            c.redis.pexpire(gates[-1], int(FOREIGN_LAPSE_S * 1000))
            lapse_at = time.monotonic() + FOREIGN_LAPSE_S
        finally:
            os.kill(coordinator.pid, signal.SIGCONT)
        while time.monotonic() < lapse_at - 1.0:
            assert c.head() == step - 1, "no manifest while a part is claimed"
            time.sleep(0.2)
        _step_done(c, step, "after the helper died")
        encoded = _parts_encoded(c.procs.log_dir / "coordinator.log")
        assert sorted(p for v, p in encoded if v == step) == sorted(k for k, _ in parts)
        assert coordinator.poll() is None
        _step_done(c, c.emit(), "after the version the helper left")
        c.check_versions(set(range(c.step + 1)))
        assert not retention.orphan_delta_folders(c.store, c.run, c.step)
        outcome.runs = outcome.recovered = 1
    return outcome


def coordinator_kill_scenario(tmp: Path, fault: str, *, rq_retry: bool) -> Outcome:
    """The coordinator is SIGKILLed at ``fault`` (parts uploaded, no manifest). Recovery
    by rq's retry of its job (``rq_retry``), or by the next step's job, which publishes
    the pending step first (rq's late retry then finds it published). Either way the
    version is published and announced once, bit-exact, and the run goes on."""
    outcome = Outcome()
    with cluster(tmp, DELTASYNC_PARALLEL_PARTS="1") as c:
        c.publish_here()
        parts = len(chain.load_manifest(c.store, c.run, "anchor", 0).objects)
        c.arm(fault)
        coordinator = c.procs.start("coordinator", "worker", "diff")
        step = c.emit()
        # Only the leader dies: its rq scheduler lives on and schedules the retry (a
        # killed scheduler's lock would hold retries back until it lapses).
        wait_killed(coordinator, fault)
        left = list(c.store.list(version_prefix(c.run, "delta", step)))
        # At the second upload the third part's may be on its way too.
        uploaded = (2, 3) if fault.endswith("@2") else (parts, parts)
        assert uploaded[0] <= len(left) <= uploaded[1], left
        assert c.head() == step - 1
        if rq_retry:
            assert retry_abandoned(c.redis, queues.DIFF_QUEUE) == 1
            c.procs.start("restarted", "worker", "diff")
            _step_done(c, step, f"after {fault}")
            _step_done(c, c.emit(), f"after the version of {fault}")
        else:
            restarted = c.procs.start("restarted", "worker", "diff")
            following = c.emit()
            _step_done(c, following, f"after {fault}")
            assert c.head() == following and step in chain.list_versions(c.store, c.run).deltas
            # Stale part jobs may still be on their way through a live worker: stop it
            # once it has taken them all, so that only the dead coordinator's job is
            # found abandoned.
            wait_for(lambda: workers_idle(c.redis, queues.DIFF_QUEUE), "the stale part jobs")
            c.procs.stop(restarted)
            assert retry_abandoned(c.redis, queues.DIFF_QUEUE) == 1
            c.procs.start("late", "worker", "diff")
            job_id = queues.diff_job_id(c.run, step)
            wait_for(lambda: _job_done(c.redis, job_id), f"the late retry of {job_id}")
        c.check_versions(set(range(c.step + 1)))
        assert not retention.orphan_delta_folders(c.store, c.run, c.step)
        outcome.runs = outcome.recovered = 1
    return outcome


def test_helper_killed_holding_a_part_claim(tmp_path: Path) -> None:
    assert helper_kill_scenario(tmp_path).recovered == 1


@pytest.mark.parametrize(
    ("fault", "rq_retry"), [(COORDINATOR_POINTS[0], False), (COORDINATOR_POINTS[1], True)]
)
def test_coordinator_killed_before_its_manifest(tmp_path: Path, fault: str, rq_retry: bool) -> None:
    assert coordinator_kill_scenario(tmp_path, fault, rq_retry=rq_retry).recovered == 1
