"""Anchors: size with and without compression, write time, bootstrap time.

    python benchmarks/bench_anchor.py [--params 0.3e9] [--reps 3]

A Qwen-shaped bf16 state (benchmarks/emulator.py) is published as an anchor
with the real ``publish_anchor`` into a local folder store (best of ``--reps``
fresh runs), and a RolloutNode with a torch target bootstraps from it (every
tensor's content hash checked). The reference is copying the same bytes as one
file. Compression is measured, not shipped: the anchor objects stay plain
safetensors; the table gives what zstd achieves on the raw bytes and on the
bf16 exponent plane alone (sign and mantissa bits are close to random), and the
entropy bound of that split (1 + H(exponent) + 7 bits per element).
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
from pipeline.publish import publish_anchor
from pipeline.rollout import RolloutNode
from pipeline.store.file import FileStore
from pipeline.synthetic import save_state
from pipeline.targets.torch import TorchTarget
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.3e9)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=512)
    args = parser.parse_args()
    state = make_state(qwen_like_shapes(args.params), seed=0)
    params = sum(t.numel() for t in state.values())
    ratios = compression(state, 16 << 20)
    writes, boots, copies = [], [], []
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
            store = FileStore(work / f"store{rep}")
            start = time.perf_counter()
            manifest = publish_anchor(
                store, "a", 0, state.items(), parent=None, reason="bench",
                part_bytes=args.part_mib << 20,
            )  # fmt: skip
            writes.append(time.perf_counter() - start)
            target = TorchTarget({n: torch.empty_like(t) for n, t in state.items()})
            node = RolloutNode(store, "a", target, node_id="boot")
            start = time.perf_counter()
            assert node.step_once() == 0, node.last_error
            boots.append(time.perf_counter() - start)
            node.close()
            for name, tensor in target.export():
                assert torch.equal(bits(tensor), bits(state[name])), name
            shutil.rmtree(work / f"store{rep}")
            print(f"rep {rep}: write {writes[-1]:.2f} s, bootstrap {boots[-1]:.2f} s, "
                  f"copy {copies[-1]:.2f} s", flush=True)  # fmt: skip
    copy = min(copies)
    print()
    print(f"{params / 1e9:.2f}B bf16 parameters, anchor {manifest.total_bytes / 1e6:.0f} MB in "
          f"{len(manifest.objects)} objects; best of {args.reps}; bootstrap bit-exact")  # fmt: skip
    print("| figure | value | vs raw / vs copy |")
    print("|---|---:|---:|")
    print(f"| anchor bytes (plain safetensors) | {manifest.total_bytes / 1e6:.0f} MB "
          f"| {manifest.total_bytes / size:.3f} |")  # fmt: skip
    for key, label in [("zstd_raw", "zstd -3 of the raw bytes"),
                       ("zstd_exponent_plane", "zstd -3 of the exponent plane + raw sign/mantissa"),
                       ("entropy_bound", "entropy bound: 8 raw bits + H(exponent)")]:  # fmt: skip
        print(f"| {label} | {ratios[key] * size / 1e6:.0f} MB | {ratios[key]:.3f} |")
    print(f"| exponent entropy | {ratios['exponent_entropy_bits']:.2f} bits | |")
    print(f"| anchor write (hash, serialise, store) | {min(writes):.2f} s "
          f"| {min(writes) / copy:.2f}x |")  # fmt: skip
    print(f"| bootstrap (fetch, check, load) | {min(boots):.2f} s | {min(boots) / copy:.2f}x |")
    print(f"| reference: copy the checkpoint file | {copy:.2f} s | 1x |")
    assert math.isfinite(copy)


if __name__ == "__main__":
    main()
