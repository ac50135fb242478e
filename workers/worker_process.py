"""rq worker processes for the diff and compaction queues."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from rq import SimpleWorker
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import DeserializationError
from rq.job import JobStatus
from rq.results import Result
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.utils import now

from pipeline import config
from pipeline.coord.problems import report_refused_job
from pipeline.coord.replicas import process_token, release_dead_holder
from pipeline.errors import DeltasyncError
from pipeline.format.hashes.scrub import ScrubPace
from pipeline.logs import clear_context, get_logger
from pipeline.publish.caches.cache_scrub import CacheScrubber
from workers import queues, warm
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
SCHEDULER_STOP_S = 10.0  # a stopping worker waits this long for its scheduler thread


class ThreadScheduler(RQScheduler):  # type: ignore[misc]
    """rq's scheduler (delayed retries, scheduled jobs) on a thread of the worker.

    rq forks it into a child process. A child forked while another thread of this
    process holds a file lock keeps that lock for its whole life, since flock belongs
    to the open file and the child holds a copy: a scrub's shared lock on a state cache
    then never ends, the next diff job waits forever for the exclusive lock while its
    run's diff lease is renewed, and the run stops publishing. No fork, no such copies.

    Its name is a lock token of this process: a scheduler lock left by a worker of this
    machine that died is released at once, not a minute later, and another worker's
    scheduler takes over its delayed retries.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["name"] = process_token()
        super().__init__(*args, **kwargs)

    def acquire_locks(self, auto_start: bool = False) -> set[str]:
        for queue_name in self._queue_names:
            # Redis away: rq's own acquire below fails as rq expects, and is retried.
            with contextlib.suppress(DeltasyncError):
                release_dead_holder(self.connection, self.get_locking_key(queue_name))
        return set(super().acquire_locks(auto_start))  # type: ignore[no-untyped-call]

    def start(self) -> threading.Thread:
        self._status = self.Status.STARTED
        self._stop_requested = False
        thread = threading.Thread(target=self._run, name="rq-scheduler", daemon=True)
        self._process = thread  # type: ignore[assignment]  # rq's maintenance restarts it once dead
        thread.start()
        return thread

    def _install_signal_handlers(self) -> None:
        """Signals belong to the worker, which stops this thread (``stop_scheduler``)."""

    def _run(self) -> None:
        self.log.info("Scheduler for %s started on a thread", ", ".join(self._queue_names))
        try:
            self.work()  # type: ignore[no-untyped-call]
        except Exception:  # rq's maintenance starts another; its lock lapses meanwhile
            self.log.exception("Scheduler thread failed")


