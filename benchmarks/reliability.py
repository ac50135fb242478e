"""Rerun the reliability scenarios many times and write docs/RELIABILITY.md.

    python benchmarks/reliability.py            # full counts (about 15 minutes, 2 cores)
    python benchmarks/reliability.py --quick    # one round of each, for a smoke check

Every scenario uses real processes and servers (redis-server, SeaweedFS S3, the
`deltasync` worker and rollout commands) through the scenario functions of the
tests (tests/rollout/test_faults_rollout.py, tests/workers/test_faults_workers.py,
tests/coord/test_service_loss.py, tests/hostile/test_hostile_corruption.py); a scenario
that raises counts as a failure and its first line is written into the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.logs import configure_logging  # noqa: E402
from tests.coord import test_service_loss as service  # noqa: E402
from tests.hostile import test_hostile_corruption as corruption  # noqa: E402
from tests.rollout import test_faults_rollout as rollout  # noqa: E402
from tests.servers import RedisServer, SeaweedS3Server, redis_executable  # noqa: E402
from tests.workers import test_faults_workers as workers  # noqa: E402


@dataclass
class Row:
    scenario: str
    unit: str  # what one run is
    ok: str  # what every passed run showed
    runs: int = 0
    passed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def outcome(self) -> str:
        text = f"{self.passed}/{self.runs} {self.ok}"
        if self.failures:
            text += f"; {len(self.failures)} FAILED, first: {self.failures[0][:160]}"
        return text


def attempt(row: Row, runs: int, body: Callable[[Path], int]) -> None:
    """Run ``body`` in a fresh folder; it returns how many runs it covered."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deltasync-rel-") as tmp:
        try:
            covered = body(Path(tmp))
            row.runs += covered
            row.passed += covered
        except Exception as exc:  # a failed scenario is a result, not a crash
            row.runs += runs
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            row.failures.append(line.replace("|", "/").replace("\n", " "))
    row.seconds += time.perf_counter() - started
    print(f"  {row.scenario}: {row.passed}/{row.runs} ({row.seconds:.0f}s)", flush=True)


def redis_url(tmp: Path) -> tuple[RedisServer, str]:
    server = RedisServer(tmp / "redis")
    server.start()
    return server, server.url


def with_redis(body: Callable[[Path, str], int]) -> Callable[[Path], int]:
    def run(tmp: Path) -> int:
        server, url = redis_url(tmp)
        try:
            return body(tmp, url)
        finally:
            server.stop()

    return run


CRASH_OK = "recovered: 0 versions lost, 0 duplicated, chain linear, all versions bit-exact"
NODE_OK = "converged to the head with a dump bit-identical to the trainer's"
SERVICE_OK = "recovered: every version exact, nodes at the head bit-exactly"


