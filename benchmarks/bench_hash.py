"""Full content hashes against the machine's read bandwidth, in one run.

    python benchmarks/bench_hash.py [--params 0.63e9] [--reps 5]

A Qwen-shaped bf16 state (benchmarks/emulator.py shapes) is hashed whole, tensor by
tensor, as a bootstrap, a rebuild or a scrub pass does: mixsum-128 as the product
runs it (compiled loops on ``mixsum.THREADS`` threads), mixsum-128 on one thread,
xxh3-128 (one thread per tensor, as the product runs it), and, for the bandwidth,
one plain read of the same bytes on every CPU (a torch sum). Each figure is the
median of ``--reps`` passes (min and max beside it), in ns per element and GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.emulator import make_state, qwen_like_shapes
from pipeline.format.hashes import mixsum
from pipeline.format.hashes.hashing import content_hash


def timed(reps: int, work: Callable[[], object]) -> list[float]:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.63e9)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    state = list(make_state(qwen_like_shapes(args.params), seed=0).values())
    elements = sum(t.numel() for t in state)
    size = sum(t.nbytes for t in state)
    mixsum.full(state[-1][:4096])  # compiled (or loaded) before the clock
    threads = mixsum.THREADS

    def mixsum_one_thread() -> None:
        for t in state:
            mixsum.digest(_lanes_one_thread(t))

    def _lanes_one_thread(t: torch.Tensor) -> tuple[int, int]:
        flat = mixsum.int_flat(t).numpy()
        jit = mixsum.compiled()
        assert jit is not None
        out = jit.full_sum(flat.view(f"u{flat.itemsize}"), 0)
        return int(out[0]), int(out[1])

    def read() -> None:
        for t in state:
            flat = t.reshape(-1)
            words = flat.view(torch.int64) if t.nbytes % 8 == 0 else flat.view(torch.int16)
            words.sum()  # int64 words: a vector add per 8 bytes, bound by the reads

    torch.set_num_threads(os.cpu_count() or 1)

    def mixsum_as_run() -> None:
        for t in state:
            mixsum.full(t)

    def xxh3_as_run() -> None:
        for t in state:
            content_hash(t)

    cases: list[tuple[str, Callable[[], object]]] = [
        (f"mixsum-128, {threads} threads (as the product runs it)", mixsum_as_run),
        ("mixsum-128, 1 thread", mixsum_one_thread),
        ("xxh3-128, 1 thread per tensor (as the product runs it)", xxh3_as_run),
        (f"plain read, {os.cpu_count()} threads (torch sum)", read),
    ]
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs; {elements / 1e9:.2f}B bf16 elements, "
          f"{len(state)} tensors; median of {args.reps} (min-max)")  # fmt: skip
    print("| pass | s | ns per element | GB/s |")
    print("| --- | ---: | ---: | ---: |")
    medians = {}
    for label, work in cases:
        work()  # warm: pages, pools
        times = timed(args.reps, work)
        med = statistics.median(times)
        medians[label] = med
        print(f"| {label} | {med:.3f} ({min(times):.3f}-{max(times):.3f}) | "
              f"{med / elements * 1e9:.2f} | {size / med / 1e9:.1f} |", flush=True)  # fmt: skip
    labels = [label for label, _ in cases]
    print(f"mixsum-128 as run / xxh3-128 as run: {medians[labels[0]] / medians[labels[2]]:.1f}x; "
          f"mixsum-128 as run / the read: {medians[labels[0]] / medians[labels[3]]:.1f}x; "
          f"load {os.getloadavg()}")  # fmt: skip


if __name__ == "__main__":
    main()
