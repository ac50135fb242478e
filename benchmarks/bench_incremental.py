"""Replica apply at a fixed number of changed elements while the model grows.

    python benchmarks/bench_incremental.py [--params 36e6,0.6e9] [--changes 2e6]
                                           [--device cpu] [--reps 3] [--moe]

For each size a Qwen-shaped bf16 state (benchmarks/emulator.py shapes; the 36M one
with a 16k vocabulary and hidden 512; with ``--moe``, Qwen3-MoE-like shapes of 128
experts a layer, many small tensors) gets ``--changes`` changed elements spread
over every tensor in proportion to its size (+-1 or +-2 in the integer view), one
delta object through the real codec, and a manifest hashed with each content hash;
and the delta back. A torch target holding the base applies them in turn with
``verify="touched"`` (decode + proof + write + read back), after the held hashes
are known (the bootstrap's full proof, untimed): xxh3-128 re-reads every touched
tensor, mixsum-128 reads the changed positions only. The state is held once (a
2.4B one is 4.8 GB), plus a second copy while the reference, a warm copy of the
state's bytes into buffers copied to before, is measured, and one while each
delta is encoded (the encoder holds every pair of an object). Best of ``2 * --reps``
applies and ``--reps`` copies per figure (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulator import make_state, moe_like_shapes, qwen_like_shapes

from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta, read_delta
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.hashing import sha256_bytes
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


def shapes_for(params: float, moe: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    if moe:
        return list(moe_like_shapes(params))
    if params < 100e6:
        return list(qwen_like_shapes(params, vocab=16384, hidden=512))
    return list(qwen_like_shapes(params))


def changed_pairs(
    base: dict[str, torch.Tensor],
    changes: int,
    seed: int,
    hashes: dict[str, dict[str, str]] | None = None,
    *,
    backwards: bool = False,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, base, new) with ``changes`` changed elements spread over every tensor in
    proportion to its size (+-1 or +-2 in the integer view), one new tensor at a time
    (each tensor's changes come from its own seed, so a second call gives the same
    ones). ``backwards``: (name, new, base), the
    delta back. ``hashes[algorithm][name]`` gets each new tensor's content hash."""
    total = sum(t.numel() for t in base.values())
    for index, (name, t) in enumerate(base.items()):
        rng = np.random.default_rng([seed, index])
        flat = t.reshape(-1).view(torch.int16).clone()
        count = max(1, round(changes * t.numel() / total))  # every tensor touched
        where = torch.from_numpy(rng.choice(t.numel(), min(count, t.numel()), replace=False))
        steps = torch.from_numpy(rng.choice(np.array([-2, -1, 1, 2], np.int16), where.numel()))
        flat[where] += steps
        new = flat.view(torch.bfloat16).view(t.shape)
        for algorithm, out in (hashes or {}).items():
            out[name] = content_hashes.get(algorithm).full(new)
        yield (name, new, t) if backwards else (name, t, new)


def manifest_for(
    data: bytes,
    parent: dict[str, str],
    child: dict[str, str],
    specs: dict[str, torch.Tensor],
    algorithm: str,
    version: int,
) -> Manifest:
    """A delta manifest for one object ``data`` from the state hashed ``parent`` to the
    one hashed ``child`` (tensor name -> content hash by ``algorithm``)."""
    changed = {i.name: i.changed for i in read_delta(data, object_name="part-00000").tensors}
    entries = [
        TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), child[n], "part-00000", changed[n])
        for n, t in specs.items()
    ]
    parents = [TensorEntry(n, "", (), parent[n], "") for n in specs]
    return Manifest(
        run="bench",
        version=version,
        kind="delta",
        parent=version - 1,
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
    parser.add_argument(
        "--moe",
        action="store_true",
        help="Qwen3-MoE-like shapes (128 experts a layer: many small tensors) instead of "
        "dense Qwen-like ones; at least 0.4B parameters",
    )
    args = parser.parse_args()
    print(f"load {os.getloadavg()}, {os.cpu_count()} CPUs, device {args.device}", flush=True)
    print("| params | tensors | changed | copy s | xxh3-128 apply s | mixsum-128 apply s | "
          "mixsum / copy |")  # fmt: skip
    print("| --- | ---: | --- | --- | --- | --- | --- |")
    for params in (float(p) for p in args.params.split(",")):
        print(measure(params, args), flush=True)


def measure(params: float, args: argparse.Namespace) -> str:
    """One table row: a state of about ``params`` parameters, held once (plus a copy
    for the reference while that is measured, and one while each delta is encoded)."""
    held = make_state(shapes_for(params, args.moe), seed=0)
    if args.device != "cpu":
        held = {n: t.to(args.device) for n, t in held.items()}
    size = sum(t.numel() for t in held.values())
    spare = {n: torch.empty_like(t) for n, t in held.items()}

    def copy() -> float:  # into memory already touched: a warm copy
        started = time.perf_counter()
        for n, t in held.items():
            spare[n].copy_(t)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started

    reference = best(args.reps + 1, copy)  # the first one warms the buffers
    spare.clear()
    names = (content_hashes.XXH3, content_hashes.MIXSUM)
    host = {n: t.cpu() for n, t in held.items()}  # (the same tensors on a CPU run)
    base_hashes = {a: {n: content_hashes.get(a).full(t) for n, t in host.items()} for a in names}
    new_hashes: dict[str, dict[str, str]] = {a: {} for a in names}
    # The delta there and the one back: each apply of one undoes the other's, so one
    # held copy serves every repetition.
    there = encode_delta(changed_pairs(host, int(args.changes), 1, new_hashes), 1)
    again = encode_delta(changed_pairs(host, int(args.changes), 1, backwards=True), 1)
    manifests = {
        a: (
            manifest_for(there, base_hashes[a], new_hashes[a], host, a, 1),
            manifest_for(again, new_hashes[a], base_hashes[a], host, a, 2),
        )
        for a in names
    }
    applies: dict[str, float] = {}
    for algorithm, (forward, backward) in manifests.items():
        target = TorchTarget(held)
        target.hashes(algorithm=algorithm)  # the bootstrap's full proof (untimed)
        times = []
        for _ in range(args.reps):
            for manifest, data in ((forward, there), (backward, again)):
                started = time.perf_counter()
                target.apply_delta(manifest, {"part-00000": data}, "touched")
                times.append(time.perf_counter() - started)
        applies[algorithm] = min(times)
    mix = applies[content_hashes.MIXSUM]
    return (
        f"| {size / 1e6:.0f}M | {len(held)} | {int(args.changes):,} | {reference:.3f} "
        f"| {applies[content_hashes.XXH3]:.3f} | {mix:.3f} | {mix / reference:.2f}x |"
    )


if __name__ == "__main__":
    main()
