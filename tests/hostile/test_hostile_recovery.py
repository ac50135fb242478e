"""Recovery where Redis and the store disagree, with real processes: the store is the
truth and events are hints.

- a policy compaction that fails is retried with backoff and `status` says why;
- a step emitted just before Redis lost its data is found again from the staging
  folder, and the run's store binding is restored from the store, so a worker on
  another store refuses the run;
- steps set aside while a damaged head blocked them publish after `deltasync repair`;
- a worker paused past its lease writes no `step-failed` for a step another worker
  published meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from rq.scheduler import RQScheduler

from pipeline.coord import keys
from pipeline.coord.events import StepFailed
from pipeline.publish.caches.state_cache import StateCache
from pipeline.store import open_store
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from tests.pipeline_helpers import cli, wait_for
from tests.workers.test_faults_workers import Cluster, cluster, retry_abandoned
from tests.workers.test_operator_day import _failed_for_good, _flip_a_byte
from workers import queues

pytestmark = [pytest.mark.slow, pytest.mark.redis]  # each test starts its own redis-server


def _status(c: Cluster) -> dict[str, Any]:
    done = cli(c.env, "status", "--run", c.run, "--json", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP), per the kernel."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _log_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def _job_ended(log: Path, job_id: str, after: int) -> bool:
    """The worker logging to ``log`` finished ``job_id`` (either way) in a line past the
    first ``after`` lines."""
    for doc in _log_lines(log)[after:]:
        if doc.get("logger") != "rq.worker" or doc.get("job_id") != job_id:
            continue
        if doc.get("level") == "error" or str(doc.get("event", "")).startswith("Successfully"):
            return True
    return False


def _leases_lapse(c: Cluster) -> None:
    """What time does to a stopped worker's leases, without waiting for it: its job's
    heartbeat (90 s) lapses and rq retries the job, its run lock (60 s) and its
    scheduler lock (a minute) expire."""
    retry_abandoned(c.redis, queues.DIFF_QUEUE)
    c.redis.delete(keys.lock_key(c.run, "diff"), RQScheduler.get_locking_key(queues.DIFF_QUEUE))


# --------------------------------------------------------------------------- compaction


def test_a_failing_policy_compaction_is_shown_and_retried_with_backoff(tmp_path: Path) -> None:
    policy = {"DELTASYNC_COMPACT_MAX_CHAIN": "3", "DELTASYNC_COMPACT_RETRY": "1"}
    with cluster(tmp_path) as c:
        c.procs.start("diff", "worker", "diff", **policy)
        c.emit()
        c.emit()
        wait_for(lambda: c.head() == 1, "v1")
        flipped = _flip_a_byte(c, 1)
        # A compaction worker on another machine: no state cache of its own proves a
        # later version, so the damaged chain fails it.
        elsewhere = str(tmp_path / "elsewhere-cache")
        c.procs.start("compact", "worker", "compact", DELTASYNC_CACHE=elsewhere, **policy)
        c.emit()
        c.emit()  # three deltas: the policy asks for an anchor
        wait_for(lambda: c.head() == 3, "v3")

        def failing() -> dict[str, Any] | None:
            found: dict[str, Any] | None = _status(c)["compaction_failing"]
            return found

        wait_for(lambda: (failing() or {}).get("failures", 0) >= 2, "a failed compaction retried")
        shown = failing()
        assert shown is not None and shown["retry_in_s"] >= 2  # 1 s, then doubled
        assert shown["reason"].startswith("CorruptObjectError: ") and "\n" not in shown["reason"]
        assert flipped in shown["reason"] and "deltasync repair" in shown["reason"]
        text = cli(c.env, "status", "--run", c.run).stdout
        lines = [line for line in text.splitlines() if "policy compaction failed" in line]
        assert len(lines) == 1 and shown["reason"] in lines[0], text

        _flip_a_byte(c, 1)  # the cause gone (the byte back): the next try compacts
        wait_for(lambda: 3 in chain.list_versions(c.store, c.run).anchors, "anchor 3")
        wait_for(lambda: failing() is None, "the failure forgotten")
        c.emit()
        c.emit()
        c.emit()  # three more deltas: the policy asks again, at once
        wait_for(lambda: 6 in chain.list_versions(c.store, c.run).anchors, "anchor 6")
        c.check_reachable(6)


# --------------------------------------------------------------------------- set-aside steps


def test_steps_set_aside_behind_a_damaged_head_publish_after_repair(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        first = c.procs.start("diff", "worker", "diff")
        for _ in range(3):
            c.emit()
        wait_for(lambda: c.head() == 2, "v2")
        cache = StateCache(c.settings.cache_dir, c.run)
        wait_for(lambda: cache.version == 2, "the diff worker's cache at the head")
        c.procs.stop(first)
        _flip_a_byte(c, 2)  # the head is damaged
        # A diff worker without that cache rebuilds the head from the store, and fails.
        c.procs.start("elsewhere", "worker", "diff", DELTASYNC_CACHE=str(tmp_path / "other"))
        blocked = [c.emit(), c.emit()]

        def set_aside() -> list[int]:
            return [d["step"] for d in _status(c)["dead_steps"]]

        wait_for(lambda: set_aside() == blocked, "steps 3 and 4 set aside")
        for step in blocked:
            wait_for(lambda s=step: _failed_for_good(c, s), f"rq's retries of step {step} over")
        shown = cli(c.env, "status", "--run", c.run).stdout
        assert f"deltasync retry --run {c.run} --step 3" in shown, shown

        done = cli(c.env, "repair", "--run", c.run)  # the cache on this machine proves v2
        assert done.returncode == 0, done.stderr[-3000:]
        assert "step 3, set aside meanwhile, sent again" in done.stdout, done.stdout
        wait_for(lambda: c.head() == 4, "the set-aside steps published")
        assert set_aside() == []
        c.check_versions({0, 1, 2, 3, 4}, lossy_events=True)


# --------------------------------------------------------------------------- paused worker


def test_a_worker_paused_past_its_lease_writes_no_false_step_failed(tmp_path: Path) -> None:
    with cluster(tmp_path, DELTASYNC_WORKER_LEASE="3") as c:
        paused = c.procs.start("paused", "worker", "diff")
        c.emit()
        wait_for(lambda: c.head() == 0, "v0")
        c.arm("stop:publish.after_read")  # stopped with step 1 read, before its encode
        step = c.emit()
        wait_for(lambda: _stopped(paused.pid), "the worker stopped")

        def workers() -> list[str]:
            found = _status(c)["queues"][queues.DIFF_QUEUE]["workers"]
            return [w["state"] for w in found]

        wait_for(lambda: workers() == ["dead"], "the paused worker past its lease")
        _leases_lapse(c)
        c.procs.start("other", "worker", "diff")
        wait_for(lambda: c.head() == step, "step 1 published by the other worker")

        log = c.procs.log_dir / "paused.log"
        seen = len(_log_lines(log))
        os.kill(paused.pid, signal.SIGCONT)
        job_id = queues.diff_job_id(c.run, step)
        wait_for(lambda: _job_ended(log, job_id, seen), "the resumed worker's job over")

        failed = [e for e in c.events() if isinstance(e, StepFailed)]
        assert failed == [], failed
        assert _status(c)["dead_steps"] == []
        c.check_versions({0, 1})


# --------------------------------------------------------------------------- Redis loses its data


def test_a_step_emitted_before_redis_lost_its_data_is_found_again(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        worker = c.procs.start("diff", "worker", "diff")
        c.emit()
        wait_for(lambda: c.head() == 0, "v0")
        c.procs.stop(worker)  # nothing takes the next steps yet

        lost = c.emit()
        c.redis.flushall()  # the step's job, pending entry and event are gone
        assert _status(c)["lost_steps"] == [lost]  # reported
        worker = c.procs.start("diff-again", "worker", "diff")
        c.emit()  # the emitter finds step 1 in its staging folder and sends it first
        wait_for(lambda: c.head() == 2, "v2")
        assert _status(c)["lost_steps"] == []

        c.procs.stop(worker)
        lost = c.emit()
        c.redis.flushall()
        shown = cli(c.env, "status", "--run", c.run)
        assert f"deltasync retry --run {c.run} --step {lost}" in shown.stdout, shown.stdout
        done = cli(c.env, "retry", "--run", c.run, "--step", str(lost))
        assert done.returncode == 0, done.stderr[-2000:]
        c.procs.start("diff-3", "worker", "diff")
        wait_for(lambda: c.head() == lost, "the lost step sent by `deltasync retry`")
        c.check_versions({0, 1, 2, 3}, lossy_events=True)


def test_the_store_binding_is_restored_from_the_store_after_redis_lost_it(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path) as c:
        right = c.procs.start("diff", "worker", "diff")
        c.emit()
        wait_for(lambda: c.head() == 0, "v0")
        c.procs.stop(right)
        c.redis.flushall()  # the binding of the run to its store is gone with the rest

        other_url = (tmp_path / "other-store").as_uri()
        wrong = c.procs.start("wrong", "worker", "diff", DELTASYNC_STORE=other_url)
        c.emit()  # the emitter binds the run again, from its store's record
        other = open_store(other_url)
        log = c.procs.log_dir / "wrong.log"
        refusal = f"run {c.run} is bound to store {c.settings.store_url}"
        wait_for(
            lambda: (
                refusal in log.read_text(errors="replace")
                or chain.list_versions(other, c.run).head is not None
            ),
            "the worker on another store done with step 1",
        )
        assert chain.list_versions(other, c.run).versions == ()  # it took nothing over
        lines = [d for d in _log_lines(log) if refusal in str(d.get("exc_info", d.get("event")))]
        assert lines, log.read_text()[-3000:]
        binding = run_binding.bound(c.redis, c.run)
        assert binding is not None and binding[0] == c.settings.store_url
        c.procs.stop(wrong)

        c.procs.start("diff-again", "worker", "diff")
        c.emit()  # step 1 publishes before it (rq's retry of it, or this job)
        wait_for(lambda: c.head() == 2, "v2 on the run's store")
        c.check_versions({0, 1, 2}, lossy_events=True)
