"""A rollout node that cannot bootstrap shows in `deltasync status`, with its last error
and since when, although it never held a version (so it sends no heartbeat); it
leaves the list once it syncs. Real redis-server, real `deltasync` processes."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.coord.connection import redis_client
from pipeline.coord.problems import clear_failure, list_failing, report_failure
from pipeline.store.file import FileStore
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from tests.rollout.test_rollout_process import RUN, publish_versions

pytestmark = pytest.mark.slow


def _status(env: dict[str, str]) -> dict[str, object]:
    done = cli(env, "status", "--run", RUN, "--json")
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout[done.stdout.index("{") :])
    return report


def test_a_node_that_cannot_bootstrap_is_listed_with_its_error(
    redis_url: str, tmp_path: Path
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    publish_versions(FileStore(tmp_path / "store"), tmp_path / "trainer", 2)
    # Weights of another model: the run's tensors are not there, every sync fails.
    wrong = tmp_path / "other-model.safetensors"
    save_file({"some.other.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}, str(wrong))
    node = ["rollout", "--run", RUN, "--node-id", "bad-node", "--model", str(wrong),
            "--poll", "0.2"]  # fmt: skip
    with processes(env, tmp_path / "logs", node=node):

        def failing() -> list[dict[str, object]]:
            listed = _status(env).get("failing")
            assert isinstance(listed, list)
            return listed

        wait_for(lambda: any(f["node"] == "bad-node" for f in failing()), "the failing node")
        report = _status(env)
        assert report["replicas"] == []  # no heartbeat: it holds no version
        (entry,) = failing()
        assert entry["held"] is None
        error = str(entry["error"])
        assert error.startswith(("MismatchError: ", "TargetError: ", "ChainError: ")), error
        assert "\n" not in error
        since = datetime.fromisoformat(str(entry["since"]))
        assert since.tzinfo is not None
        assert float(str(entry["failing_for_s"])) >= 0.0
        assert int(str(entry["failures"])) >= 1
        text = cli(env, "status", "--run", RUN)
        assert text.returncode == 0, text.stderr
        assert "failing replicas" in text.stdout and "bad-node" in text.stdout
        assert error.split(":", maxsplit=1)[0] in text.stdout
    # The same node, now given nothing to start from: it bootstraps and is fine.
    done = cli(env, "rollout", "--run", RUN, "--node-id", "bad-node", "--until", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    report = _status(env)
    assert report["failing"] == []
    # It reached v1 (--until) and, stopping, took its heartbeat along.
    assert report["replicas"] == []


def test_failure_records_keep_since_and_go_at_the_next_sync(redis_url: str) -> None:
    client = redis_client(redis_url)
    try:
        report_failure(client, "runf", "n1", None, "TargetError: first")
        (first,) = list_failing(client, "runf")
        report_failure(client, "runf", "n1", 3, "TargetError: second")
        (second,) = list_failing(client, "runf")
        assert second.since == first.since  # the streak started with the first failure
        assert (second.held, second.error, second.failures) == (3, "TargetError: second", 2)
        clear_failure(client, "runf", "n1")
        assert list_failing(client, "runf") == []
        report_failure(client, "runf", "n2", None, "X: y", ttl_s=0.001)
        wait_for(lambda: list_failing(client, "runf") == [], "the record to expire")
    finally:
        client.close()
