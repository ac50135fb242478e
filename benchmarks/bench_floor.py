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

The diff job's floor is one read of base and new: two files of the state's bytes,
each read once through a fresh mapping on every CPU. The whole sync's floor is that
read plus the replica's "gather, then write". ``bench_e2e`` measures the same floor
in its own run (``measure``) and gives its figures as ratios to it.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import numba  # type: ignore[import-untyped]
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def copy_reference(src: Path, scratch: Path, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        shutil.copyfile(src, scratch)
        times.append(time.perf_counter() - start)
        scratch.unlink()
    return min(times)


def positions_for(numel: int, density: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted distinct positions, each element changed with probability ``density``."""
    gaps = rng.geometric(density, size=int(numel * density * 1.2) + 64)
    at = np.cumsum(gaps) - 1
    return at[at < numel].astype(np.int64)


def replica(
    index: int,
    params: float,
    density: float,
    barrier: Barrier,
    orders: Any,
    out: Any,
    path: str | None,
) -> None:
    """A replica's process: its state, then one round of the passes named by each
    order (each pass started together with the other replicas') until None comes."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(index)
    held = []
    for _, shape in qwen_like_shapes(params):
        numel = int(np.prod(shape))
        held.append(
            (
                rng.integers(0, 1 << 16, numel, dtype=np.uint16),
                positions_for(numel, density, rng),
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
    out.put(("changes", index, float(sum(p.size for _, p in held))))
    while (names := orders.get()) is not None:
        for name in names:
            barrier.wait()
            started = time.perf_counter()
            work[name]()
            out.put((name, index, time.perf_counter() - started))


class Rig:
    """``replicas`` replica processes holding their states, for rounds of the passes
    (``round``) whenever the caller asks: ``bench_e2e`` measures the floor between its
    versions, so that both see the same load. The first replica writes the state's
    bytes to ``path``, if given (the copy reference and the read floor use it)."""

    def __init__(
        self, params: float, density: float, replicas: int, path: Path | None = None
    ) -> None:
        context = mp.get_context("spawn")
        barrier = context.Barrier(replicas)
        self._out = context.Queue()
        self._orders = [context.Queue() for _ in range(replicas)]
        self._processes = [
            context.Process(
                target=replica,
                args=(i, params, density, barrier, self._orders[i], self._out,
                      str(path) if i == 0 and path is not None else None),
            )
            for i in range(replicas)
        ]  # fmt: skip
        for p in self._processes:
            p.start()
        self.changes = sum(self._get()[2] for _ in self._processes) / replicas

    def _get(self) -> tuple[str, int, float]:
        while True:
            try:
                return self._out.get(timeout=5)  # type: ignore[no-any-return]
            except queue.Empty:
                failed = [p.exitcode for p in self._processes if p.exitcode not in (None, 0)]
                if failed:
                    raise SystemExit(f"a replica process failed (exit code {failed[0]})") from None

    def round(self, names: tuple[str, ...] = PASSES) -> dict[str, float]:
        """One round of each pass in ``names``: the slowest replica's time of each."""
        for orders in self._orders:
            orders.put(names)
        times: dict[str, float] = dict.fromkeys(names, 0.0)
        for _ in range(len(names) * len(self._processes)):
            name, _, took = self._get()
            times[name] = max(times[name], took)
        return times

    def close(self) -> None:
        for orders in self._orders:
            orders.put(None)
        for p in self._processes:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a replica process failed (exit code {p.exitcode})")

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


@dataclass
class Floor:
    """The floor figures of one measurement: per pass, the slowest replica of a round,
    best of the rounds (s); the diff job's read of base and new (s); the copy (s)."""

    passes: dict[str, float]
    read_s: float
    copy_s: float
    size: int
    changes: float  # per replica
    replicas: int
    reps: int

    @property
    def replica_s(self) -> float:
        """The replica's floor: the protocol's two passes (prove everything, then write)."""
        return self.passes["gather, then write"]

    @property
    def sync_s(self) -> float:
        """The whole sync's floor: the diff job's read, then the replica's floor."""
        return self.read_s + self.replica_s

    def table(self) -> str:
        lines = [
            f"{self.size / 1e9:.2f} GB bf16 state, {self.changes / 1e6:.1f}M changes per "
            f"replica, {self.replicas} replica(s) at once; slowest replica, best of {self.reps}",
            "| pass | s | vs copy | ns per change |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, best in self.passes.items():
            per = best / self.changes * 1e9
            lines.append(f"| {name} | {best:.3f} | {best / self.copy_s:.2f}x | {per:.1f} |")
        lines.append(
            f"| the diff job's read: base and new, mapped, on {os.cpu_count()} threads "
            f"| {self.read_s:.3f} | {self.read_s / self.copy_s:.2f}x | |"
        )
        lines.append(f"| reference: copy the checkpoint file once | {self.copy_s:.3f} | 1.00x | |")
        return "\n".join(lines)


def read_floor(paths: list[Path], reps: int) -> float:
    """One read of every file through a fresh mapping (as the diff job reads base and
    new), on every CPU's thread; best of ``reps``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    times = []
    try:
        for _ in range(reps):
            started = time.perf_counter()
            for path in paths:
                with (
                    open(path, "rb") as file,
                    mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m,
                ):
                    view = np.frombuffer(m, np.int64, len(m) // 8)
                    torch.from_numpy(view).sum()
                    del view
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return min(times)


def measure(params: float, density: float, replicas: int, reps: int) -> Floor:
    """The floor of a sync of a ``params`` bf16 state at ``density`` to ``replicas``:
    each pass's best round of ``reps``."""
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as work:
        source = Path(work) / "state.bin"
        with Rig(params, density, replicas, source) as rig:
            rounds = [rig.round() for _ in range(reps)]
            changes = rig.changes
        size = source.stat().st_size
        new = Path(work) / "new.bin"
        shutil.copyfile(source, new)
        read_s = read_floor([source, new], reps)
        new.unlink()
        copy = copy_reference(source, Path(work) / "copy.bin", reps)
    passes = {name: min(r[name] for r in rounds) for name in PASSES}
    return Floor(passes, read_s, copy, size, changes, replicas, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.63e9)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs; {bandwidth()}", flush=True)
    found = measure(args.params, args.density, args.replicas, args.reps)
    print(found.table())
    print(
        f"floor of a whole sync (the diff job's read, then gather, then write): "
        f"{found.sync_s:.3f} s; load {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
