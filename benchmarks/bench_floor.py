"""The memory floor of a replica's apply: its reads and writes of the weights alone.

    python benchmarks/bench_floor.py [--params 0.63e9] [--density 0.02]
                                     [--replicas 2] [--reps 5]

What issue 20's protocol must touch, with nothing decoded, hashed or checked: for a
Qwen-like bf16 state (benchmarks/emulator.py shapes) and ``--density`` changed
elements per tensor at uniform positions (sorted, as a delta's are), each of
``--replicas`` processes (a state of its own, all started together, one core each)
times:

- gather: the old contents at the changed positions (the proof's read), with the
  replica's own prefetched gather (``mixsum_jit.gather``);
- write: the new contents written and read back block by block, with the replica's
  own confirmed write (``confirmed_jit.write_confirmed``);
- gather, then write: both passes, as the protocol orders them (prove everything,
  then write);
- one pass: read, modify and write each changed element once (what a protocol
  that wrote before proving, and rolled back on a mismatch, would need).

Each figure is the slowest replica of a round (the sync waits for every replica),
best of ``--reps`` rounds, against the reference ``bench_e2e`` uses
(``copy_reference``: one ``shutil.copyfile`` of a file of the state's bytes, page
cache warm, the copy deleted after each, best of ``--reps``). Memory bandwidth of this machine (one
and two threads, plain sequential reads and copies of 1 GiB) is printed too.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numba  # type: ignore[import-untyped]
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_e2e import copy_reference
from benchmarks.emulator import qwen_like_shapes
from pipeline.format.hashes.mixsum_jit import gather
from pipeline.intrinsics_jit import AHEAD, prefetch_write
from pipeline.targets.confirmed_jit import write_confirmed

PASSES = ("gather", "write", "gather, then write", "each tensor: gather, then write", "one pass")


@numba.njit(cache=True, nogil=True)  # type: ignore[untyped-decorator,misc]
def one_pass(held: Any, positions: Any) -> int:
    """held[p] += 1 at every position, each line requested AHEAD positions early."""
    n = positions.size
    for k in range(n):
        if k + AHEAD < n:
            prefetch_write(held, positions[k + AHEAD])
        held[positions[k]] += np.uint16(1)
    return int(n)


def positions_for(numel: int, density: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted distinct positions, each element changed with probability ``density``."""
    gaps = rng.geometric(density, size=int(numel * density * 1.2) + 64)
    at = np.cumsum(gaps) - 1
    return at[at < numel].astype(np.int64)


def replica(
    index: int, args: argparse.Namespace, barrier: Barrier, out: Any, path: str | None
) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(index)
    held = []
    for _, shape in qwen_like_shapes(args.params):
        numel = int(np.prod(shape))
        held.append(
            (
                rng.integers(0, 1 << 16, numel, dtype=np.uint16),
                positions_for(numel, args.density, rng),
            )
        )
    if path is not None:  # the reference file: the same bytes as the state
        with open(path, "wb") as file:
            for t, _ in held:
                file.write(t.tobytes())
            file.flush()
            os.fsync(file.fileno())  # no write-back of it left to slow the reference copy
    # The state's contents are scratch: where the passes read and write is what is
    # timed, not what they write (the write passes reuse the last gather's values).
    scratch = max(p.size for _, p in held)
    diffs = np.ones(scratch, np.uint16)
    old = np.empty(scratch, np.uint16)
    new = np.empty(scratch, np.uint16)

    def gather_all() -> None:
        for t, p in held:
            gather(p, t, diffs[: p.size], old[: p.size], new[: p.size])

    def write_all() -> None:
        for t, p in held:
            write_confirmed(t, p, new[: p.size])

    def both() -> None:
        for t, p in held:  # the whole proof first, then every write
            gather(p, t, diffs[: p.size], old[: p.size], new[: p.size])
        write_all()

    def each() -> None:
        for t, p in held:  # each tensor proven, then written while its lines are warm
            gather(p, t, diffs[: p.size], old[: p.size], new[: p.size])
            write_confirmed(t, p, new[: p.size])

    def fused() -> None:
        for t, p in held:
            one_pass(t, p)

    work = dict(zip(PASSES, (gather_all, write_all, both, each, fused), strict=True))
    for f in work.values():  # compile and warm
        f()
    for _ in range(args.reps):
        for name, f in work.items():
            barrier.wait()
            started = time.perf_counter()
            f()
            out.put((name, index, time.perf_counter() - started))
    out.put(("changes", index, float(sum(p.size for _, p in held))))


def bandwidth() -> str:
    n = 1 << 27  # 1 GiB of int64
    a = torch.ones(n, dtype=torch.int64)
    b = torch.empty_like(a)
    b.copy_(a)
    figures = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        read = min(_timed(a.sum) for _ in range(5))
        copy = min(_timed(lambda: b.copy_(a)) for _ in range(5))
        figures.append(f"{threads} thread(s): read {8 * n / read / 1e9:.1f} GB/s, "
                       f"copy {8 * n / copy / 1e9:.1f} GB/s of data")  # fmt: skip
    return "; ".join(figures)


def _timed(f: Any) -> float:
    started = time.perf_counter()
    f()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.63e9)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs; {bandwidth()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as work:
        source = os.path.join(work, "state.bin")
        context = mp.get_context("spawn")
        barrier = context.Barrier(args.replicas)
        out = context.Queue()
        processes = [
            context.Process(
                target=replica, args=(i, args, barrier, out, source if i == 0 else None)
            )
            for i in range(args.replicas)
        ]
        for p in processes:
            p.start()
        times: dict[str, dict[int, list[float]]] = {name: {} for name in PASSES}
        changes = 0.0
        for _ in range(args.replicas * (args.reps * len(PASSES) + 1)):
            name, index, value = out.get()
            if name == "changes":
                changes += value
            else:
                times[name].setdefault(index, []).append(value)
        for p in processes:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a replica process failed (exit code {p.exitcode})")
        size = os.path.getsize(source)
        copy = copy_reference(Path(source), Path(work) / "copy.bin", args.reps)
    print(
        f"{size / 1e9:.2f} GB bf16 state, {changes / args.replicas / 1e6:.1f}M changes per "
        f"replica, {args.replicas} replica(s) at once; slowest replica, best of {args.reps}"
    )
    print("| pass | s | vs copy | ns per change |")
    print("| --- | ---: | ---: | ---: |")
    for name in PASSES:
        rounds = zip(*times[name].values(), strict=True)
        best = min(max(r) for r in rounds)
        per = best / (changes / args.replicas) * 1e9
        print(f"| {name} | {best:.3f} | {best / copy:.2f}x | {per:.1f} |")
    print(f"| reference: copy the checkpoint file once | {copy:.3f} | 1.00x | |")


if __name__ == "__main__":
    main()
