"""One diff path: a version's parts are encoded by one diff job, or for a sharded step
by the diff workers of the trainer hosts that hold them, whose part jobs go to their
host's queue only (the shared diff queue carries diff jobs).
"""

from __future__ import annotations

import pytest

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.errors import ConfigError
from workers import queues

RUN = "one-path"


def test_part_jobs_go_to_their_hosts_queue(redis_url: str) -> None:
    r = redis_client(redis_url)
    routed = queues.enqueue_diff_part(r, RUN, 5, "/x", "part-r00000-00000.safetensors", 4, "h1")
    again = queues.enqueue_diff_part(
        r, RUN, 5, "/x", "part-r00000-00000.safetensors", 4, "h1", again=True
    )
    assert queues.queue(r, queues.diff_host_queue("h1")).job_ids == [again, routed]
    assert queues.queue(r, queues.DIFF_QUEUE).job_ids == []
    assert queues.diff_queues("h1") == [queues.diff_host_queue("h1"), queues.DIFF_QUEUE]
    assert queues.diff_queues(None) == [queues.DIFF_QUEUE]
    assert Settings.from_env({"DELTASYNC_DIFF_HOST": "trainer-3"}).diff_host == "trainer-3"
    assert Settings.from_env({}).diff_host is None
    with pytest.raises(ConfigError, match="DELTASYNC_DIFF_HOST"):
        Settings.from_env({"DELTASYNC_DIFF_HOST": "a/b"})
