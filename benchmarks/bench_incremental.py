"""Replica apply at a fixed number of changed elements while the model grows.

    python benchmarks/bench_incremental.py [--params 36e6,0.6e9] [--changes 2e6]
                                           [--device cpu] [--reps 3]

For each size a Qwen-shaped bf16 state (benchmarks/emulator.py shapes; the 36M one
with a 16k vocabulary and hidden 512) gets ``--changes`` changed elements spread
over every tensor in proportion to its size (+-1 or +-2 in the integer view), one
delta object through the real codec, and a manifest hashed with each content hash.
A torch target holding the base applies it with ``verify="touched"`` (decode +
proof + write + read back), after the held hashes are known (the bootstrap's full
proof, untimed): xxh3-128 re-reads every touched tensor, mixsum-128 reads the
changed positions only. The reference is a warm copy of the state's bytes (into
buffers copied to before). Best of
``--reps`` per figure (the machine may be shared).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulator import make_state, qwen_like_shapes

from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta, read_delta
from pipeline.format import content_hashes
from pipeline.format.hashing import sha256_bytes
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
)
from pipeline.targets.torch import TorchTarget


def shapes_for(params: float) -> list[tuple[str, tuple[int, ...]]]:
    if params < 100e6:
        return list(qwen_like_shapes(params, vocab=16384, hidden=512))
    return list(qwen_like_shapes(params))


def changed_copy(base: dict[str, torch.Tensor], changes: int, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    total = sum(t.numel() for t in base.values())
    new: dict[str, torch.Tensor] = {}
    for name, t in base.items():
        flat = t.reshape(-1).view(torch.int16).clone()
        count = max(1, round(changes * t.numel() / total))  # every tensor touched
        where = torch.from_numpy(rng.choice(t.numel(), min(count, t.numel()), replace=False))
        steps = torch.from_numpy(rng.choice(np.array([-2, -1, 1, 2], np.int16), where.numel()))
        flat[where] += steps
        new[name] = flat.view(torch.bfloat16).view(t.shape)
    return new


def manifest_for(
    base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], data: bytes, algorithm: str
) -> Manifest:
    full = content_hashes.get(algorithm).full
    changed = {i.name: i.changed for i in read_delta(data, object_name="part-00000").tensors}
    entries = [
        TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), full(t), "part-00000", changed[n])
        for n, t in new.items()
    ]
    parents = [TensorEntry(n, "", (), full(t), "") for n, t in base.items()]
    return Manifest(
        run="bench",
        version=1,
        kind="delta",
        parent=0,
        anchor=0,
        codec=CodecInfo(CODEC_NAME, CODEC_VERSION, 1),
        objects=(ObjectEntry("part-00000", len(data), sha256_bytes(data)),),
        tensors=tuple(entries),
        state_hash=compute_state_hash(entries),
        created=now_iso(),
        parent_state_hash=compute_state_hash(parents),
        content_hash=algorithm,
    )


def best(reps: int, run: Callable[[], float]) -> float:
    times = []
    for _ in range(reps):
        times.append(run())
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="36e6,0.6e9")
    parser.add_argument("--changes", type=float, default=2e6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs, device {args.device}", flush=True)
    print("| params | changed | copy s | xxh3-128 apply s | mixsum-128 apply s | mixsum / copy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for params in (float(p) for p in args.params.split(",")):
        print(measure(params, args), flush=True)


def measure(params: float, args: argparse.Namespace) -> str:
    """One table row: a state of about ``params`` parameters."""
    base = make_state(shapes_for(params), seed=0)
    size = sum(t.numel() for t in base.values())
    new = changed_copy(base, int(args.changes), seed=1)
    data = encode_delta([(n, base[n], new[n]) for n in base], 1)
    names = (content_hashes.XXH3, content_hashes.MIXSUM)
    manifests = {a: manifest_for(base, new, data, a) for a in names}
    del new
    objects = {"part-00000": data}
    held = {n: t.to(args.device, copy=True) for n, t in base.items()}

    spare = {n: torch.empty_like(t) for n, t in held.items()}

    def copy() -> float:  # into memory already touched: a warm copy
        started = time.perf_counter()
        for n, t in held.items():
            spare[n].copy_(t)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def apply(manifest: Manifest) -> float:
        for n, t in base.items():  # back to the base (untimed)
            held[n].copy_(t)
        target = TorchTarget(held)
        target.hashes(algorithm=manifest.content_hash)  # the bootstrap's full proof
        started = time.perf_counter()
        target.apply_delta(manifest, objects, "touched")
        return time.perf_counter() - started

    applies = {a: best(args.reps, functools.partial(apply, m)) for a, m in manifests.items()}
    reference = best(args.reps + 1, copy)  # the first one warms the buffers
    mix = applies[content_hashes.MIXSUM]
    return (
        f"| {size / 1e6:.0f}M | {int(args.changes):,} | {reference:.3f} "
        f"| {applies[content_hashes.XXH3]:.3f} | {mix:.3f} | {mix / reference:.2f}x |"
    )


if __name__ == "__main__":
    main()