def s3_outage(server: SeaweedS3Server, url: str) -> Callable[[Path], int]:
    return lambda tmp: service.s3_outage_scenario(tmp, server, url).runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of each scenario")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "RELIABILITY.md")
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()
    rounds = 1 if args.quick else 3
    random_kills = 3 if args.quick else 12
    fuzz_examples = 300 if args.quick else 3000
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_logging("error")  # the in-process scenarios' logs; processes log to files
    started = time.perf_counter()
    rows: list[Row] = []

    def row(scenario: str, unit: str, ok: str = CRASH_OK) -> Row:
        rows.append(Row(scenario, unit, ok))
        print(scenario, flush=True)
        return rows[-1]

    # -- crashes
    def diff_points(tmp: Path) -> int:
        return workers.diff_crash_scenario(tmp, workers.DIFF_POINTS, None).runs

    def first_anchor(point: str) -> Callable[[Path], int]:
        return lambda tmp: workers.diff_crash_scenario(tmp, (), point).runs

    def diff_random(tmp: Path) -> int:
        return workers.random_kill_scenario(tmp, random_kills, args.seed).runs

    def compact_points(tmp: Path) -> int:
        return workers.compaction_crash_scenario(tmp, workers.COMPACT_POINTS).runs

    def node_points(tmp: Path, url: str) -> int:
        return rollout.rollout_crash_scenario(tmp, url, rollout.ROLLOUT_POINTS).runs

    def node_walked(tmp: Path, url: str) -> int:
        walked = {"DELTASYNC_PATCH_MEMORY_MB": "0"}
        return rollout.rollout_crash_scenario(
            tmp, url, ("target.mid_walk@2",), walked, content_hash="xxh3-128"
        ).runs

    def node_resume(tmp: Path, url: str) -> int:
        return rollout.resume_crash_scenario(tmp, url).runs

    def node_random(tmp: Path, url: str) -> int:
        return rollout.random_node_kill_scenario(tmp, url, random_kills, args.seed).runs

    r = row(
        f"diff worker SIGKILLed at each of {len(workers.DIFF_POINTS)} points of a delta "
        "publish (after read, encode, 1st and 3rd upload, before/after manifest, "
        "before/after the event)",
        "kill + restart + rq retry",
    )
    for _ in range(rounds):
        attempt(r, len(workers.DIFF_POINTS), diff_points)
    r = row(
        f"diff worker SIGKILLed at each of {len(workers.FIRST_ANCHOR_POINTS)} points of "
        "a run's first anchor",
        "kill + restart + rq retry",
    )
    for _ in range(max(1, rounds - 1)):
        for point in workers.FIRST_ANCHOR_POINTS:
            attempt(r, 1, first_anchor(point))
    r = row("diff worker SIGKILLed at random moments (seeded) while steps publish", "kill")
    attempt(r, random_kills, diff_random)
    r = row(
        f"compaction worker SIGKILLed at each of {len(workers.COMPACT_POINTS)} points "
        "(anchor parts, manifest, event, before GC, between GC's manifest and object "
        "deletes), a live replica at an old version",
        "kill + restart + rq retry",
    )
    for _ in range(rounds):
        attempt(r, len(workers.COMPACT_POINTS), compact_points)
    r = row(
        f"rollout node SIGKILLed at each of {len(rollout.ROLLOUT_POINTS)} points "
        "(mid-bootstrap, mid-download, mid-write, after apply before its state file); "
        "restarted, dump hashed against the trainer",
        "kill + restart",
        NODE_OK,
    )
    for _ in range(rounds):
        attempt(r, len(rollout.ROLLOUT_POINTS), with_redis(node_points))
    r = row(
        "rollout node without memory for decoded patches (DELTASYNC_PATCH_MEMORY_MB=0: "
        "deltas walked into the weights) SIGKILLed between two walked tensors",
        "kill + restart",
        NODE_OK,
    )
    for _ in range(rounds):
        attempt(r, 1, with_redis(node_walked))
    r = row(
        "rollout node restarted from its own dump after a mid-write kill (resumes "
        "without bootstrap; a stale dump is never resumed)",
        "kill + 2 restarts",
        NODE_OK,
    )
    for _ in range(rounds):
        attempt(r, 1, with_redis(node_resume))
    r = row("rollout node SIGKILLed at random moments (seeded)", "kill + restart", NODE_OK)
    attempt(r, random_kills, with_redis(node_random))

    # -- service loss
    restarts = 2 if args.quick else 4
    r = row(
        "Redis restarted without persistence mid-run (diff worker and a node running)",
        "restart",
        SERVICE_OK,
    )
    attempt(r, restarts, lambda t: service.redis_restart_scenario(t, restarts=restarts).runs)
    s3_dir = Path(tempfile.mkdtemp(prefix="deltasync-rel-s3-"))
    s3 = SeaweedS3Server(s3_dir)
    s3.start()
    os.environ.update(s3.store_environment())
    try:
        r = row(
            "S3 server down while a diff job runs (job fails, rq retries with backoff, "
            "publishes once S3 is back)",
            "outage",
            SERVICE_OK,
        )
        for i in range(rounds):
            prefix = s3.url(f"rel{os.getpid()}x{i}")
            attempt(r, 1, s3_outage(s3, prefix))
    finally:
        s3.stop()
        shutil.rmtree(s3_dir, ignore_errors=True)
    r = row("event stream trimmed below a node's position (node polls rarely)", "trim", SERVICE_OK)
    for _ in range(rounds):
        attempt(r, 1, lambda t: service.trimmed_stream_scenario(t).runs)

    # -- corruption (in-process node, real Redis)
    r = row(
        "delta or anchor object damaged (flipped bit, truncated, deleted, older version's "
        "object; a served node's only way forward a damaged anchor): refused before any "
        "weight changes, replica-error, repaired -> recovers",
        "damage",
        "detected before any weight changed, replica-error published, last good version kept, "
        "recovered after repair",
    )

    def damaged_deltas(tmp: Path, url: str) -> int:
        published = rollout.publish_run(tmp / "pub", versions=5)
        count = 0
        for damage in sorted(corruption.DAMAGES):
            case = tmp / f"delta-{damage}"
            case.mkdir()
            corruption.test_damaged_delta_is_refused_and_repair_recovers(
                published, case, url, damage
            )
            count += 1
        for damage in ("flipped-bit", "truncated", "deleted"):
            case = tmp / f"anchor-{damage}"
            case.mkdir()
            corruption.test_damaged_anchor_is_refused_and_repair_recovers(
                published, case, url, damage
            )
            count += 1
        case = tmp / "served"
        case.mkdir()
        corruption.test_damaged_anchor_never_replaces_a_served_version(published, case, url)
        return count + 1

    for _ in range(rounds):
        attempt(r, 8, with_redis(damaged_deltas))

    # -- fuzzing
    r = row(
        f"fuzzing with hypothesis ({fuzz_examples} examples per target): event parser, "
        "manifest parser, delta decoder; only DeltasyncError escapes",
        "target",
        "passed: nothing but DeltasyncError escaped",
    )

    def fuzz(_tmp: Path) -> int:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/hostile/test_hostile_input.py",
                "-k",
                "fuzz",
            ],
            cwd=REPO,
            env={**os.environ, "DELTASYNC_FUZZ_EXAMPLES": str(fuzz_examples)},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(done.stdout.strip().splitlines()[-1])
        return 3

    attempt(r, 3, fuzz)

    total = time.perf_counter() - started
    write_report(args.out, rows, total, args)
    print(f"wrote {args.out} ({total / 60:.1f} min)")
    if any(row.failures for row in rows):
        sys.exit(1)


