"""Anchors: size with and without compression, write time, bootstrap time.

    python benchmarks/bench_anchor.py [--params 0.3e9] [--reps 3]

A Qwen-shaped bf16 state (benchmarks/emulator.py) is published as an anchor
with the real ``publish_anchor`` into a local folder store, once per anchor
format (``none``: plain safetensors; ``zstd``: the byte-plane format of
pipeline/codec/anchor.py), and a RolloutNode with a torch target bootstraps
from each (every tensor's content hash checked, then compared bit for bit);
best of ``--reps`` fresh stores. The reference is copying the same bytes as one
file. A second table gives what zstd achieves on a sample of the raw bytes and
on the bf16 exponent plane alone (sign and mantissa bits are close to random),
and the entropy bound of that split (1 + H(exponent) + 7 bits per element).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulator import make_state, qwen_like_shapes
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import save_state
from tests.pipeline_helpers import bits


def compression(state: dict[str, torch.Tensor], sample_elems: int) -> dict[str, float]:
    """Sizes relative to raw bf16, on an evenly spread sample of every tensor."""
    parts = []
    for t in state.values():
        flat = t.reshape(-1).view(torch.int16)
        stride = max(1, flat.numel() * len(state) // sample_elems)
        parts.append(flat[::stride])
    sample = torch.cat(parts).numpy().view(np.uint16)
    raw = sample.tobytes()
    exponent = ((sample >> 7) & 0xFF).astype(np.uint8)
    rest_bits = 8  # sign + 7 mantissa bits, stored as they are
    counts = np.bincount(exponent, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    h_exp = float(-(p * np.log2(p)).sum())
    z = zstandard.ZstdCompressor(level=3)
    zstd_raw = len(z.compress(raw)) / len(raw)
    zstd_exp = (len(z.compress(exponent.tobytes())) + sample.size * rest_bits / 8) / len(raw)
    return {
        "zstd_raw": zstd_raw,
        "zstd_exponent_plane": zstd_exp,
        "entropy_bound": (rest_bits + h_exp) / 16,
        "exponent_entropy_bits": h_exp,
    }


def measure(
    state: dict[str, torch.Tensor], work: Path, method: str, rep: int, part_bytes: int
) -> tuple[int, int, float, float]:
    """One anchor written with ``method`` and one bootstrap from it, checked bit for bit:
    (bytes, objects, write s, bootstrap s)."""
    store = FileStore(work / f"store-{method}-{rep}")
    start = time.perf_counter()
    manifest = publish_anchor(
        store,
        "a",
        0,
        state.items(),
        PublishOptions(part_bytes=part_bytes, anchor_compression=method),
        parent=None,
        reason="bench",
    )
    write = time.perf_counter() - start
    target = TorchTarget({n: torch.empty_like(t) for n, t in state.items()})
    node = RolloutNode(store, "a", target, NodeOptions(node_id="boot", progress=False))
    start = time.perf_counter()
    assert node.step_once() == 0, node.last_error
    boot = time.perf_counter() - start
    node.close()
    for name, tensor in target.export():
        assert torch.equal(bits(tensor), bits(state[name])), name
    shutil.rmtree(work / f"store-{method}-{rep}")
    return manifest.total_bytes, len(manifest.objects), write, boot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.3e9)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=512)
    args = parser.parse_args()
    state = make_state(qwen_like_shapes(args.params), seed=0)
    params = sum(t.numel() for t in state.values())
    ratios = compression(state, 16 << 20)
    methods = ("none", "zstd")
    sizes: dict[str, int] = {}
    objects: dict[str, int] = {}
    writes: dict[str, list[float]] = {m: [] for m in methods}
    boots: dict[str, list[float]] = {m: [] for m in methods}
    copies = []
    with tempfile.TemporaryDirectory(prefix="bench-anchor-") as tmp:
        work = Path(tmp)
        ckpt = work / "ckpt.safetensors"
        save_state(state, ckpt)
        size = ckpt.stat().st_size
        for rep in range(args.reps):
            start = time.perf_counter()
            shutil.copyfile(ckpt, work / "copy.tmp")
            copies.append(time.perf_counter() - start)
            (work / "copy.tmp").unlink()
            for method in methods:
                nbytes, nobj, write, boot = measure(state, work, method, rep, args.part_mib << 20)
                sizes[method], objects[method] = nbytes, nobj
                writes[method].append(write)
                boots[method].append(boot)
                print(f"rep {rep} {method}: {nbytes / 1e6:.0f} MB, write {write:.2f} s, "
                      f"bootstrap {boot:.2f} s", flush=True)  # fmt: skip
            print(f"rep {rep}: copy {copies[-1]:.2f} s", flush=True)
    copy = min(copies)
    none, zstd = (min(writes[m]) for m in methods)
    boot_none, boot_zstd = (min(boots[m]) for m in methods)
    print()
    print(f"{params / 1e9:.2f}B bf16 parameters, {size / 1e6:.0f} MB checkpoint, "
          f"{objects['none']} part objects; best of {args.reps}; "
          "every bootstrap bit-exact")  # fmt: skip
    print("| figure | none (plain safetensors) | zstd (byte planes) | zstd / none |")
    print("|---|---:|---:|---:|")
    print(f"| anchor bytes | {sizes['none'] / 1e6:.0f} MB ({sizes['none'] / size:.3f}) "
          f"| {sizes['zstd'] / 1e6:.0f} MB ({sizes['zstd'] / size:.3f}) "
          f"| {sizes['zstd'] / sizes['none']:.3f} |")  # fmt: skip
    print(f"| anchor write (`publish_anchor`: hash, encode, store) | {none:.2f} s "
          f"({none / copy:.1f}x copy) | {zstd:.2f} s ({zstd / copy:.1f}x copy) "
          f"| {zstd / none:.2f} |")  # fmt: skip
    print(f"| bootstrap (`RolloutNode`: fetch, decode, check every hash, load) "
          f"| {boot_none:.2f} s ({boot_none / copy:.1f}x copy) "
          f"| {boot_zstd:.2f} s ({boot_zstd / copy:.1f}x copy) "
          f"| {boot_zstd / boot_none:.2f} |")  # fmt: skip
    print(f"| reference: copy the checkpoint file | {copy:.2f} s | | |")
    print()
    print("Compressibility of the raw bf16 bytes (a sample), for comparison:")
    print("| figure | vs raw |")
    print("|---|---:|")
    for key, label in [("zstd_raw", "zstd -3 of the raw bytes"),
                       ("zstd_exponent_plane", "zstd -3 of the exponent plane + raw sign/mantissa"),
                       ("entropy_bound", "entropy bound: 8 raw bits + H(exponent)")]:  # fmt: skip
        print(f"| {label} | {ratios[key]:.3f} |")
    print(f"| exponent entropy | {ratios['exponent_entropy_bits']:.2f} bits |")
    assert math.isfinite(copy)


if __name__ == "__main__":
    main()
