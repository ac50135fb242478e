"""Peak memory of the real processes against model size, up to checkpoints larger than RAM.

    python benchmarks/bench_bigger_than_memory.py [--sizes 1,2,4] [--density 0.02]
                                                  [--no-ram-node] [--lean-disk]
                                                  [--work DIR] [--json F]

For each size S (GiB of bf16 weights) the benchmark writes two versions of a
sharded checkpoint on disk, shard by shard (1 GiB shards of 128 MiB tensors;
version 1 is version 0 changed by the update emulator at ``--density``; no more
than one tensor pair is in the benchmark's memory at a time), then runs the
real processes one after the other against a real redis-server and a local
folder store, each polled through /proc for its resident memory:

- ``deltasync worker diff --burst`` after ``deltasync emit`` of step 0 (the
  first version: an anchor) and again after step 1 (a delta against the
  worker's state cache);
- a rollout node (``pipeline.rollout.node.RolloutNode``, the code behind ``deltasync
  rollout``) whose torch target is a memory-mapped file (MAP_SHARED views, so
  patches go to the page cache, not to anonymous memory): it bootstraps from
  the anchor and applies delta 1;
- optionally ``deltasync rollout --target torch --until 1 --dump``: the node as
  shipped, holding the model in anonymous memory (its memory grows with the
  model by design; skipped with ``--no-ram-node``);
- ``deltasync worker compact --burst`` after ``deltasync compact --version 1``;
- ``deltasync verify --version 1 --against v1`` (rebuild from the new anchor,
  compare bit for bit).

``--lean-disk`` deletes version 0 and the diff worker's state cache once the
delta job is done (nothing after it reads them): the peak disk use drops from
about 7x to 4x the model size, which is what lets 2 x 16 GiB run on 80 GB.

Bit-exactness: the memory-mapped target and the RAM node's dump are compared
with version 1 tensor by tensor through integer views, and ``verify`` checks the
compacted anchor. Reported per process: peak anonymous resident memory (RssAnon,
polled every 50 ms: the memory that cannot be reclaimed), peak total resident
memory (the kernel's high-water mark, which also counts mapped file pages; those
are page cache the kernel reclaims under pressure) and wall time (rough: the
machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulator import UpdateEmulator, calibrated_profile
from pipeline.format.checkpoints.checkpoint import CheckpointReader, read_file_header
from pipeline.format.checkpoints.checkpoint_write import write_sharded
from tests.pipeline_helpers import REPO, deltasync_env
from tests.servers import RedisServer

RUN = "bigmem"
ROWS, COLS = 8192, 8192  # 128 MiB of bf16 per tensor
TENSORS_PER_SHARD = 8  # 1 GiB shards
GIB = 1 << 30
RAM_NODE = [
    "rollout",
    "--run",
    "bigmem",
    "--wait",
    "--target",
    "torch",
    "--node-id",
    "ram",
    "--until",
    "1",
    "--poll",
    "0.5",
]


# ---------------------------------------------------------------- checkpoints on disk


def _base_tensor(index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + index)
    return (0.02 * torch.randn((ROWS, COLS), generator=gen)).to(torch.bfloat16)


def generate(folder: Path, size_gib: int, density: float) -> tuple[Path, Path, int]:
    """Versions 0 and 1 as sharded folders; returns their paths and the changed count."""
    count = size_gib * GIB // (ROWS * COLS * 2)
    shards = max(1, -(-count // TENSORS_PER_SHARD))
    profile = calibrated_profile("small").tuned_for([_base_tensor(0)], density)
    changed = [0]
    paths = []
    for v in (0, 1):
        path = folder / f"v{v}"
        write_sharded(path, _lazy(v, count, shards, profile, changed))
        paths.append(path)
    return paths[0], paths[1], changed[0]


def _lazy(
    v: int, count: int, shards: int, profile: Any, changed: list[int]
) -> Iterator[tuple[str, Iterator[tuple[str, torch.Tensor]]]]:
    def tensors(s: int) -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(s * TENSORS_PER_SHARD, min(count, (s + 1) * TENSORS_PER_SHARD)):
            t = _base_tensor(i)
            if v == 1:
                changed[0] += UpdateEmulator(profile, seed=i).step_({"t": t})
            yield f"model.layers.{i}.mlp.weight", t

    for s in range(shards):
        yield f"model-{s + 1:05d}-of-{shards:05d}.safetensors", tensors(s)


def same_checkpoint(a: Path, b: Path) -> None:
    """Tensor by tensor through integer views of the mapped files."""
    with CheckpointReader(a) as x, CheckpointReader(b) as y:
        assert x.names() == y.names() or set(x.names()) == set(y.names()), f"{a} vs {b}: names"
        for name in y.names():
            p, q = x.view(name), y.view(name)
            assert p.dtype == q.dtype and p.shape == q.shape, f"{a}: {name} spec"
            if not torch.equal(p.reshape(-1).view(torch.int16), q.reshape(-1).view(torch.int16)):
                raise AssertionError(f"{a}: tensor {name} differs from {b}")
            del p, q
            x.close()
            y.close()


# ---------------------------------------------------------------- memory-mapped node


def mapped_node(store_url: str, template: Path, out: Path, until: int) -> None:
    """A rollout node whose torch target is ``out``, a safetensors file laid out like
    ``template`` and mapped shared: the weights live in the page cache, not in the
    process's anonymous memory."""
    from pipeline.rollout.node import NodeOptions, RolloutNode
    from pipeline.store import open_store
    from pipeline.targets.torch import TorchTarget

    with CheckpointReader(template) as reader:
        entries = [(n, reader.spec(n)) for n in reader.names()]
    header: dict[str, Any] = {}
    offset = 0
    for name, spec in entries:
        n = int(np.prod(spec.shape)) * torch.empty((), dtype=spec.dtype).element_size()
        header[name] = {
            "dtype": "BF16",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with out.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(start + offset)  # sparse until the bootstrap writes it
    mapped = torch.from_file(str(out), shared=True, size=start + offset, dtype=torch.uint8)
    weights = {}
    for name, spec in entries:
        b, e = header[name]["data_offsets"]
        weights[name] = mapped[start + b : start + e].view(spec.dtype).view(spec.shape)
    node = RolloutNode(
        open_store(store_url), RUN, TorchTarget(weights), NodeOptions(poll_interval_s=0.5)
    )
    try:
        node.run(until_version=until)
    finally:
        node.close()
    read_file_header(out)  # the file is a valid safetensors file


# ---------------------------------------------------------------- measured processes


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def measured(name: str, args: list[str], env: dict[str, str], logs: Path) -> dict[str, Any]:
    """Run a command to completion, polling its memory; fail on a non-zero exit."""
    peak = {"RssAnon": 0, "VmRSS": 0, "RssFile": 0}
    log_path = logs / f"{name}.log"
    with log_path.open("ab") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                for key, value in _status(proc.pid).items():
                    if key in peak:
                        peak[key] = max(peak[key], value)
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        poller.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{tail}")
    row = {
        "process": name,
        "peak_anon_mib": peak["RssAnon"] / 2**20,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # the kernel's high-water mark, KiB
        "peak_file_mib": peak["RssFile"] / 2**20,
        "wall_s": wall,
    }
    print(
        f"  {name}: anon {row['peak_anon_mib']:.0f} MiB, rss {row['peak_rss_mib']:.0f} MiB "
        f"(file pages {row['peak_file_mib']:.0f} MiB), {wall:.0f} s",
        flush=True,
    )
    return row


def deltasync(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers", *args]


def _disk_used(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def run_size(
    size: int, work: Path, density: float, ram_node: bool, lean_disk: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    v0, v1, changed = generate(work, size, density)
    with CheckpointReader(v1) as r:
        elements = sum(int(np.prod(s.shape)) for s in r.specs().values())
        total = r.total_bytes
    info = {
        "size_gib": total / GIB,
        "changed": changed,
        "density": changed / elements,
        "generate_s": time.perf_counter() - start,
    }
    print(
        f"{total / GIB:.1f} GiB x 2 versions written in {info['generate_s']:.0f} s, "
        f"{100 * info['density']:.2f}% changed; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    rows = []
    with RedisServer(work / "redis") as server:
        assert isinstance(server, RedisServer)
        env = deltasync_env(server.url, work, OMP_NUM_THREADS="2")
        store_url = env["DELTASYNC_STORE"]

        def quick(*args: str) -> None:
            done = subprocess.run(
                deltasync(*args), check=False, env=env, cwd=REPO, capture_output=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"deltasync {' '.join(args)}: {done.stderr.decode()[-2000:]}")

        quick("emit", "--run", RUN, "--step", "0", "--checkpoint", str(v0))
        rows.append(
            measured("diff worker, anchor v0", deltasync("worker", "diff", "--burst"), env, logs)
        )
        quick("emit", "--run", RUN, "--step", "1", "--checkpoint", str(v1))
        rows.append(
            measured("diff worker, delta v1", deltasync("worker", "diff", "--burst"), env, logs)
        )
        info["peak_disk_gib"] = _disk_used(work) / GIB
        print(f"  disk in use after the diffs: {info['peak_disk_gib']:.1f} GiB", flush=True)
        if lean_disk:  # the later processes read the store and v1 only
            shutil.rmtree(v0)
            shutil.rmtree(Path(env["DELTASYNC_HOME"]) / "cache")
        mapped = work / "node-mapped.safetensors"
        rows.append(
            measured(
                "rollout node, mapped target",
                [sys.executable, __file__, "--mapped-node", store_url, str(v1), str(mapped)],
                env,
                logs,
            )
        )
        same_checkpoint(mapped, v1)
        mapped.unlink()
        if ram_node:
            dump = work / "node-ram.safetensors"
            rows.append(
                measured(
                    "rollout node, torch target in RAM",
                    deltasync(*RAM_NODE, "--dump", str(dump)),
                    env,
                    logs,
                )
            )
            same_checkpoint(dump, v1)
            dump.unlink()
        quick("compact", "--run", RUN, "--version", "1")
        rows.append(
            measured("compaction worker", deltasync("worker", "compact", "--burst"), env, logs)
        )
        rows.append(
            measured(
                "verify (rebuild v1 from its anchor)",
                deltasync("verify", "--run", RUN, "--version", "1", "--against", str(v1)),
                env,
                logs,
            )
        )
    print("  bit for bit: mapped target and dump equal v1; verify passed", flush=True)
    for row in rows:
        row["size_gib"] = info["size_gib"]
    return rows, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="GiB of weights per version, comma list")
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--no-ram-node", action="store_true")
    parser.add_argument(
        "--lean-disk", action="store_true", help="delete v0 and the state cache after the diffs"
    )
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--mapped-node", nargs=3, metavar=("STORE", "TEMPLATE", "OUT"))
    args = parser.parse_args()
    if args.mapped_node:
        store_url, template, out = args.mapped_node
        mapped_node(store_url, Path(template), Path(out), until=1)
        return

    root = Path(args.work or tempfile.mkdtemp(prefix="bench-bigmem-"))
    print(f"work folder {root}", flush=True)
    rows: list[dict[str, Any]] = []
    infos = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            got, info = run_size(
                size, root / f"{size}g", args.density, not args.no_ram_node, args.lean_disk
            )
            rows += got
            infos.append(info)
            shutil.rmtree(root / f"{size}g", ignore_errors=True)
            if args.json:
                args.json.write_text(json.dumps({"rows": rows, "sizes": infos}, indent=2))
    finally:
        if args.work is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    sizes = sorted({r["size_gib"] for r in rows})
    print("| process | " + " | ".join(f"{s:.0f} GiB: anon / rss MiB" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in dict.fromkeys(r["process"] for r in rows):
        cells = []
        for s in sizes:
            r = next((r for r in rows if r["process"] == name and r["size_gib"] == s), None)
            cells.append(
                "-" if r is None else f"{r['peak_anon_mib']:.0f} / {r['peak_rss_mib']:.0f}"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
