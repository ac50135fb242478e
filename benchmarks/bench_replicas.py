"""Many replicas following one run: store reads per version, Redis load, slowest lag.

    python benchmarks/bench_replicas.py [--replicas 8] [--versions 6] [--params 30e6]

A real redis-server and a local folder store; ``--replicas`` RolloutNodes
(torch targets) follow the run in threads of this process, each reading the
store through its own counting wrapper and Redis through its own client. The
publisher takes emulated updates (benchmarks/emulator.py) of a bf16 state,
publishes each with the real ``publish_step`` and announces it with a
``delta-available`` event, as the diff worker does. Reported: object reads per
node per version (and whether any object was read twice), list calls, Redis
commands per second from INFO commandstats over the run, and per version the
time from ``delta-available`` to the slowest node's apply. Threads share one
interpreter, so applies serialise on the GIL: the lag is an upper bound of what
separate processes (or machines) see.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulator import UpdateEmulator, calibrated_profile, make_state, qwen_like_shapes
from pipeline.coord.events import DeltaAvailable
from pipeline.coord.stream import EventStream
from pipeline.format.manifest import manifest_key
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain
from tests.pipeline_helpers import bits
from tests.servers import RedisServer

RUN = "fleet"


class CountingStore:
    """A store that counts reads per key (everything else passes through)."""

    def __init__(self, inner: FileStore) -> None:
        self.inner = inner
        self.gets: collections.Counter[str] = collections.Counter()
        self.lists = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self.lock:
            self.gets[key] += 1
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self.lock:
            self.gets[key] += 1
        return self.inner.get_range(key, start, length)

    def list(self, prefix: str) -> Iterator[str]:
        with self.lock:
            self.lists += 1
        return self.inner.list(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def command_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--params", type=float, default=30e6)
    parser.add_argument("--density", type=float, default=0.02)
    args = parser.parse_args()
    torch.set_num_threads(1)

    shapes = list(qwen_like_shapes(args.params, vocab=8192, hidden=512))
    state = make_state(shapes, seed=0)
    emulator = UpdateEmulator(
        calibrated_profile("tiny").tuned_for(state.values(), args.density), seed=1
    )
    with (
        tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        assert isinstance(server, RedisServer)
        work = Path(tmp)
        base_store = FileStore(work / "store")
        cache = StateCache(work / "cache", RUN)
        r = redis.Redis.from_url(server.url)
        stream = EventStream(r, RUN)

        def publish(step: int) -> None:
            path = work / f"step-{step}.safetensors"
            save_state(state, path)
            result = publish_step(base_store, RUN, step, path, cache)
            m = result.manifest
            assert m is not None
            stream.publish(
                DeltaAvailable.now(
                    run=RUN, version=step, kind=m.kind, parent=m.parent, anchor=m.anchor,
                    bytes=m.total_bytes, changed=result.changed, total=result.total,
                    manifest=manifest_key(RUN, m.kind, step),
                )
            )  # fmt: skip
            path.unlink()

        publish(0)
        stores = [CountingStore(base_store) for _ in range(args.replicas)]
        nodes = [
            RolloutNode(
                store, RUN,
                TorchTarget({n: torch.empty_like(t) for n, t in state.items()}),
                NodeOptions(node_id=f"node-{i}", poll_interval_s=30.0, heartbeat_interval_s=5.0),
                events=EventStream(redis.Redis.from_url(server.url), RUN),
                redis=redis.Redis.from_url(server.url),
            )
            for i, store in enumerate(stores)
        ]  # fmt: skip
        stop = threading.Event()
        threads = [threading.Thread(target=n.run, kwargs={"stop": stop}) for n in nodes]
        for t in threads:
            t.start()
        while any(n.applied_version != 0 for n in nodes):
            time.sleep(0.05)
        calls0, t0 = command_calls(r), time.monotonic()
        lags = []
        for step in range(1, args.versions + 1):
            emulator.step_(state)
            publish(step)
            announced = time.monotonic()
            while any(n.applied_version != step for n in nodes):
                time.sleep(0.005)
            lags.append(time.monotonic() - announced)
            print(f"v{step}: slowest node applied {lags[-1]:.3f} s after the event", flush=True)
        elapsed = time.monotonic() - t0
        calls = command_calls(r) - calls0
        stop.set()
        for t in threads:
            t.join()
        for node in nodes:
            got = {n: t for n, t in node.target.export()}
            for name, tensor in state.items():
                assert torch.equal(bits(got[name]), bits(tensor)), f"{node.node_id}: {name}"
        index = chain.list_versions(base_store, RUN)
        objects_per_version = {
            v: len(chain.load_manifest(base_store, RUN, "delta", v).objects) for v in index.deltas
        }
        delta_reads = [
            sum(c for k, c in s.gets.items() if "/deltas/" in k and not k.endswith("json"))
            for s in stores
        ]
        manifest_reads = [sum(c for k, c in s.gets.items() if k.endswith("manifest.json"))
                          for s in stores]  # fmt: skip
        repeats = max(max(s.gets[k] for k in s.gets if not k.endswith("json")) for s in stores)
        per_version = sum(objects_per_version.values()) / len(objects_per_version)
    print()
    print(f"{args.replicas} replicas, {args.versions} versions, "
          f"{sum(t.numel() for t in state.values()) / 1e6:.0f}M bf16 parameters; "
          "every replica bit-exact with the last version")  # fmt: skip
    print("| figure | value |")
    print("|---|---:|")
    print(f"| delta objects per version | {per_version:.1f} |")
    print(f"| delta object reads per node per version | "
          f"{statistics.mean(delta_reads) / args.versions:.2f} |")  # fmt: skip
    print(f"| most reads of one object by one node | {repeats} |")
    print(f"| manifest reads per node per version | "
          f"{statistics.mean(manifest_reads) / (args.versions + 1):.2f} |")  # fmt: skip
    print(f"| store list calls per node per version | "
          f"{statistics.mean(s.lists for s in stores) / (args.versions + 1):.2f} |")  # fmt: skip
    print(f"| Redis commands per second (all nodes + publisher) | {calls / elapsed:.0f} |")
    print(f"| Redis commands per version | {calls / args.versions:.0f} |")
    print(f"| slowest node lag after delta-available, median | {statistics.median(lags):.3f} s |")
    print(f"| slowest node lag, max | {max(lags):.3f} s |")


if __name__ == "__main__":
    main()
