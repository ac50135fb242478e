"""Diff throughput with one and two diff workers (DELTASYNC_PARALLEL_PARTS), real processes.

    python benchmarks/bench_parallel_diff.py [--params 0.2e9] [--versions 4]
                                             [--part-mb 32] [--density 0.02] [--work DIR]

A Qwen-shaped bf16 state (``--params``) gets ``--versions`` new versions from the
update emulator (benchmarks/emulator.py). The same checkpoints are published
three times, each into a fresh run on a local folder store with a real
redis-server: by one worker on the single-job path, by one worker in parallel
mode (its overhead), and by two workers in parallel mode. Each version is
emitted once the previous one is available; the time is step-completed ->
delta-available from the Redis stream ids (one clock). Every run's last version
is rebuilt from the store and compared bit for bit with the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulator import UpdateEmulator, calibrated_profile, make_state, qwen_like_shapes
from pipeline.coord.stream import ENTRY_FIELD, stream_key
from pipeline.format.checkpoint import CheckpointReader
from pipeline.store import open_store
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain
from tests.pipeline_helpers import bits, deltasync_env, processes, wait_for
from tests.servers import RedisServer

MODES = [
    ("single-job, 1 worker", "0", 1),
    ("parallel, 1 worker", "1", 1),
    ("parallel, 2 workers", "1", 2),
]


def event_time(r: redis.Redis, run: str, kind: str, version: int) -> float | None:
    for entry_id, fields in r.xrange(stream_key(run)):
        doc = json.loads(fields[ENTRY_FIELD.encode()])
        if doc.get("type") == kind and int(doc["version"]) == version:
            return int(entry_id.decode().split("-")[0]) / 1000
    return None


def publish_all(
    server: RedisServer, work: Path, run: str, parallel: str, workers: int, ckpts: list[Path],
    part_bytes: int,
) -> list[float]:  # fmt: skip
    env = deltasync_env(
        server.url,
        work,
        DELTASYNC_COMPACT_MAX_CHAIN="1000",
        DELTASYNC_COMPACT_MAX_FRACTION="100",
        DELTASYNC_PARALLEL_PARTS=parallel,
        DELTASYNC_PART_BYTES=str(part_bytes),
        OMP_NUM_THREADS="1",
    )
    os.environ.update({k: v for k, v in env.items() if k.startswith("DELTASYNC_")})
    from pipeline.config import Settings
    from workers.trainer import Emitter

    emitter = Emitter(run, settings=Settings.from_env(env))
    r = redis.Redis.from_url(server.url)
    commands = {f"diff{i}": ["worker", "diff"] for i in range(workers)}
    seconds = []
    with processes(env, work / "logs", **commands):
        for step, path in enumerate(ckpts):
            emitter.emit_checkpoint(step, path)
            wait_for(
                lambda step=step: event_time(r, run, "delta-available", step) is not None,
                f"{run} v{step}",
                timeout_s=900,
            )
            if step:
                t0 = event_time(r, run, "step-completed", step)
                t1 = event_time(r, run, "delta-available", step)
                assert t0 is not None and t1 is not None
                seconds.append(t1 - t0)
                print(f"{run} v{step}: {seconds[-1]:.2f} s", flush=True)
    store = open_store(env["DELTASYNC_STORE"])
    last = len(ckpts) - 1
    rebuilt = dict(chain.reconstruct_tensors(store, run, last))
    with CheckpointReader(ckpts[-1]) as want:
        for name in want.names():
            assert torch.equal(bits(rebuilt[name]), bits(want.get(name))), f"{run}: {name}"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.2e9)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--part-mb", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-pardiff-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}; {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    state = make_state(qwen_like_shapes(args.params), seed=0)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    emulator = UpdateEmulator(calibrated_profile("small").tuned_for(state.values(), args.density))
    ckpts = []
    for step in range(args.versions + 1):
        if step:
            emulator.step_(state)
        ckpts.append(work / "ckpt" / f"step-{step:06d}.safetensors")
        ckpts[-1].parent.mkdir(exist_ok=True)
        save_state(state, ckpts[-1])
    del state
    results: dict[str, Any] = {}
    with RedisServer(work / "redis") as server:
        assert isinstance(server, RedisServer)
        for i, (label, parallel, workers) in enumerate(MODES):
            seconds = publish_all(
                server, work / f"mode{i}", f"bench{i}", parallel, workers, ckpts,
                args.part_mb << 20,
            )  # fmt: skip
            median = statistics.median(seconds)
            results[label] = {"seconds": seconds, "median_s": median}
    print()
    print(f"{model_bytes / 1e6:.0f} MB bf16 model, {args.part_mb} MiB parts, "
          f"{args.versions} versions, {os.cpu_count()} cores")  # fmt: skip
    print("| mode | median s per version | GB/s of model |")
    print("|---|---:|---:|")
    for label, row in results.items():
        print(f"| {label} | {row['median_s']:.2f} | {model_bytes / 1e9 / row['median_s']:.2f} |")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
