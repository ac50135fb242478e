"""The rq worker process: each job starts with no log context from the job before it,
a stop does not wait out rq's 60 s poll of the worker's command channel, and rq's
scheduler runs on a thread, never a forked child."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import structlog
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pipeline.coord.connection import redis_client
from pipeline.coord.replicas import process_token
from pipeline.logs import bind_context
from pipeline.publish.caches.state_cache import StateCache, flock
from workers.worker_process import COMMAND_POLL_S, JobWorker


def bind_and_return(run: str) -> str:
    bind_context(run=run, version=7)
    return run


def context_now() -> dict[str, object]:
    return dict(structlog.contextvars.get_contextvars())


class ContextWorker(JobWorker):
    """A JobWorker that runs this module's two jobs, which its own check refuses (they
    are not deltasync's): what is tested here is its ``perform_job``."""

    job_class = Job

    def execute_job(self, job: Job, queue: Queue) -> None:
        SimpleWorker.execute_job(self, job, queue)


def test_log_context_does_not_leak_from_one_job_to_the_next(redis_url: str) -> None:
    connection = redis_client(redis_url)
    queue = Queue("deltasync:test-context", connection=connection, serializer=JSONSerializer)
    first = queue.enqueue(bind_and_return, "run-a")
    second = queue.enqueue(context_now)
    worker = ContextWorker([queue], connection=connection, serializer=JSONSerializer)
    assert worker.work(burst=True, logging_level=None)
    assert first.return_value() == "run-a"
    assert second.return_value() == {}
    assert structlog.contextvars.get_contextvars() == {}  # nor left behind in the worker


def test_the_command_channel_is_polled_briefly_so_a_stop_is_quick(redis_url: str) -> None:
    """rq reads its command channel in a thread polling every 60 s, and redis-py joins
    that thread without a timeout when rq unsubscribes. Once the thread had read the
    unsubscribe reply it waited out its whole poll: SIGTERM after jobs took up to a
    minute (seen in about one test run in three, with both threads in py-spy). The
    worker polls every COMMAND_POLL_S instead."""
    connection = redis_client(redis_url)
    queue = Queue("deltasync:test-stop", connection=connection, serializer=JSONSerializer)
    worker = JobWorker([queue], connection=connection, serializer=JSONSerializer)
    worker.subscribe()
    thread = worker.pubsub_thread
    assert thread is not None and thread.is_alive()
    assert thread.sleep_time == COMMAND_POLL_S <= 2
    worker.unsubscribe()
    assert not thread.is_alive()


def _children() -> set[int]:
    """Processes whose parent is this one."""
    me, out = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(stat.parent.name))
    return out


def test_the_scheduler_runs_on_a_thread_and_keeps_no_copy_of_a_state_cache_lock(
    redis_url: str, tmp_path: Path
) -> None:
    """rq forks its scheduler. A child forked while the cache scrub's thread held its
    shared lock on a state cache kept that lock for good (flock belongs to the open file,
    and the child held a copy): the next diff job waited forever for the exclusive lock,
    under a diff lease it kept renewing, and the run stopped publishing (the compose
    run's diff workers, once one was killed and the other took the scheduler over)."""
    connection = redis_client(redis_url)
    queue = Queue("deltasync:test-scheduler", connection=connection, serializer=JSONSerializer)
    lock = tmp_path / "cache" / "run" / StateCache.LOCK
    holding, release = threading.Event(), threading.Event()

    def scrub() -> None:  # as the scrub holds a tensor's shared lock
        with flock(lock, exclusive=False, wait=False):
            holding.set()
            release.wait(30)

    scrubber = threading.Thread(target=scrub)
    scrubber.start()
    assert holding.wait(30)
    before = _children()
    worker = JobWorker([queue], connection=connection, serializer=JSONSerializer)
    worker._start_scheduler()
    try:
        scheduler = worker.scheduler
        assert scheduler is not None and scheduler.acquired_locks == {queue.name}
        assert isinstance(scheduler._process, threading.Thread)
        assert scheduler._process.is_alive()
        assert _children() == before, "the scheduler was forked"
        release.set()
        scrubber.join()
        with flock(lock, exclusive=True, wait=False):  # CacheBusyError while a copy holds it
            pass

        # And it schedules: a job due in a second is moved to its queue by the thread.
        job = queue.enqueue_in(timedelta(seconds=1), "workers.queues.diff_job_id", "r", 3)
        deadline = time.monotonic() + 30
        while job.get_status(refresh=True) != JobStatus.QUEUED and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.get_status(refresh=True) == JobStatus.QUEUED
        assert queue.get_job_ids() == [job.id]
    finally:
        release.set()
        worker.stop_scheduler()
    assert not scheduler._process.is_alive()
    assert not connection.exists(scheduler.get_locking_key(queue.name)), "lock kept after stop"


def test_a_scheduler_lock_left_by_a_dead_worker_of_this_machine_is_taken_at_once(
    redis_url: str,
) -> None:
    """The killed worker's scheduler died with it (a thread): its lock would hold up
    delayed retries for a minute. A worker of the same machine takes it at once; a live
    holder's lock stays its own."""
    connection = redis_client(redis_url)
    queue = Queue("deltasync:test-takeover", connection=connection, serializer=JSONSerializer)
    key = f"rq:scheduler-lock:{queue.name}"
    token = "from pipeline.coord.replicas import process_token; print(process_token())"
    made = subprocess.run([sys.executable, "-c", token], capture_output=True, text=True, check=True)
    gone = made.stdout.strip()  # that process has exited
    alive = process_token()  # this process: alive
    for holder, taken in ((alive, False), (gone, True)):
        connection.set(key, holder, ex=60)
        worker = JobWorker([queue], connection=connection, serializer=JSONSerializer)
        worker._start_scheduler()
        try:
            scheduler = worker.scheduler
            assert scheduler is not None
            assert (scheduler.acquired_locks == {queue.name}) is taken, holder
            owner = connection.get(key)
            assert owner is not None and owner.decode() == (scheduler.name if taken else holder)
        finally:
            worker.stop_scheduler()
    assert not connection.exists(key)
