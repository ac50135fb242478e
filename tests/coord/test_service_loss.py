"""Losing a service mid-run, with real processes: Redis restarted without persistence,
the S3 server stopped during a publish, the event stream trimmed below a node's
position. Every node reaches the head, every version stays exact, and work in flight
is retried with backoff until the service is back."""

from __future__ import annotations

from pathlib import Path

import pytest
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pipeline.coord.events import ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import content_hash
from pipeline.testing.synthetic import save_state
from tests.pipeline_helpers import wait_for
from tests.servers import SeaweedS3Server
from tests.workers.test_faults_workers import Cluster, Outcome, assert_rebuilds, cluster
from workers import queues

pytestmark = [pytest.mark.slow, pytest.mark.redis]  # each test starts its own redis-server


def _dump_matches(dump: Path, c: Cluster, version: int) -> None:
    with CheckpointReader(dump) as reader:
        got = {n: content_hash(reader.get(n)) for n in reader.names()}
    assert got == {n: content_hash(t) for n, t in c.states[version].items()}


def _stream_bytes(c: Cluster) -> bytes:
    return repr(c.redis.xrange(EventStream(c.redis, c.run).key)).encode()


def redis_restart_scenario(tmp: Path, restarts: int = 1, steps_between: int = 2) -> Outcome:
    """Workers and a node run; Redis is restarted (everything in it lost) between steps."""
    outcome = Outcome()
    last = steps_between * (restarts + 1) - 1
    with cluster(tmp) as c:
        c.procs.start("diff", "worker", "diff")
        dump = tmp / "node.safetensors"
        node = c.procs.start(
            "node", "rollout", "--run", c.run, "--wait", "--node-id", "n1", "--poll", "0.5",
            "--until", str(last), "--dump", str(dump),
        )  # fmt: skip
        for round_ in range(restarts + 1):
            for _ in range(steps_between):
                step = c.emit()
            wait_for(lambda s=step: c.head() == s, f"step {step}")
            if round_ < restarts:
                c.redis_server.restart()  # no persistence: queues, stream, keys all gone
                outcome.runs += 1
        assert node.wait(timeout=240) == 0, c.procs.logs()[-3000:]
        _dump_matches(dump, c, last)
        c.check_versions(set(range(last + 1)), lossy_events=True)
        outcome.recovered += restarts
    return outcome


def s3_outage_scenario(tmp: Path, s3: SeaweedS3Server, s3_url: str) -> Outcome:
    """The S3 server is down when a diff job runs: the job fails, rq retries it with
    backoff (the worker's scheduler), and it publishes once the server is back."""
    with cluster(tmp, DELTASYNC_STORE=s3_url, DELTASYNC_S3_MAX_ATTEMPTS="1") as c:
        c.procs.start("diff", "worker", "diff")
        first = c.emit()
        wait_for(lambda: c.head() == first, "the first version")
        step, state = c.next_state()
        staged = tmp / "staged" / f"{step}.safetensors"
        staged.parent.mkdir()
        save_state(state, staged)
        s3.stop()
        try:
            # What the trainer's emit does, less its look at the store's head.
            job_id = queues.enqueue_diff(
                c.redis, queues.DiffArgs(c.run, step, str(staged), owned=False)
            )

            def retrying() -> bool:
                job = Job.fetch(job_id, connection=c.redis, serializer=JSONSerializer)
                return job.get_status(refresh=True) == JobStatus.SCHEDULED

            wait_for(retrying, "the failed job to be scheduled for a retry")
        finally:
            s3.start()
        wait_for(lambda: c.head() == step, f"step {step} after the outage")
        job = Job.fetch(job_id, connection=c.redis, serializer=JSONSerializer)
        assert job.retries_left is not None and job.retries_left < queues.JOB_RETRY.max
        c.check_versions({first, step})
    return Outcome(runs=1, recovered=1)


def trimmed_stream_scenario(tmp: Path) -> Outcome:
    """A node that only hears events (its poll is slow) finds the stream trimmed past
    its position and syncs from the store."""
    with cluster(tmp) as c:
        c.publish_here()
        node_log = c.procs.log_dir / "node.log"
        dump = tmp / "node.safetensors"
        node = c.procs.start(
            "node", "rollout", "--run", c.run, "--node-id", "n1", "--poll", "600",
            "--until", "3", "--dump", str(dump),
        )  # fmt: skip
        wait_for(lambda: b'"delta-applied"' in _stream_bytes(c), "the node's bootstrap")
        for _ in range(3):
            c.publish_here()  # published without events
        stream = EventStream(c.redis, c.run)
        # The node's position is trimmed away: only newer, unrelated entries remain.
        with c.redis.pipeline(transaction=True) as pipe:  # the node cannot read between
            for i in range(5):  # unrelated events; then the stream is cut to the last two
                noise = ReplicaError.now(
                    run=c.run, version=0, node=f"other-{i}", error="x", recovering=True
                )
                stream.publish(noise, pipeline=pipe)
            pipe.xtrim(stream.key, maxlen=2, approximate=False)
            pipe.execute()
        assert node.wait(timeout=240) == 0, c.procs.logs()[-3000:]
        assert b"trimmed past our position" in node_log.read_bytes()
        _dump_matches(dump, c, 3)
        for v in range(4):
            assert_rebuilds(c.store, c.run, v, c.states[v])
    return Outcome(runs=1, recovered=1)


def test_redis_restart_without_persistence(tmp_path: Path) -> None:
    assert redis_restart_scenario(tmp_path).recovered == 1


def test_s3_server_down_during_a_publish(
    tmp_path: Path, s3_server: SeaweedS3Server, s3_url: str
) -> None:
    assert s3_outage_scenario(tmp_path, s3_server, s3_url).recovered == 1


def test_stream_trimmed_below_a_node(tmp_path: Path) -> None:
    assert trimmed_stream_scenario(tmp_path).recovered == 1
