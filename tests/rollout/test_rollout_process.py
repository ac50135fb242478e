"""`deltasync rollout` as a real process: follows a run, dumps its weights, and a
restart from its own dump resumes without a bootstrap."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import RolloutOptions, Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.replicas import list_replicas
from pipeline.errors import ConfigError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import content_hash
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore
from pipeline.targets.patching import int_view
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from workers.nodes.rollout import run_rollout

RUN = "proc"
ROOT = Path(__file__).resolve().parents[2]


def publish_versions(
    store: FileStore, workdir: Path, count: int, content_hash: str | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-6, seed=1)
    workdir.mkdir(parents=True, exist_ok=True)
    cache = StateCache(workdir / "cache", RUN)
    states: dict[int, dict[str, torch.Tensor]] = {}
    state = generator.state()
    for step in range(count):
        if step:
            state = generator.step()
        path = workdir / f"{step}.safetensors"
        save_state(state, path)
        publish_step(store, RUN, step, path, cache, PublishOptions(content_hash=content_hash))
        states[step] = state
    return states


def rollout(
    home: Path, store: FileStore, redis_url: str, *args: str, **settings: str
) -> list[dict[str, object]]:
    env = dict(os.environ, DELTASYNC_HOME=str(home), DELTASYNC_STORE=store.url,
               DELTASYNC_REDIS_URL=redis_url, DELTASYNC_LOG_JSON="1", **settings)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "workers", "rollout", "--run", RUN, "--node-id", "proc-node",
         "--poll", "0.2", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def dumped(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.get(name) for name in reader.names()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(int_view(got[name]).view(-1), int_view(tensor).view(-1)), name
        assert content_hash(got[name]) == content_hash(tensor), name


@pytest.mark.slow
def test_rollout_command_follows_dumps_and_resumes_from_its_dump(
    tmp_path: Path, redis_url: str
) -> None:
    store = FileStore(tmp_path / "store")
    # xxh3-128: the walked write below is that hash's (an incremental run keeps patches)
    states = publish_versions(store, tmp_path / "trainer", 3, content_hash="xxh3-128")
    home = tmp_path / "home"
    first_dump = tmp_path / "first.safetensors"
    logs = rollout(home, store, redis_url, "--until", "2", "--dump", str(first_dump))
    assert any(e.get("event") == "bootstrapping" for e in logs)
    assert_same(dumped(first_dump), states[2])
    # It reported while it ran and took its heartbeat along when it stopped.
    assert any(e.get("event") == "applied" for e in logs)
    assert list_replicas(redis_client(redis_url), RUN) == []

    # Restarted from its own dump: the weights prove version 2, no bootstrap. No
    # memory for decoded patches: the delta is walked into the weights.
    more = publish_versions_after(store, tmp_path / "trainer", states)
    second_dump = tmp_path / "second.safetensors"
    logs = rollout(home, store, redis_url, "--model", str(first_dump), "--until", str(more),
                   "--dump", str(second_dump), DELTASYNC_PATCH_MEMORY_MB="0")  # fmt: skip
    events = [e.get("event") for e in logs]
    assert "resumed" in events and "bootstrapping" not in events
    walked = [e["walked"] for e in logs if e.get("event") == "applied"]
    assert walked and all(isinstance(n, int) and n > 0 for n in walked)
    assert_same(dumped(second_dump), states[more])


def publish_versions_after(
    store: FileStore, workdir: Path, states: dict[int, dict[str, torch.Tensor]]
) -> int:
    """One more version from the same trainer (replayed deterministically by seed)."""
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-6, seed=1)
    for _ in range(len(states) - 1):
        generator.step()
    state = generator.step()
    version = len(states)
    path = workdir / f"{version}.safetensors"
    save_state(state, path)
    publish_step(store, RUN, version, path, StateCache(workdir / "cache", RUN))
    states[version] = state
    return version


def test_unknown_target_and_bad_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="known targets: torch, vllm"):
        run_rollout(RolloutOptions(run=RUN, target="tpu", store_url=(tmp_path / "s").as_uri(),
                                   redis_url="redis://127.0.0.1:1/0"))  # fmt: skip
    with pytest.raises(ConfigError, match="verify"):
        RolloutOptions(run=RUN, verify="some", store_url=(tmp_path / "s").as_uri())
    with pytest.raises(ConfigError, match="poll interval"):
        RolloutOptions(run=RUN, poll_interval_s=0)


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("cudaX", "--device 'cudaX' is not a torch device"),
        ("gpu:0", "--device 'gpu:0' is not a torch device"),
        ("cuda:64", "--device 'cuda:64': "),
    ],
)
def test_a_device_torch_cannot_use_is_a_config_error(
    tmp_path: Path, device: str, error: str
) -> None:
    """A misspelled --device, or one this machine has not, is named before the node
    connects (not torch's RuntimeError or AssertionError at the first tensor)."""
    options = RolloutOptions(run=RUN, device=device, store_url=(tmp_path / "s").as_uri(),
                             redis_url="redis://127.0.0.1:1/0")  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(error)):
        run_rollout(options)


def test_a_dump_that_fails_still_takes_the_heartbeat_along(tmp_path: Path, redis_url: str) -> None:
    """--dump to a path that cannot be written: the error comes out, and the stopped
    node's heartbeat is removed all the same (garbage collection need not wait for it)."""
    store = FileStore(tmp_path / "store")
    save_state({"w": torch.arange(64, dtype=torch.float32).bfloat16()}, tmp_path / "0.st")
    publish_step(store, RUN, 0, tmp_path / "0.st", StateCache(tmp_path / "cache", RUN))
    settings = Settings.from_env(
        {"DELTASYNC_HOME": str(tmp_path / "home"), "DELTASYNC_STORE": store.url,
         "DELTASYNC_REDIS_URL": redis_url, "DELTASYNC_WARM": "0"}
    )  # fmt: skip
    below_a_file = tmp_path / "0.st" / "w.safetensors"
    options = RolloutOptions(run=RUN, node_id="dumper", until_version=0, dump_path=below_a_file)
    with pytest.raises(OSError):
        run_rollout(options, settings=settings)
    assert list_replicas(redis_client(redis_url), RUN) == []
