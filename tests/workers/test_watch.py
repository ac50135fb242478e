"""`deltasync watch`: one emit per complete checkpoint, none for one still being written."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from pipeline.coord.connection import redis_client
from pipeline.coord.stream import EventStream
from tests.pipeline_helpers import deltasync_env, processes, wait_for

pytestmark = pytest.mark.slow


def _checkpoint_bytes(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layer.{i}.weight": torch.randn(256, 256, generator=g).bfloat16() for i in range(4)}
    return save(tensors)


def _step_events(redis_url: str, run: str) -> list[int]:
    events = EventStream(redis_client(redis_url), run).read(count=1000)
    return [e.version for _, e in events if e is not None and e.type == "step-completed"]


def test_slowly_written_checkpoint_emits_once(redis_url: str, tmp_path: Path) -> None:
    run = "watched"
    folder = tmp_path / "ckpts"
    folder.mkdir()
    env = deltasync_env(redis_url, tmp_path)
    watch = ["watch", str(folder), "--run", run, "--settle", "0.5"]
    with processes(env, tmp_path / "logs", watch=watch) as procs:
        log = tmp_path / "logs" / "watch.log"
        # Written only while the watcher runs: otherwise nothing here is tested.
        wait_for(lambda: b"watching for checkpoints" in log.read_bytes(), "the watcher", 60)
        data = _checkpoint_bytes(1)
        target = folder / "model-100.safetensors"
        with target.open("wb") as f:
            stream = io.BytesIO(data)
            # Written over ~3 s in pieces: incomplete (truncated) the whole time.
            while chunk := stream.read(len(data) // 12 + 1):
                f.write(chunk)
                f.flush()
                time.sleep(0.25)
                assert _step_events(redis_url, run) == [], "emitted a half-written checkpoint"
        wait_for(lambda: _step_events(redis_url, run) == [100], "the emit", timeout_s=60)

        # A sharded folder that appears later, written the usual way.
        shard_dir = folder / "step-200"
        shard_dir.mkdir()
        (shard_dir / "model.safetensors").write_bytes(_checkpoint_bytes(2))
        wait_for(lambda: _step_events(redis_url, run) == [100, 200], "the second emit", 60)
        time.sleep(2)  # further scans must not emit again
        assert _step_events(redis_url, run) == [100, 200]
        assert procs["watch"].poll() is None
    assert target.read_bytes() == data, "the user's checkpoint was modified"
