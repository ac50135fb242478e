"""Emit + diff per version of a sharded trainer with 1, 2 and 4 ranks, real processes.

    python benchmarks/bench_sharded.py [--params 0.1e9] [--versions 4] [--density 0.02]
                                       [--ranks 1,2,4] [--work DIR] [--homes DIR]

A Qwen-shaped bf16 state (``--params``) gets ``--versions`` new versions from the
update emulator (benchmarks/emulator.py, calibrated profile: every tensor touched).
For each rank count W a fresh run is published by W trainer rank processes (plain
``ShardedEmitter`` ranks, each holding its rows of every tensor as torch.chunk cuts
dim 0, the way FSDP2 shards them), two ranks per emulated host, each host with its
own staging and cache folders and one diff worker on its own queue (the first host's
also coordinates), over a local folder store and a real redis-server. The baseline,
in the same run: one trainer process holding the whole state, ``Emitter.emit_state``,
one diff worker.

Per version: each trainer holds its tensors in memory before the clock starts; then
every rank emits at once. ``emit``: until the last rank has staged and registered;
``diff``: from then until ``delta-available`` (one clock). Medians and minimums over
the deltas after the first one (page cache, first rank caches). Staging files are
fsynced, and on a virtual disk that makes the emit time swing by 10x between
identical versions: ``--homes`` puts every host's staging and cache folders
elsewhere (e.g. /dev/shm) for both the sharded and the unsharded modes. Every run's last version is
rebuilt from the store and compared bit for bit with the emulator's state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulator import UpdateEmulator, calibrated_profile, make_state, qwen_like_shapes
from pipeline.coord.stream import ENTRY_FIELD, stream_key
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.store import open_store
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, bits, deltasync_env, wait_for
from tests.servers import RedisServer


def event_time(r: redis.Redis, run: str, kind: str, version: int) -> float | None:
    """When the run's stream got the ``kind`` event of ``version`` (seconds), or None."""
    for entry_id, fields in r.xrange(stream_key(run)):
        doc = json.loads(fields[ENTRY_FIELD.encode()])
        if doc.get("type") == kind and int(doc["version"]) == version:
            return int(entry_id.decode().split("-")[0]) / 1000
    return None


def host_of(rank: int) -> str:
    return f"h{rank // 2}"


# ------------------------------------------------------------------ a trainer process


