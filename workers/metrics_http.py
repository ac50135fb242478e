"""``/metrics`` for workers and rollout nodes (the metrics are in pipeline/metrics.py).

``DELTASYNC_METRICS_PORT`` (0: off) starts prometheus_client's HTTP server on a daemon
thread of the process. Workers add the depth of the rq queues, read from Redis at
each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import redis
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.logs import get_logger
from workers import queues

log = get_logger(__name__)

_serving: int | None = None


class QueueDepth(Collector):
    """Jobs waiting in, and failed out of, the diff and compaction queues."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from rq.registry import FailedJobRegistry
        from rq.serializers import JSONSerializer

        depth = GaugeMetricFamily(
            "deltasync_queue_depth", "Jobs waiting in an rq queue.", labels=["queue"]
        )
        failed = GaugeMetricFamily(
            "deltasync_queue_failed_jobs",
            "Jobs in an rq queue's failed registry.",
            labels=["queue"],
        )
        try:
            for name in (queues.DIFF_QUEUE, queues.COMPACT_QUEUE):
                q = queues.queue(self.client, name)
                depth.add_metric([name], q.count)
                registry = FailedJobRegistry(queue=q, serializer=JSONSerializer)
                failed.add_metric([name], registry.count)
        except (redis.RedisError, OSError) as exc:
            log.warning("queue depth unavailable", error=str(exc))
            return
        yield depth
        yield failed


def serve_metrics(port: int, *, queues_of: redis.Redis | None = None) -> int | None:
    """Serve /metrics on ``port`` (all interfaces) unless ``port`` is 0; once per process.
    Returns the port served."""
    global _serving
    if port == 0 or _serving is not None:
        return _serving
    try:
        start_http_server(port, addr="0.0.0.0")
    except OSError as exc:
        # Several workers on one host with one port setting: the first serves, the rest
        # work on without an endpoint rather than fail.
        log.warning("metrics not served", port=port, error=str(exc))
        return None
    if queues_of is not None:
        REGISTRY.register(QueueDepth(queues_of))
    _serving = port
    log.info("metrics served", port=port, path="/metrics")
    return port


def since_step_s(client: redis.Redis, run: str, step: int) -> float | None:
    """Seconds since ``step`` was emitted: its diff job was enqueued in the same Redis
    transaction as its ``step-completed``. None when the job is gone."""
    from rq.exceptions import NoSuchJobError
    from rq.job import Job
    from rq.serializers import JSONSerializer

    try:
        job = Job.fetch(queues.diff_job_id(run, step), connection=client, serializer=JSONSerializer)
    except (NoSuchJobError, redis.RedisError):
        return None
    enqueued = job.enqueued_at
    if enqueued is None:
        return None
    if enqueued.tzinfo is None:  # rq keeps UTC
        enqueued = enqueued.replace(tzinfo=UTC)
    return max(0.0, (datetime.now(UTC) - enqueued).total_seconds())
