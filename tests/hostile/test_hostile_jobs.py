"""Jobs that are not deltasync's: rq imports and calls whatever function a job names,
so anyone who can write to Redis could run code as the workers' user (and copy the
signing key). Real workers on every queue they serve refuse such jobs before
importing anything of them: set aside in rq's failed registry with a one-line
reason, recorded for `deltasync status`, announced as `job-refused` in `deltasync
tail`; the workers go on publishing and compacting."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from rq import Callback, Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.keys import refused_jobs_key
from pipeline.format.manifest import manifest_key
from pipeline.store import open_store
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers import queues
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.redis
RUN = "hostile-jobs"
HOST = "h1"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g)}


def _write(path: Path, seed: int) -> Path:
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    write_checkpoint(path, _state(seed).items())
    return path


@pytest.mark.slow
def test_workers_refuse_jobs_that_are_not_deltasyncs(tmp_path: Path, redis_url: str) -> None:
    env = deltasync_env(redis_url, tmp_path, DELTASYNC_DIFF_HOST=HOST)
    settings = Settings.from_env(env)
    store = open_store(settings.store_url)
    r = redis_client(redis_url)
    secret = tmp_path / "signing.key"
    secret.write_text("not a real key\n")
    emitter = Emitter(RUN, settings=settings)
    emitter.emit_checkpoint(1, _write(tmp_path / "s1.safetensors", 1))

    # rq's own API, as anyone with Redis write access could use it.
    hostile: dict[str, str] = {}  # job id -> what its refusal must say
    markers: list[Path] = []
    host_queue = queues.diff_host_queue(HOST)
    for name in (queues.DIFF_QUEUE, queues.COMPACT_QUEUE, host_queue):
        q = Queue(name, connection=r, serializer=JSONSerializer)
        tag = name.replace(":", "-")
        ran, stolen = tmp_path / f"ran-{tag}", tmp_path / f"stolen-{tag}"
        markers += [ran, stolen]
        hostile[q.enqueue("os.system", f"touch {ran}").id] = "'os.system' is not a deltasync job"
        copy = q.enqueue("shutil.copyfile", str(secret), str(stolen))
        hostile[copy.id] = "'shutil.copyfile' is not a deltasync job"
    # deltasync's own functions, but on a queue that does not carry them, or with a
    # callback rq would import.
    diff = Queue(queues.DIFF_QUEUE, connection=r, serializer=JSONSerializer)
    wrong = diff.enqueue(queues.COMPACT_JOB, run=RUN, version=1)
    hostile[wrong.id] = f"'{queues.COMPACT_JOB}' is not a deltasync job of queue deltasync:diff"
    compact = Queue(queues.COMPACT_QUEUE, connection=r, serializer=JSONSerializer)
    hooked = compact.enqueue(queues.COMPACT_JOB, run=RUN, on_success=Callback("os.system"))
    hostile[hooked.id] = "with callbacks or webhooks (success)"
    unfit = compact.enqueue(queues.COMPACT_JOB, run=RUN, command="rm -rf /")
    hostile[unfit.id] = "arguments do not fit"

    with processes(
        env, tmp_path / "logs", diff=["worker", "diff"], compact=["worker", "compact"]
    ) as procs:

        def settled() -> bool:
            for job_id in hostile:
                status = Job.fetch(job_id, connection=r, serializer=JSONSerializer).get_status()
                if status not in (JobStatus.FAILED, JobStatus.FINISHED):
                    return False
            return True

        wait_for(settled, "the hostile jobs taken by the workers")
        for marker in markers:
            assert not marker.exists(), f"a hostile job ran: {marker}"
        for job_id, why in hostile.items():
            job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
            assert job.get_status() == JobStatus.FAILED, job_id
            q = Queue(job.origin, connection=r, serializer=JSONSerializer)
            assert job_id in q.failed_job_registry.get_job_ids(), job_id
            result = job.latest_result()
            assert result is not None and why in str(result.exc_string), result
            assert "\n" not in str(result.exc_string).strip()

        # Recorded once each, announced on the run's stream, shown by status and tail.
        assert r.xlen(refused_jobs_key()) == len(hostile)
        report = json.loads(cli(env, "status", "--run", RUN, "--json").stdout)
        assert report["refused_jobs"]["count"] == len(hostile)
        shown = cli(env, "status", "--run", RUN)
        assert shown.returncode == 0, shown.stderr
        assert f"{len(hostile)} job(s) refused" in shown.stdout
        assert "'shutil.copyfile' is not a deltasync job" in shown.stdout
        tail = cli(env, "tail", "--run", RUN, "--type", "job-refused", "--json")
        assert tail.returncode == 0, tail.stderr
        events = [json.loads(line) for line in tail.stdout.splitlines()]
        assert {e["job_id"] for e in events} == set(hostile)
        assert {e["function"] for e in events} >= {"os.system", "shutil.copyfile"}

        # The workers go on: the next step publishes, a compaction anchors it.
        emitter.emit_checkpoint(2, _write(tmp_path / "s2.safetensors", 2))
        wait_for(lambda: store.exists(manifest_key(RUN, "delta", 2)), "step 2 published")
        done = cli(env, "compact", "--run", RUN, "--version", "2", "--wait", "--timeout", "240")
        assert done.returncode == 0, done.stdout + done.stderr
        assert store.exists(manifest_key(RUN, "anchor", 2))
        assert procs["diff"].poll() is None and procs["compact"].poll() is None
    for marker in markers:
        assert not marker.exists(), marker


def test_what_each_queue_may_carry(redis_url: str) -> None:
    """The allowlist per queue, and what a job of deltasync's own must not carry."""
    r = redis_client(redis_url)
    args = {"run": RUN, "step": 1, "checkpoint": "/x"}
    part = {**args, "part": "p0", "parent_version": 0}
    host_queue = queues.diff_host_queue(HOST)

    def refusal(name: str, function: str, *a: object, **kw: Any) -> str | None:
        job = Queue(name, connection=r, serializer=JSONSerializer).enqueue(function, *a, **kw)
        fetched = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
        return queues.refusal(fetched, name)

    assert refusal(queues.DIFF_QUEUE, queues.DIFF_JOB, **args) is None
    assert refusal(host_queue, queues.DIFF_PART_JOB, **part) is None
    # Part jobs are a sharded step's, on its hosts' queues only.
    assert refusal(queues.DIFF_QUEUE, queues.DIFF_PART_JOB, **part) == (
        f"function {queues.DIFF_PART_JOB!r} is not a deltasync job of queue deltasync:diff"
    )
    assert refusal(queues.COMPACT_QUEUE, queues.COMPACT_JOB, run=RUN, version=3) is None
    assert "of queue deltasync:diff:host:h1" in str(refusal(host_queue, queues.DIFF_JOB, **args))
    assert "not a deltasync job" in str(refusal("deltasync:other", queues.DIFF_JOB, **args))
    assert "do not fit" in str(refusal(queues.DIFF_QUEUE, queues.DIFF_JOB, 1, 2, 3, 4, 5, 6, 7, 8))
    hook = Webhook("http://attacker.invalid/", "failed")
    assert "webhooks" in str(refusal(queues.DIFF_QUEUE, queues.DIFF_JOB, webhooks=[hook], **args))
    # A job whose stored data is not JSON (a pickle, say) is refused unread.
    job = Queue(queues.DIFF_QUEUE, connection=r, serializer=JSONSerializer).enqueue(
        queues.DIFF_JOB, **args
    )
    r.hset(job.key, "data", zlib.compress(b"\x80\x04\x95pickle"))
    fetched = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
    assert queues.refusal(fetched, queues.DIFF_QUEUE) == "job data is not JSON"
    # And the workers' job class resolves no other function, wherever rq asks.
    other = Queue(queues.DIFF_QUEUE, connection=r, serializer=JSONSerializer).enqueue("os.getcwd")
    with pytest.raises(queues.RefusedJobError):
        _ = queues.DeltasyncJob.fetch(other.id, connection=r, serializer=JSONSerializer).func
