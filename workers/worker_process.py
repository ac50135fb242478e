"""rq worker processes for the diff and compaction queues."""

from __future__ import annotations

from rq import SimpleWorker
from rq.serializers import JSONSerializer

from pipeline.logs import get_logger
from workers import queues
from workers.metrics_http import serve_metrics
from workers.runtime import Runtime

log = get_logger(__name__)

QUEUES = {"diff": queues.DIFF_QUEUE, "compact": queues.COMPACT_QUEUE}
MAINTENANCE_INTERVAL_S = 60


def run_worker(
    runtime: Runtime, kind: str, *, burst: bool = False, name: str | None = None
) -> bool:
    """Work jobs of one kind until stopped (or, with ``burst``, until the queue is empty).

    SimpleWorker runs each job in this process: forking after torch has started
    its thread pools is unsafe, and the diff cache stays warm between jobs.
    """
    connection = runtime.redis
    worker = SimpleWorker(
        [queues.queue(connection, QUEUES[kind])],
        name=name,
        connection=connection,
        serializer=JSONSerializer,
        # rq's default is 10 min: a restarted worker would wait that long to take over
        # the scheduler lock of a killed one, and retries of its job with it.
        maintenance_interval=MAINTENANCE_INTERVAL_S,
    )
    log.info(
        "worker starting",
        kind=kind,
        queue=QUEUES[kind],
        store=runtime.settings.store_url,
        redis=runtime.redis_url_redacted,
        burst=burst,
        signed=runtime.settings.signing_key_path is not None,
    )
    if runtime.settings.signing_key_path is None:
        log.warning("versions are unsigned: set DELTASYNC_SIGNING_KEY to sign manifests")
    serve_metrics(runtime.settings.metrics_port, queues_of=connection)
    worked: bool = worker.work(burst=burst, with_scheduler=True, logging_level=None)
    return worked
