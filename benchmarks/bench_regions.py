"""What a box costs against a flat range: the content hash of a rank's piece, and the
incremental update of a 2% change, for a tensor split over ranks by rows (FSDP2,
Shard(0): flat ranges) and by columns (tensor parallel, Shard(1): boxes).

    python benchmarks/bench_regions.py --rows 4096 --cols 4096 --ranks 8

Minimum of ``--repeats`` runs per task, tasks taking turns, one process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.regions import Region

ALG = content_hashes.get(content_hashes.MIXSUM)


def _timed(task: Callable[[], object]) -> float:
    start = time.perf_counter()
    task()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fraction", type=float, default=0.02)
    args = parser.parse_args()
    shape = (args.rows, args.cols)
    whole = torch.randn(shape).to(torch.bfloat16)
    rows, cols = args.rows // args.ranks, args.cols // args.ranks
    regions = {
        "rows (flat range)": Region.flat(whole.numel(), 0, rows * args.cols),
        "columns (box)": Region(shape, (0, 0), (args.rows, cols)),
    }
    pieces = {k: r.take(whole).clone() for k, r in regions.items()}
    rng = np.random.default_rng(0)
    n = pieces["rows (flat range)"].numel()
    changed = np.sort(rng.choice(n, int(n * args.fraction), replace=False)).astype(np.int64)
    diffs = rng.integers(-3, 4, changed.size).astype(np.int16)
    held = {k: ALG.piece(p, regions[k]) for k, p in pieces.items()}
    tasks: dict[str, Callable[[], object]] = {}
    for k, p in pieces.items():
        flat = mixsum.int_flat(p)
        tasks[f"hash, {k}"] = lambda p=p, k=k: ALG.piece(p, regions[k])
        tasks[f"update 2%, {k}"] = lambda f=flat, k=k: ALG.gathered(
            held[k], f, changed, diffs, regions[k]
        )
    best = dict.fromkeys(tasks, float("inf"))
    for _ in range(args.repeats):
        for name, task in tasks.items():
            best[name] = min(best[name], _timed(task))
    print(f"tensor {list(shape)} bf16 over {args.ranks} ranks: a piece of {n:,} elements")
    for name, seconds in best.items():
        print(f"{name:32s} {seconds * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