class JobWorker(SimpleWorker):  # type: ignore[misc]
    """A SimpleWorker whose jobs start and end with no log context left by the last
    one, and whose scheduler runs on a thread (:class:`ThreadScheduler`).

    Its lease is rq's ``worker_ttl`` (``DELTASYNC_WORKER_LEASE``): idle, rq renews the
    heartbeat every lease - 15 s (at least every second); busy, :meth:`_beat` renews it
    at least three times a lease. A lost Redis is retried every few seconds at most
    (rq waits up to a minute), so a restarted server is found again at once.

    It runs deltasync's jobs only: any other job is refused before rq imports or calls
    anything of it (:meth:`execute_job`)."""

    max_connection_wait_time = 5.0
    job_class = queues.DeltasyncJob

    def register_birth(self) -> None:
        super().register_birth()  # type: ignore[no-untyped-call]
        self.connection.hset(self.key, queues.LEASE_FIELD, str(self.worker_ttl))

    def _start_scheduler(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = "",
        log_format: str = "",
    ) -> None:
        self.scheduler = ThreadScheduler(
            self.queues,
            connection=self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            serializer=self.serializer,
        )
        self.scheduler.acquire_locks()
        if not self.scheduler.acquired_locks:
            return  # rq's maintenance tries again, and starts it once the lock is had
        if not burst:
            self.scheduler.start()
            return
        try:  # burst: what is due now, once
            self.scheduler.register_birth()
            self.scheduler.enqueue_scheduled_jobs()  # type: ignore[no-untyped-call]
        finally:
            self.scheduler.release_locks()  # type: ignore[no-untyped-call]
            self.scheduler.register_death()

    def stop_scheduler(self) -> None:
        scheduler = self.scheduler
        if scheduler is None:
            return
        scheduler.request_stop()  # type: ignore[no-untyped-call]
        thread = scheduler._process
        if isinstance(thread, threading.Thread) and thread.is_alive():
            thread.join(SCHEDULER_STOP_S)

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

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """A running job's lease in rq's started registry. rq's SimpleWorker gives it the
        job's timeout + 60 s (an hour for a diff job): a killed worker's job, the last
        step's when no later step publishes it first, then waited that long for its
        retry. Here a thread renews it while the job runs (``perform_job``)."""
        return config.JOB_HEARTBEAT_TTL_S

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = queues.refusal(job, queue.name)
        if reason is None:
            super().execute_job(job, queue)
        else:
            self.refuse(job, queue, reason)

    def refuse(self, job: Job, queue: Queue, reason: str) -> None:
        """Move ``job`` to the failed registry with ``reason``, unrun and never retried,
        record it (``deltasync status``) and announce it (``job-refused``)."""
        function = _func_name(job)
        log.error(
            "job refused", job_id=job.id, queue=queue.name, function=function[:300], reason=reason
        )
        with self.connection.pipeline() as pipe:
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            job.ended_at = now()
            queue.failed_job_registry.add(
                job, ttl=DEFAULT_FAILURE_TTL, exc_string=reason, pipeline=pipe
            )
            Result.create_failure(
                job, DEFAULT_FAILURE_TTL, exc_string=reason, worker_name=self.name, pipeline=pipe
            )
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.execute()
        try:
            report_refused_job(
                self.connection,
                job_id=job.id,
                queue=queue.name,
                function=function,
                reason=reason,
                worker=self.name,
            )
        except DeltasyncError as exc:  # Redis away for a moment: the job is set aside
            log.warning("refused job not recorded", job_id=job.id, error=str(exc))

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        clear_context()
        JOB_RUNNING.set()
        stop = threading.Event()
        beat = threading.Thread(
            target=self._beat, args=(job, execution, stop), name="rq-job-heartbeat", daemon=True
        )
        beat.start()
        try:
            return bool(super().perform_job(job, queue, execution))
        finally:
            stop.set()
            beat.join()
            JOB_RUNNING.clear()
            clear_context()

    def _beat(self, job: Job, execution: Execution, stop: threading.Event) -> None:
        """Renew the job's, its execution's and this worker's heartbeats until ``stop``."""
        every = min(config.JOB_HEARTBEAT_S, self.worker_ttl / 3)
        while not stop.wait(every):
            try:
                self.maintain_heartbeats(job, execution)
            except Exception as exc:  # never end the beat: Redis away for a moment, say
                log.warning("job heartbeat failed", job_id=job.id, error=str(exc))


def _func_name(job: Job) -> str:
    """The function a job names, as text (``?`` when its data is not JSON)."""
    try:
        return str(job.func_name)
    except DeserializationError:
        return "?"


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
        worker_ttl=max(2, round(runtime.settings.worker_lease_s)),
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
    for line in config.removed_settings():
        log.warning(line)
    serve_metrics(runtime.settings.metrics_port, queues_of=connection)
    if kind == "diff" and runtime.settings.warm:
        warm.in_background(runtime.settings)
    scrubber = start_cache_scrub(runtime) if kind == "diff" and not burst else None
    try:
        worked: bool = worker.work(burst=burst, with_scheduler=True, logging_level=None)
    finally:
        if scrubber is not None:
            scrubber.stop()
    return worked
