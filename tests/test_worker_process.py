"""The rq worker process: each job starts with no log context from the job before it."""

from __future__ import annotations

import structlog
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.coord.connection import redis_client
from pipeline.logs import bind_context
from workers.worker_process import JobWorker


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
