"""rq worker processes for the diff and compaction queues."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from rq import SimpleWorker
from rq.serializers import JSONSerializer

from pipeline.format.hashes.scrub import ScrubPace
from pipeline.logs import clear_context, get_logger
from pipeline.publish.cache_scrub import CacheScrubber
from workers import queues
from workers.metrics_http import serve_metrics
from workers.runtime import Runtime

if TYPE_CHECKING:
    from rq.executions import Execution
    from rq.job import Job
    from rq.queue import Queue

log = get_logger(__name__)

QUEUES = {"diff": queues.DIFF_QUEUE, "compact": queues.COMPACT_QUEUE}
MAINTENANCE_INTERVAL_S = 60
# How long the thread reading rq's command channel waits per poll. rq polls 60 s;
# redis-py joins that thread without a timeout when rq unsubscribes, and a thread that
# has read the unsubscribe reply first waits out its whole poll: a worker sent SIGTERM
# after jobs took up to a minute to exit (compose.yaml's grace is 60 s, then SIGKILL).
COMMAND_POLL_S = 1.0
JOB_RUNNING = threading.Event()  # set while this process performs a job


class JobWorker(SimpleWorker):  # type: ignore[misc]
    """A SimpleWorker whose jobs start and end with no log context left by the last one."""

    def subscribe(self) -> None:
        """rq's subscription to this worker's command channel, polled every
        COMMAND_POLL_S instead of 60 s, so that a stop waits at most that long."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]  # rq: None
            sleep_time=COMMAND_POLL_S,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        clear_context()
        JOB_RUNNING.set()
        try:
            return bool(super().perform_job(job, queue, execution))
        finally:
            JOB_RUNNING.clear()
            clear_context()


def start_cache_scrub(runtime: Runtime) -> CacheScrubber | None:
    """The diff worker's background scrub of its state caches, at the rollout nodes'
    pace (``DELTASYNC_SCRUB_MINUTES``, 0: off; ``DELTASYNC_SCRUB_CPU``), yielding to
    this process's jobs."""
    settings = runtime.settings
    if settings.scrub_minutes <= 0:
        return None
    return CacheScrubber(
        settings.cache_dir,
        runtime.store,
        ScrubPace(settings.scrub_minutes * 60, settings.scrub_cpu),
        redis_client=runtime.redis,
        busy=JOB_RUNNING.is_set,
    ).start()


def run_worker(
    runtime: Runtime,
    kind: str,
    *,
    burst: bool = False,
    name: str | None = None,
    host_only: bool = False,
) -> bool:
    """Work jobs of one kind until stopped (or, with ``burst``, until the queue is empty).
    ``host_only``: a diff worker takes its trainer host's part jobs only.

    SimpleWorker runs each job in this process: forking after torch has started
    its thread pools is unsafe, and the diff cache stays warm between jobs.
    """
    connection = runtime.redis
    names = queues.diff_queues(runtime.settings.diff_host) if kind == "diff" else [QUEUES[kind]]
    if host_only and kind == "diff" and runtime.settings.diff_host is not None:
        names = [queues.diff_host_queue(runtime.settings.diff_host)]
    worker = JobWorker(
        [queues.queue(connection, name) for name in names],
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
        queue=", ".join(names),
        store=runtime.settings.store_url,
        redis=runtime.redis_url_redacted,
        burst=burst,
        signed=runtime.settings.signing_key_path is not None,
    )
    if runtime.settings.signing_key_path is None:
        log.warning("versions are unsigned: set DELTASYNC_SIGNING_KEY to sign manifests")
    serve_metrics(runtime.settings.metrics_port, queues_of=connection)
    scrubber = start_cache_scrub(runtime) if kind == "diff" and not burst else None
    try:
        worked: bool = worker.work(burst=burst, with_scheduler=True, logging_level=None)
    finally:
        if scrubber is not None:
            scrubber.stop()
    return worked
