"""The rq worker process: each job starts with no log context from the job before it,
and a stop does not wait out rq's 60 s poll of the worker's command channel."""

from __future__ import annotations

import structlog
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.coord.connection import redis_client
from pipeline.logs import bind_context
from workers.worker_process import COMMAND_POLL_S, JobWorker


def bind_and_return(run: str) -> str:
    bind_context(run=run, version=7)
    return run


def context_now() -> dict[str, object]:
    return dict(structlog.contextvars.get_contextvars())


def test_log_context_does_not_leak_from_one_job_to_the_next(redis_url: str) -> None:
    connection = redis_client(redis_url)
    queue = Queue("deltasync:test-context", connection=connection, serializer=JSONSerializer)
    first = queue.enqueue(bind_and_return, "run-a")
    second = queue.enqueue(context_now)
    worker = JobWorker([queue], connection=connection, serializer=JSONSerializer)
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