def rows_of(tensor: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``tensor`` as FSDP2 cuts dim 0 (torch.chunk), and the first."""
    if tensor.dim() == 0:
        return (tensor.reshape(1), 0) if rank == 0 else (tensor.reshape(0), 0)
    size = -(-tensor.shape[0] // world)
    first = min(rank * size, tensor.shape[0])
    return tensor[first : first + size].clone(), first


def trainer(args: argparse.Namespace) -> None:
    """One rank (or, with ``--world 0``, the unsharded baseline) emitting each version
    of the checkpoints in ``--ckpts`` when ``go-<v>`` appears."""
    from workers.trainers.sharded_trainer import ShardedEmitter, ShardPiece
    from workers.trainers.trainer import Emitter

    work = Path(args.work)
    ckpts = sorted(Path(args.ckpts).iterdir())
    sharded = args.world > 0
    emitter: Any
    if sharded:
        emitter = ShardedEmitter(
            args.run, rank=args.rank, world=args.world, host=host_of(args.rank), launch="bench"
        )
    else:
        emitter = Emitter(args.run)
    for step, path in enumerate(ckpts):
        with CheckpointReader(path) as reader:
            held: dict[str, Any] = {}
            for name in reader.names():
                full = reader.get(name)
                if sharded:
                    rows, first = rows_of(full, args.rank, args.world)
                    held[name] = ShardPiece(rows, tuple(full.shape), first)
                else:
                    held[name] = full.clone()
        (work / f"ready-{args.rank}-{step}").touch()
        go = work / f"go-{step}"
        while not go.exists():
            time.sleep(0.002)
        if sharded:
            emitter.emit_shards(step, held)
        else:
            emitter.emit_state(step, held)
        (work / f"done-{args.rank}-{step}").write_text(repr(time.time()))
        del held


# ------------------------------------------------------------------ one mode


def publish_all(
    server: RedisServer,
    work: Path,
    homes: Path,
    run: str,
    world: int,
    ckpts: Path,
    versions: int,
) -> dict[str, list[float]]:
    ranks = list(range(max(world, 1)))
    hosts = sorted({host_of(r) for r in ranks}) if world else ["h0"]
    envs = {
        h: deltasync_env(
            server.url,
            work / h,
            DELTASYNC_HOME=str(homes / h),
            DELTASYNC_STORE=f"file://{work / 'store'}",
            DELTASYNC_COMPACT_MAX_CHAIN="1000",
            DELTASYNC_COMPACT_MAX_FRACTION="100",
            OMP_NUM_THREADS="1",
        )
        for h in hosts
    }
    procs = []
    logs = work / "logs"
    logs.mkdir(parents=True)

    def start(name: str, args: list[str], env: dict[str, str]) -> None:
        out = (logs / f"{name}.log").open("ab")
        procs.append(
            subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        )

    py = sys.executable
    for h in hosts:
        worker = [py, "-m", "workers", "worker", "diff"]
        if world:
            worker += ["--host", h] + (["--host-only"] if h != "h0" else [])
        start(f"diff-{h}", worker, envs[h])
    for rank in ranks:
        me = [py, str(Path(__file__).resolve()), "trainer", "--run", run, "--rank", str(rank)]
        me += ["--world", str(world), "--work", str(work), "--ckpts", str(ckpts)]
        start(f"rank-{rank}", me, envs[host_of(rank)])
    r = redis.Redis.from_url(server.url)
    out: dict[str, list[float]] = {"emit": [], "diff": []}
    try:
        for step in range(versions + 1):
            wait_for(
                lambda s=step: all((work / f"ready-{k}-{s}").exists() for k in ranks),
                f"{run}: trainers holding v{step}",
                timeout_s=900,
            )
            t0 = time.time()
            (work / f"go-{step}").touch()
            kind = "anchor-available" if step == 0 else "delta-available"
            wait_for(
                lambda s=step, k=kind: (
                    event_time(r, run, k, s) is not None
                    or event_time(r, run, "delta-available", s) is not None
                ),
                f"{run} v{step}",
                timeout_s=900,
            )
            done = event_time(r, run, "delta-available", step) or event_time(r, run, kind, step)
            assert done is not None
            emitted = max(float((work / f"done-{k}-{step}").read_text()) for k in ranks)
            if step:
                out["emit"].append(emitted - t0)
                out["diff"].append(done - emitted)
                print(
                    f"{run} v{step}: emit {emitted - t0:.2f} s, diff {done - emitted:.2f} s",
                    flush=True,
                )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    store = open_store(f"file://{work / 'store'}")
    rebuilt = dict(chain.reconstruct_tensors(store, run, versions))
    with CheckpointReader(sorted(ckpts.iterdir())[-1]) as want:
        for name in want.names():
            assert torch.equal(bits(rebuilt[name]), bits(want.get(name))), f"{run}: {name}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("trainer")
    rank.add_argument("--run", required=True)
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--world", type=int, required=True)
    rank.add_argument("--work", required=True)
    rank.add_argument("--ckpts", required=True)
    parser.add_argument("--params", type=float, default=0.1e9)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--homes", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "trainer":
        trainer(args)
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-sharded-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}; {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    state = make_state(qwen_like_shapes(args.params), seed=0)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    emulator = UpdateEmulator(calibrated_profile("small").tuned_for(state.values(), args.density))
    ckpts = work / "ckpt"
    ckpts.mkdir(exist_ok=True)
    for step in range(args.versions + 1):
        if step:
            emulator.step_(state)
        save_state(state, ckpts / f"step-{step:06d}.safetensors")
    del state
    modes = [("unsharded, 1 process", 0)] + [
        (f"{w} rank{'s' if w > 1 else ''}, {max(1, w // 2)} host{'s' if w > 2 else ''}", w)
        for w in (int(x) for x in args.ranks.split(","))
    ]
    results: dict[str, dict[str, float]] = {}
    with RedisServer(work / "redis") as server:
        assert isinstance(server, RedisServer)
        for i, (label, world) in enumerate(modes):
            homes = (args.homes or work) / f"homes{i}"
            got = publish_all(
                server, work / f"mode{i}", homes, f"bench{i}", world, ckpts, args.versions
            )
            shutil.rmtree(homes, ignore_errors=True)
            tail = {k: v[1:] or v for k, v in got.items()}  # after the first delta
            results[label] = {
                **{k: statistics.median(v) for k, v in tail.items()},
                **{f"{k}_min": min(v) for k, v in tail.items()},
            }
    print()
    print(
        f"{model_bytes / 1e6:.0f} MB bf16 model, density {args.density}, {args.versions} "
        f"versions, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print("| mode | emit s, median (min) | diff s, median (min) | diff x unsharded |")
    print("|---|---:|---:|---:|")
    base = results[modes[0][0]]["diff"]
    for label, row in results.items():
        print(
            f"| {label} | {row['emit']:.2f} ({row['emit_min']:.2f}) | {row['diff']:.2f} "
            f"({row['diff_min']:.2f}) | {row['diff'] / base:.2f} |"
        )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