def _redis_version() -> str:
    """The version of the redis-server the scenarios start (tests/servers.py picks it)."""
    done = subprocess.run(
        [redis_executable(), "--version"], capture_output=True, text=True, check=False
    )
    words = done.stdout.split()
    return next((w[2:] for w in words if w.startswith("v=")), "version unknown")


def write_report(path: Path, rows: list[Row], total_s: float, args: argparse.Namespace) -> None:
    command = "python benchmarks/reliability.py" + (" --quick" if args.quick else "")
    lines = [
        "# Reliability",
        "",
        f"Produced by `{command}` (seed {args.seed}) on "
        f"{datetime.now(UTC).strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
        f"in {total_s / 60:.1f} minutes. Every run uses real processes and servers: "
        f"redis-server ({_redis_version()}), the SeaweedFS S3 server, "
        "`deltasync worker diff|compact` and `deltasync rollout` processes killed with "
        "SIGKILL (fault points of `pipeline/testing/faults.py`, or at seeded random moments).",
        "",
        "After each run the checks are: every emitted step is published exactly once "
        "(redone by rq's retry of the abandoned job when the kill came before its "
        "manifest), `delta-available` is announced once per version, each delta's "
        "parent is the previous version (one linear chain), every version rebuilds from "
        "the store with the trainer's content hashes, and nodes' dumps hash equal to the "
        "trainer's head. The CI tests (`tests/rollout/test_faults_rollout.py`, "
        "`tests/workers/test_faults_workers.py`, "
        "`tests/coord/test_service_loss.py`, `tests/hostile/`, "
        "`tests/hostile/test_signing_e2e.py`) run each point once.",
        "",
        "| Scenario | Runs | Outcome | Time |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.scenario} | {row.runs} ({row.unit}) | {row.outcome()} | {row.seconds:.0f} s |"
        )
    lines += [
        "",
        "## How recovery works, and its limits",
        "",
        "- A killed worker's job stays in rq's started registry until its heartbeat "
        "lapses. The worker renews it every 15 s while the job runs, so it lapses 90 s "
        "after the worker died (rq's SimpleWorker alone would keep it for the job "
        "timeout + 60 s, about an hour for diff jobs); the next maintenance of any "
        "worker (every 60 s) then retries it, so a step whose worker was killed "
        "publishes within about 2.5 minutes even when no later step comes "
        "(`test_a_killed_workers_last_job_is_retried_by_the_next_worker_unaided`). The "
        "other scenarios move that clock forward (`StartedJobRegistry.cleanup` with a "
        "later time) instead of waiting. Meanwhile later steps still publish (versions "
        "need not be contiguous); a step retried after a newer head is skipped as "
        "stale, so the chain stays linear.",
        "- The run lock is a 60 s lease renewed while a job runs; a lock whose holder "
        "process is gone from the same machine is taken over at once.",
        "- rq's scheduler (delayed retries) runs on a thread of the worker that holds "
        "its lock, not in the child process rq forks. A child forked while another "
        "thread of the worker holds a file lock keeps that lock for its whole life: had "
        "a worker taken the scheduler over (its holder killed) while its cache scrub "
        "held a state cache's shared lock, the next diff job would wait for ever for "
        "the exclusive lock, under a diff lease it kept renewing, and the run would "
        "stop publishing (`tests/workers/test_worker_process.py` holds such a lock across the "
        "scheduler's start). A writer also waits at most 15 minutes for that lock, "
        "saying so every 30 s, then fails with a LockError its job is retried on "
        "(`tests/publish/test_cache_scrub.py`). A killed worker's scheduler dies with it. Its "
        "lock names the process, so a worker of the same machine and container takes it "
        "over at once; from elsewhere the lock lapses in about a minute and another "
        "worker takes the scheduler over at its next maintenance (deltasync runs it "
        "every 60 s instead of rq's 10 min), so scheduled retries can wait up to about "
        "two minutes; the next step's job does not (it publishes pending earlier steps "
        "first). `deltasync status` shows each worker's state and job, the jobs running "
        "and the steps waiting to publish.",
        "- A sharded step's part claim is a 60 s lease like the run lock (taken over at "
        "once from a dead process on the machine). A dead coordinator's step is redone "
        "by rq's retry or by the next step's job, reusing the parts recorded against the "
        "same parent; parts of a step never published are collected by the next garbage "
        "collection once a newer version is the head.",
        "- A node serving a version that must re-bootstrap proves the whole anchor "
        "first (held in memory), so a damaged anchor never leaves a mix of versions; "
        "a fresh node's failed bootstrap claims no version.",
        "- Early start (`DELTASYNC_EARLY_START`) adds `delta-part` hints on a pub/sub "
        "channel, and they are only hints. A node uses an early download only if the "
        "manifest lists its object with the same sha256. It uses an early proof only "
        "if, in addition, the target has not been written since (a per-target "
        "generation token). The manifest's tensor hashes are checked either way, and "
        "nothing is written before the manifest. Lost, duplicated, malformed, wrong-sha "
        "or never-published hints change nothing applied; so do proofs made by another "
        "replica or before a reload. `tests/publish/test_early_parts.py` runs each of these, "
        "plus real diff and rollout processes. These cases are covered by the tests, "
        "not by a row of the table above.",
        "- A torch target applying a delta above `DELTASYNC_PATCH_MEMORY_MB` keeps no "
        "decoded patches: it writes proven tensors by decoding their deltas again and "
        "undoes a failed write by walking the written deltas back. The write stays all "
        "or nothing: `tests/targets/test_walked_apply.py` fails the write at the first, second "
        "and third walked tensor, with patched tensors already written, and finds every "
        "tensor bit-identical to before; a real `deltasync rollout` process with "
        "`DELTASYNC_PATCH_MEMORY_MB=0` ends bit-identical to the trainer "
        "(`tests/rollout/test_rollout_process.py`).",
        "- Linked caches (`DELTASYNC_CACHE_LINK`) never write into a file shared with a "
        "checkpoint. A checkpoint rewritten in place, before a diff or during one "
        "(before or after its hashes), is caught by the recorded size and mtime or by "
        "the base's hashes. The cache is then rebuilt from the store, and no wrong "
        "delta is published (`tests/publish/test_cache_link.py`).",
        "",
        # Hand-written: the hardening cases are tests, not timed scenarios.
        (Path(__file__).parent / "reliability_hardening.md").read_text(),
    ]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
