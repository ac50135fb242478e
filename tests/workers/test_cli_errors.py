"""Commands that meet a vanished job or an unusable path end with one line naming
it, not a traceback."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import torch
from rq.serializers import JSONSerializer
from rq.worker import Worker

from pipeline.coord.connection import redis_client
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store.file import FileStore
from pipeline.testing.synthetic import save_state
from tests.pipeline_helpers import REPO, deltasync_env
from workers import queues


def _one_error_line(stderr: str) -> str:
    """The one error line (log lines may come before it), with no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("deltasync: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@contextlib.contextmanager
def _compact_waiting(
    redis_url: str, tmp_path: Path, run: str, timeout_s: int
) -> Iterator[tuple[redis.Redis, Worker, subprocess.Popen[str], str]]:
    """`deltasync compact --run <run> --wait` of a published version 0, once its job is
    queued, beside a compaction worker that listens but never takes the job: (client,
    that worker, the command, the job's key)."""
    env = deltasync_env(redis_url, tmp_path)
    save_state({"w": torch.arange(16, dtype=torch.float32).bfloat16()}, tmp_path / "0.st")
    publish_step(
        FileStore(tmp_path / "store"), run, 0, tmp_path / "0.st", StateCache(tmp_path / "c", run)
    )
    client = redis_client(redis_url)
    queue = queues.queue(client, queues.COMPACT_QUEUE)
    worker = Worker([queue], connection=client, name=f"{run}-compactor", serializer=JSONSerializer)
    worker.register_birth()  # type: ignore[no-untyped-call]
    worker.heartbeat()
    job_key = f"rq:job:{queues.compact_job_id(run, 0, 'cli')}"
    args = ["compact", "--run", run, "--wait", "--timeout", str(timeout_s)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not client.exists(job_key):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        yield client, worker, proc, job_key
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        worker.register_death()  # type: ignore[no-untyped-call]


def test_compact_wait_ends_when_its_job_is_gone_from_redis(redis_url: str, tmp_path: Path) -> None:
    """A Redis restarted without persistence (or a job deleted) while `compact --wait`
    watches its job: one line saying so, not rq's InvalidJobOperation."""
    with _compact_waiting(redis_url, tmp_path, "vanish", 60) as (client, _, proc, job_key):
        client.delete(job_key)  # before or while the command watches it: the same line
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    line = _one_error_line(stderr)
    assert "is no longer in redis" in line and "deltasync compact" in line


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """--out below a file (a typo): the path and the reason, not an OSError traceback."""
    env = deltasync_env("redis://127.0.0.1:1/0", tmp_path)
    for version in (0, 1):
        state = {"w": torch.arange(16, dtype=torch.float32).add(version).bfloat16()}
        save_state(state, tmp_path / f"{version}.st")
    base, new = str(tmp_path / "0.st"), str(tmp_path / "1.st")
    out = tmp_path / "1.st" / "delta"
    done = subprocess.run(
        [sys.executable, "-m", "workers", "delta", "create", "--base", base, "--new", new,
         "--out", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    line = _one_error_line(done.stderr)
    assert line == f"deltasync: error: {tmp_path / '1.st'}: File exists"


def test_compact_wait_ends_when_no_worker_listens_any_more(redis_url: str, tmp_path: Path) -> None:
    """The only compaction worker goes away while `compact --wait` waits for its job:
    one line within the grace period, not a silent wait until --timeout."""
    with _compact_waiting(redis_url, tmp_path, "orphan", 300) as (_, worker, proc, _):
        worker.register_death()  # type: ignore[no-untyped-call]
        _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 1
    line = _one_error_line(stderr)
    assert "no compaction worker has listened" in line and "deltasync worker compact" in line
