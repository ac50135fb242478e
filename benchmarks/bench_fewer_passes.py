"""The two passes removed from the per-version path, each against what it replaced,
alternating in one process (so both see the same load).

    python benchmarks/bench_fewer_passes.py [--params 0.6e9] [--changes 2e6]
                                            [--diff-changes 12e6] [--reps 5]

- write: a replica's write and read-back of ``--changes`` positions spread over a
  Qwen-shaped bf16 state, as the compiled scatter then a separate compiled
  read-back, against one confirmed pass (pipeline/targets/confirmed.py);
- diff: one part's encode (level 1) plus its new mixsum-128 hashes with
  ``--diff-changes`` changes, as a second decode of the object and a gather, against
  the hashes taken in the encode's own scan (``on_changes``): with the base read
  again at the changed positions (the hook before 2026-12-02), and with the base
  contents the scan took (now); the encode alone is the floor. The hashes of the
  variants are checked equal;
- proof: a replica's proof of that delta (positions, old and new contents, new
  hashes), as a walk for the differences then a gather of the held contents
  (before 2026-12-02), against one walk that gathers them (``DeltaObject.gathered``).
  The hashes are checked equal to the diff's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_incremental import changed_pairs, shapes_for
from emulator import UniformEmulator, make_state

from pipeline.codec import encode_delta, read_delta
from pipeline.codec.compiled import kernels
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.publish.diff import scan_hasher
from pipeline.targets import confirmed_jit


def decoded_hashes(
    delta: Any,
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]],
    held: dict[str, str],
    algorithm: Any,
) -> dict[str, str]:
    """The replaced path: each changed tensor's new hash from a second decode of the
    object's streams and a gather of the base at the changed positions."""
    out: dict[str, str] = {}
    for name, base, _ in pairs:
        if delta.info(name).changed == 0:
            out[name] = held[name]
            continue
        found = delta.differences(name, base)
        assert found is not None, "level 1 objects carry their differences"
        out[name] = algorithm.gathered(held[name], mixsum.int_flat(base), *found, None)[0]
    return out


def row(name: str, times: list[float]) -> str:
    rest = times[1:] or times  # the first of each warms its code and buffers
    return f"| {name} | {min(rest):.3f} | {statistics.median(rest):.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.6e9)
    parser.add_argument("--changes", type=float, default=2e6)
    parser.add_argument("--diff-changes", type=float, default=12e6)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    held = make_state(shapes_for(args.params), seed=0)
    total = sum(t.numel() for t in held.values())
    rng = np.random.default_rng(0)
    spots = []
    for t in held.values():
        flat = t.view(torch.int16).view(-1).numpy().view(np.uint16)
        count = min(flat.size, max(1, round(args.changes * flat.size / total)))
        where = np.sort(rng.choice(flat.size, count, replace=False)).astype(np.int64)
        spots.append((flat, where, flat[where].copy()))  # writes the held contents again
    compiled = kernels.get()
    assert compiled is not None, "numba is needed"
    print(f"load {os.getloadavg()}, {len(held)} tensors, {total / 1e6:.0f}M elements")
    print("| write + read-back | best s | median s |\n| --- | --- | --- |")
    separate: list[float] = []
    fused: list[float] = []
    for _ in range(args.reps + 1):
        started = time.perf_counter()
        for flat, where, values in spots:
            compiled.scatter(flat, where, values)
        for flat, where, values in spots:
            assert compiled.first_difference(flat, where, values) < 0
        separate.append(time.perf_counter() - started)
        started = time.perf_counter()
        for flat, where, values in spots:
            assert confirmed_jit.write_confirmed(flat, where, values) == -1
        fused.append(time.perf_counter() - started)
    print(row("scatter, then a separate read-back", separate))
    print(row("one confirmed pass", fused), flush=True)

    algorithm = content_hashes.get(content_hashes.MIXSUM)
    parent = {n: algorithm.full(t) for n, t in held.items()}
    pairs = list(changed_pairs(held, int(args.diff_changes), 1))
    print("| encode + new hashes | best s | median s |\n| --- | --- | --- |")
    again: list[float] = []
    regather: list[float] = []
    scan: list[float] = []
    alone: list[float] = []
    bases = {name: base for name, base, _ in pairs}

    def regathering_hook() -> tuple[Any, dict[str, str]]:
        out: dict[str, str] = {}

        def hook(name: str, positions: Any, diffs: Any, old: Any) -> None:
            flat = mixsum.int_flat(bases[name])
            out[name] = algorithm.gathered(parent[name], flat, positions, diffs)[0]

        return hook, out

    for _ in range(args.reps + 1):
        started = time.perf_counter()
        data = encode_delta(pairs, 1)
        want = decoded_hashes(read_delta(data, object_name="p"), pairs, parent, algorithm)
        again.append(time.perf_counter() - started)
        started = time.perf_counter()
        hook, _, scanned = scan_hasher(pairs, parent, algorithm)
        data = encode_delta(pairs, 1, on_changes=hook)
        got = {name: scanned.get(name, parent[name]) for name, _, _ in pairs}
        scan.append(time.perf_counter() - started)
        assert got == want
        started = time.perf_counter()
        hook, scanned = regathering_hook()
        data = encode_delta(pairs, 1, on_changes=hook)
        got = {name: scanned.get(name, parent[name]) for name, _, _ in pairs}
        regather.append(time.perf_counter() - started)
        assert got == want
        started = time.perf_counter()
        encode_delta(pairs, 1)
        alone.append(time.perf_counter() - started)
    print(row("encode, then decode again + gather + hash", again))
    print(row("hashes in the encode's scan, the base read again", regather))
    print(row("hashes in the encode's scan, from the base it took", scan))
    print(row("encode alone (no hashes)", alone), flush=True)

    # The proof on bench_e2e's updates: a third of the changes +-2, so about half the
    # tensors keep sign-magnitude contents (walked) and half take byte planes.
    news = {n: t.clone() for n, t in held.items()}
    UniformEmulator(args.diff_changes / total, seed=2).step_(news)
    pairs = [(n, held[n], news[n]) for n in held]
    want = {n: algorithm.full(t) for n, t in news.items()}
    delta = read_delta(encode_delta(pairs, 1), object_name="p")
    walkable = sum(delta.gathered(n, b) is not None for n, b, _ in pairs)
    print(f"{walkable} of {len(pairs)} tensors walked")
    print("| replica proof | best s | median s |\n| --- | --- | --- |")
    two_passes: list[float] = []
    one_walk: list[float] = []

    def in_two_passes(name: str, base: torch.Tensor) -> str:
        found = delta.differences(name, base)
        if found is None:  # unchanged
            return parent[name]
        return algorithm.gathered(parent[name], mixsum.int_flat(base), *found)[0]

    def in_one_walk(name: str, base: torch.Tensor) -> str:
        walked = delta.gathered(name, base)
        if walked is None:  # unchanged, or not the walk's encoding
            return in_two_passes(name, base)
        at, new, old = walked
        return algorithm.updated(parent[name], at, old, new, base.element_size())

    for _ in range(args.reps + 1):
        for prove, times in ((in_two_passes, two_passes), (in_one_walk, one_walk)):
            started = time.perf_counter()
            digests = {name: prove(name, base) for name, base, _ in pairs}
            times.append(time.perf_counter() - started)
            assert digests == want
    print(row("walk for the differences, then gather + hash", two_passes))
    print(row("one walk gathering the held contents, then hash", one_walk))
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
