"""Crash tests of a rollout node process: SIGKILLed mid-bootstrap, mid-download,
mid-write and between an apply and its state file, and at random moments. After a
restart it converges to the head bit-exactly (checked on the hashes of its dump), and
a restart from its own earlier dump resumes only where the weights prove the version.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.content_hashes import XXH3
from pipeline.format.hashes.hashing import content_hash
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from tests.pipeline_helpers import REPO
from tests.servers import RedisServer
from tests.workers.test_faults_workers import Outcome

pytestmark = pytest.mark.slow

RUN = "nodefaults"
PART_BYTES = 1 << 20
VERSIONS = 6
ROLLOUT_POINTS = (
    "rollout.mid_bootstrap@3",
    "rollout.mid_fetch@2",
    "target.mid_write@2",
    "rollout.after_apply@2",
)


@dataclass
class PublishedRun:
    store: FileStore
    states: dict[int, dict[str, torch.Tensor]]

    @property
    def head(self) -> int:
        return max(self.states)


def publish_run(
    tmp: Path, versions: int = VERSIONS, content_hash: str | None = None
) -> PublishedRun:
    store = FileStore(tmp / "store")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=5)
    cache = StateCache(tmp / "trainer-cache", RUN)
    states: dict[int, dict[str, torch.Tensor]] = {}
    state = generator.state()
    for step in range(versions):
        if step:
            state = generator.step()
        path = tmp / "trainer" / f"{step}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_state(state, path)
        publish_step(
            store,
            RUN,
            step,
            path,
            cache,
            PublishOptions(part_bytes=PART_BYTES, content_hash=content_hash),
        )
        states[step] = {n: t.clone() for n, t in state.items()}
    return PublishedRun(store, states)


def node(
    home: Path,
    run: PublishedRun,
    redis_url: str,
    *args: str,
    fault: str | None = None,
    settings: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {
        **(settings or {}),
        "PATH": "/usr/bin:/bin",
        "DELTASYNC_HOME": str(home),
        "DELTASYNC_STORE": run.store.url,
        "DELTASYNC_REDIS_URL": redis_url,
        "DELTASYNC_LOG_JSON": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    if fault is not None:
        env["DELTASYNC_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "workers", "rollout", "--run", RUN, "--node-id", "crashy",
         "--poll", "0.2", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def events_of(done: subprocess.CompletedProcess[str]) -> list[str]:
    out = []
    for line in done.stderr.splitlines():
        if line.startswith("{"):
            out.append(str(json.loads(line).get("event")))
    return out


def dump_hashes(path: Path) -> dict[str, str]:
    with CheckpointReader(path) as reader:
        return {name: content_hash(reader.get(name)) for name in reader.names()}


def state_hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: content_hash(t) for name, t in state.items()}


def converge(
    home: Path,
    run: PublishedRun,
    redis_url: str,
    dump: Path,
    *args: str,
    settings: dict[str, str] | None = None,
) -> list[str]:
    """Restart the node clean; it must reach the head and hold exactly its weights."""
    done = node(
        home, run, redis_url, "--until", str(run.head), "--dump", str(dump), *args,
        settings=settings,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert dump_hashes(dump) == state_hashes(run.states[run.head]), "dump is not the head"
    return events_of(done)


def rollout_crash_scenario(
    tmp: Path,
    redis_url: str,
    points: tuple[str, ...],
    settings: dict[str, str] | None = None,
    content_hash: str | None = None,
) -> Outcome:
    """``settings``: extra DELTASYNC_* variables for the node (crashed and restarted);
    ``content_hash``: the run's (default: a new run's)."""
    run = publish_run(tmp, content_hash=content_hash)
    outcome = Outcome()
    for i, fault in enumerate(points):
        home = tmp / f"node-{i}"
        crashed = node(
            home, run, redis_url, "--until", str(run.head), fault=fault, settings=settings
        )
        assert crashed.returncode == -signal.SIGKILL, (fault, crashed.stderr[-2000:])
        converge(home, run, redis_url, tmp / f"dump-{i}.safetensors", settings=settings)
        outcome.runs += 1
        outcome.recovered += 1
    return outcome


def resume_crash_scenario(tmp: Path, redis_url: str) -> Outcome:
    """A node restarted from its own dump of v2 dies mid-write of v3; restarted from the
    same dump it resumes (the weights prove v2, whatever the state file says) and
    reaches the head."""
    run = publish_run(tmp, versions=3)
    home = tmp / "node"
    first = tmp / "v2.safetensors"
    done = node(home, run, redis_url, "--until", "2", "--dump", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    assert dump_hashes(first) == state_hashes(run.states[2])
    run = publish_run(tmp)  # the trainer goes on (same seed: the same states)
    crashed = node(home, run, redis_url, "--model", str(first), "--until", str(run.head),
                   fault="target.mid_write@2")  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    events = converge(home, run, redis_url, tmp / "final.safetensors", "--model", str(first))
    assert "resumed" in events and "bootstrapping" not in events, events
    # A dump that is not what the state file names is never resumed from.
    stale = tmp / "v0.safetensors"
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    write_checkpoint(stale, run.states[0].items())
    events = converge(home, run, redis_url, tmp / "final2.safetensors", "--model", str(stale))
    assert "resumed" not in events and "bootstrapping" in events, events
    return Outcome(runs=1, recovered=1)


def random_node_kill_scenario(tmp: Path, redis_url: str, kills: int, seed: int) -> Outcome:
    run = publish_run(tmp)
    rng = random.Random(seed)
    outcome = Outcome()
    home = tmp / "node"
    for i in range(kills):
        env_home = home
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "rollout", "--run", RUN, "--node-id", "crashy",
             "--poll", "0.2", "--until", str(run.head)],
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "DELTASYNC_HOME": str(env_home),
                 "DELTASYNC_STORE": run.store.url, "DELTASYNC_REDIS_URL": redis_url,
                 "DELTASYNC_LOG_JSON": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(rng.uniform(1.0, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        converge(home, run, redis_url, tmp / f"dump-{i}.safetensors")
        outcome.runs += 1
        outcome.recovered += 1
    return outcome


@pytest.fixture
def redis_url(tmp_path: Path) -> object:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_node_killed_at_every_point_converges_bit_exactly(tmp_path: Path, redis_url: str) -> None:
    assert rollout_crash_scenario(tmp_path, redis_url, ROLLOUT_POINTS).recovered == len(
        ROLLOUT_POINTS
    )


def test_node_killed_mid_walked_write_converges_bit_exactly(tmp_path: Path, redis_url: str) -> None:
    """No memory for decoded patches: deltas are walked into the weights (an xxh3-128
    run: an incremental one keeps its O(changed) patches); a kill between two walked
    tensors still ends bit-exact."""
    walked = {"DELTASYNC_PATCH_MEMORY_MB": "0"}
    assert rollout_crash_scenario(
        tmp_path, redis_url, ("target.mid_walk@2",), walked, content_hash=XXH3
    ).recovered


def test_node_killed_mid_scrub_converges_bit_exactly(tmp_path: Path, redis_url: str) -> None:
    """The background scrubber re-hashing held tensors at a fast pace; the node is
    killed while a tensor is being re-hashed, restarted, and reaches the head."""
    run = publish_run(tmp_path)
    home = tmp_path / "node"
    scrub = {"DELTASYNC_SCRUB_MINUTES": "0.001", "DELTASYNC_SCRUB_CPU": "1"}
    # Following past the head: it runs until the scrubber's fault kills it.
    crashed = node(
        home, run, redis_url, "--until", str(run.head + 1), fault="target.mid_scrub@2",
        settings=scrub,
    )  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    converge(home, run, redis_url, tmp_path / "dump.safetensors", settings=scrub)


def test_node_killed_mid_write_resumes_from_its_dump(tmp_path: Path, redis_url: str) -> None:
    assert resume_crash_scenario(tmp_path, redis_url).recovered == 1


def test_node_killed_at_random_moments(tmp_path: Path, redis_url: str) -> None:
    assert random_node_kill_scenario(tmp_path, redis_url, kills=2, seed=99).recovered == 2
