"""Host memory and pause of a torch-target apply: decoded patches kept vs walked.

    python benchmarks/bench_apply_memory.py [--params 0.6e9] [--density 0.02] [--reps 3]
                                            [--hash mixsum-128|xxh3-128]

A bf16 state shaped like Qwen2.5-0.5B gets one emulated optimizer step (the update
emulator of bench_e2e.py, about 2% of elements changed); the delta is encoded with the
real codec into one object per 512 MiB part and described by a real manifest. Each
mode then applies it, in a fresh process, to a fresh copy of the base weights:
``patches`` keeps every decoded patch (the default below DELTASYNC_PATCH_MEMORY_MB),
``walked`` keeps none (``patch_memory_bytes=0``). Reported per mode: the peak resident
memory the apply added (VmHWM after the apply minus the resident size before it,
the peak reset through /proc/self/clear_refs), the apply time and the pause (time
under the target's lock). Every apply is checked bit for bit against the new state.
``--hash`` is the manifest's content hash: with mixsum-128 (new runs) the target holds
its tensors' hashes before the apply, as a node does after its bootstrap, and the apply
is O(changed); with xxh3-128 (schema-1 runs) the apply re-reads the touched tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.emulator import (  # noqa: E402
    UpdateEmulator,
    calibrated_profile,
    make_state,
    qwen_like_shapes,
)
from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta  # noqa: E402
from pipeline.format.hashes import content_hashes  # noqa: E402
from pipeline.format.hashes.hashing import sha256_bytes  # noqa: E402
from pipeline.format.manifest import (  # noqa: E402
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
)
from pipeline.publish.parts import plan_parts  # noqa: E402
from pipeline.targets.torch import TorchTarget  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def build(
    params: float, density: float, algorithm: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Manifest, dict[str, bytes]]:
    content_hash = content_hashes.get(algorithm).full
    base = make_state(qwen_like_shapes(params), seed=0)
    new = {n: t.clone() for n, t in base.items()}
    profile = calibrated_profile("small").tuned_for(new.values(), density)
    UpdateEmulator(profile, seed=1).step_(new)
    layout = plan_parts((n, t.numel() * t.element_size()) for n, t in new.items())
    objects: dict[str, bytes] = {}
    entries: list[TensorEntry] = []
    for key, names in layout:
        objects[key] = encode_delta((n, base[n], new[n]) for n in names)
        for n in names:
            changed = int((base[n].view(torch.int16) != new[n].view(torch.int16)).sum())
            entries.append(
                TensorEntry(
                    n,
                    dtype_name(new[n].dtype),
                    tuple(new[n].shape),
                    content_hash(new[n]),
                    key,
                    changed,
                )
            )
    parent = [TensorEntry(n, "", (), content_hash(base[n]), "") for n in base]
    manifest = Manifest(
        run="bench", version=1, kind="delta", parent=0, anchor=0,
        codec=CodecInfo(CODEC_NAME, CODEC_VERSION, 1),
        objects=tuple(ObjectEntry(k, len(d), sha256_bytes(d)) for k, d in objects.items()),
        tensors=tuple(entries), state_hash=compute_state_hash(entries), created=now_iso(),
        parent_state_hash=compute_state_hash(parent), content_hash=algorithm,
    )  # fmt: skip
    return base, new, manifest, objects


def one_mode(args: argparse.Namespace) -> None:
    """In this process: build, apply in ``args.mode`` ``args.reps`` times, print JSON."""
    base, new, manifest, objects = build(args.params, args.density, args.hash)
    budget = 0 if args.mode == "walked" else 1 << 40
    rows = []
    for _ in range(args.reps):
        held = {n: t.clone() for n, t in base.items()}
        target = TorchTarget(held, patch_memory_bytes=budget)
        if content_hashes.get(args.hash).incremental:
            target.hashes(algorithm=args.hash)  # held since the bootstrap's full proof
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM)
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        report = target.apply_delta(manifest, objects, "touched")
        elapsed = time.perf_counter() - start
        peak = _status_kib("VmHWM")
        for name, tensor in new.items():  # bit for bit, every tensor
            assert torch.equal(held[name].view(torch.int16), tensor.view(torch.int16)), name
        rows.append({"added_mib": (peak - before) / 1024, "apply_s": elapsed,
                     "pause_s": report.pause_s, "changed": report.changed})  # fmt: skip
        del held, target
    print(json.dumps({"mode": args.mode, "objects_mib": sum(map(len, objects.values())) / 2**20,
                      "rows": rows}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.6e9)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--hash",
        choices=[content_hashes.MIXSUM, content_hashes.XXH3],
        default=content_hashes.MIXSUM,
        help="the manifest's content hash (default: mixsum-128, as new runs)",
    )
    parser.add_argument("--mode", choices=["patches", "walked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        one_mode(args)
        return
    # A fixed mmap threshold: every large allocation is mapped fresh and unmapped when
    # freed, so the peak counts what the apply holds, not reuse of freed build memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for mode in ("patches", "walked"):
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--params", str(args.params),
             "--density", str(args.density), "--reps", str(args.reps), "--hash", args.hash],
            capture_output=True, text=True, check=True, env=env,
        )  # fmt: skip
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows = result["rows"]
        changed = rows[0]["changed"]
        added = statistics.median(r["added_mib"] for r in rows)
        print(
            f"{mode:8s} changed {changed:>11,}  objects {result['objects_mib']:7.1f} MiB  "
            f"peak added {added:7.1f} MiB ({added * 2**20 / changed:5.2f} B/changed)  "
            f"apply {statistics.median(r['apply_s'] for r in rows):.3f} s  "
            f"pause {statistics.median(r['pause_s'] for r in rows):.3f} s"
        )


if __name__ == "__main__":
    main()
