"""Codec size and speed on realistic updates from the synthetic generator.

    python benchmarks/bench_codec.py [--preset medium] [--lr 1e-6] [--steps 3] [--reps 5]
                                     [--device cpu]

Takes ``--steps`` optimizer steps and measures the delta of the last one, so
the optimizer is past its first, unusually dense step. Prints bytes per changed
element for every codec level and reference formats, ratios to the
information bound, the container's own bytes, and timings against
``torch.clone`` of the same weights
(both its median, mostly paying page faults for fresh memory, and its fastest,
warm run). ``apply_to`` decodes straight into the weights; ``decode+apply_patch``
materialises the patch first. Each level-3 task runs right after its level-1
counterpart in every round, and the ratio of each such pair is reported too (median,
min and max over the rounds): on a machine whose speed drifts, a ratio of two
minimums taken seconds apart can move by more than a change does. "Level 3's read
floor" times only what its walk cannot skip, a compare of every block of the base of
each bucketed tensor, against level 1's ``apply_to`` in the same round.
``--device cuda`` puts base, new and the weights written into on the GPU (the
clone reference too) and synchronises the device before each time is taken; the
two-thread walk is CPU-only and left out there, as are level 3's timings of the
largest tensor with its chunks decoded on 1, 2 and 4 threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_apply import sync
from pipeline.codec import apply_patch, encode_delta, read_delta
from pipeline.codec.dtypes import BY_DTYPE
from pipeline.codec.level3 import chunked
from pipeline.codec.tensorcodec import roles
from pipeline.targets.walking import Walk, apply_walks
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator

State = dict[str, torch.Tensor]
COPY_INTO = "copy_ into preallocated weights"
FLOOR = "level 3's read floor (bucket masks)"
# Level-3 tasks and the level-1 task each is compared with (run just before it).
PAIRS = (
    ("diff+encode, level 3", "diff+encode, level 1, compiled"),
    ("apply_to, level 3", "apply_to, level 1, compiled"),
    ("decode+apply_patch, level 3", "decode+apply_patch, level 1, compiled"),
    (FLOOR, "apply_to, level 1, compiled"),
)


def read_floor_task(obj: Any, weights: list[State]) -> Callable[[], object]:
    """What level 3's walk cannot do without: one vector compare of every block of
    64 base elements of each bucketed tensor against its first bound, one thread,
    nothing decoded or written (into fresh weights, as ``apply_to``)."""
    import numba  # type: ignore[import-untyped]

    from pipeline.codec.level3.chunked_jit import below_mask, popcount

    @numba.njit(nogil=True)  # type: ignore[misc]
    def members(base: Any, bound: Any, magnitude: Any) -> Any:
        total = np.uint64(0)
        for i in range(0, base.size - 63, 64):
            total += popcount(below_mask(base, i, bound, magnitude))
        return total

    walked = []
    for record in obj.tensors:
        layout = obj._records[record.name].layout
        if record.changed and layout is not None and layout.groups > 1:
            info = obj._records[record.name].info
            bound = np.uint64(layout.bounds[0])
            walked.append((record.name, info, bound, np.uint64(chunked.magnitude_mask(info))))

    def run() -> object:
        targets = weights.pop()
        for name, info, bound, magnitude in walked:
            members(
                targets[name].view(info.view).view(-1).numpy().view(info.unsigned), bound, magnitude
            )
        return None

    run()  # compiled before timing
    return run


def log2_binomial(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def entropy_bits(values: np.ndarray) -> float:  # type: ignore[type-arg]
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(p * np.log2(p)).sum() * values.size)


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BY_DTYPE[t.dtype].view).reshape(-1)


def bound_and_references(base: State, new: State) -> dict[str, float]:
    """Information bound and reference formats, in bytes for the whole state."""
    bound_pos = bound_val = 0.0
    raw_index = {}
    gaps_bytes = 0
    for name in base:
        b, n = int_bits(base[name]), int_bits(new[name])
        positions = torch.nonzero(b != n).view(-1)
        k = positions.numel()
        bound_pos += log2_binomial(b.numel(), k) / 8
        diffs = n[positions].numpy().astype(np.int64) - b[positions].numpy().astype(np.int64)
        bound_val += entropy_bits(diffs) / 8
        raw_index[f"{name}.index"] = positions.to(torch.int32)
        raw_index[f"{name}.value"] = new[name].reshape(-1)[positions]
        gaps = np.diff(positions.numpy(), prepend=-1) - 1
        gaps_bytes += 2 * k + 4 * int((gaps >= 0xFFFF).sum()) + 2 * k
    return {
        "bound_positions": bound_pos,
        "bound_contents": bound_val,
        "raw_int32_bf16": float(len(safetensors.torch.save(raw_index))),
        "gaps_u16_bf16": float(gaps_bytes),
        "full_bf16": float(sum(2 * t.numel() for t in new.values())),
    }


def split_sizes(data: bytes) -> tuple[int, int]:
    """(position bytes, contents bytes) of a delta object, from its metadata; a
    ``chunked`` record's streams (positions and signs interleave) count as positions."""
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
    position_roles = {"unary", "fixed", "mask", "table", "bits"}
    pos = cont = 0
    for record in json.loads(meta["tensors"]):
        for role, size in record_streams(record).items():
            if role in position_roles:
                pos += size
            else:
                cont += size
    return pos, cont


def record_streams(record: dict[str, Any] | list[Any]) -> dict[str, int]:
    """Role -> size of a record, in the object form (level 1) or the compact
    array form (level 3)."""
    if isinstance(record, dict):
        return dict(record["streams"])
    names = roles(record[3], record[6]) or ()
    return dict(zip(names, record[5], strict=True))


def container_sizes(data: bytes) -> tuple[int, int, int]:
    """(whole header, the records' JSON, tensors with an entry) of a delta object: what
    the container costs beyond the streams."""
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
    records = json.loads(meta["tensors"])
    return 8 + header_len, len(meta["tensors"]), sum(1 for r in records if record_streams(r))


def interleaved_times(
    tasks: dict[str, Callable[[], object]], reps: int, device: str
) -> dict[str, list[float]]:
    """Seconds per run of each task; the tasks take turns, so that a busy machine
    slows them alike."""
    times: dict[str, list[float]] = {label: [] for label in tasks}
    for _ in range(reps):
        for label, task in tasks.items():
            sync(device)
            start = time.perf_counter()
            task()
            sync(device)
            times[label].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights live: cpu or cuda")
    args = parser.parse_args()
    on_cpu = args.device == "cpu"

    gen = UpdateGenerator(ModelConfig.preset(args.preset), lr=args.lr, seed=args.seed)
    base = gen.state()
    new = base
    for _ in range(args.steps):
        base, new = new, gen.step()
    numel = sum(t.numel() for t in new.values())
    changed = sum(int((int_bits(base[k]) != int_bits(new[k])).sum()) for k in new)

    refs = bound_and_references(base, new)
    bound = refs["bound_positions"] + refs["bound_contents"]
    base = {k: v.to(args.device) for k, v in base.items()}
    new = {k: v.to(args.device) for k, v in new.items()}
    pairs = [(name, base[name], new[name]) for name in new]
    objects = {level: encode_delta(pairs, level=level) for level in (1, 3)}

    def decode_apply(data: bytes, targets: State) -> None:
        obj = read_delta(data, object_name="bench")
        for name, tensor in targets.items():
            apply_patch(tensor, obj.decode(name, base[name]))

    def apply_in_place(data: bytes, targets: State) -> None:
        obj = read_delta(data, object_name="bench")
        for name, tensor in targets.items():
            obj.apply_to(name, tensor)

    def apply_on_two_threads(data: bytes, targets: State) -> None:
        """``apply_to`` of every changed tensor, split over two threads as the targets'
        walked writes are (pipeline/targets/walking.py)."""
        obj = read_delta(data, object_name="bench")
        walks = [Walk(i.name, obj, i.changed) for i in obj.tensors if i.changed]
        apply_walks(walks, targets.__getitem__, None)

    # Correctness of what is timed.
    appliers = [decode_apply, apply_in_place] + ([apply_on_two_threads] if on_cpu else [])
    for data in objects.values():
        for apply in appliers:
            targets = {k: v.clone() for k, v in base.items()}
            apply(data, targets)
            assert all(torch.equal(int_bits(targets[k]), int_bits(new[k])) for k in new)

    reps = args.reps
    spare = [{k: v.clone() for k, v in base.items()} for _ in range(9 * reps + 1)]

    def decode_task(data: bytes) -> Callable[[], object]:
        return lambda: decode_apply(data, spare.pop())

    def apply_to_task(data: bytes) -> Callable[[], object]:
        return lambda: apply_in_place(data, spare.pop())

    def two_threads_task(data: bytes) -> Callable[[], object]:
        return lambda: apply_on_two_threads(data, spare.pop())

    def encode_task(level: int) -> Callable[[], object]:
        return lambda: encode_delta(pairs, level=level)

    preallocated = {k: torch.empty_like(v) for k, v in new.items()}
    tasks: dict[str, Callable[[], object]] = {
        "torch clone of all weights": lambda: {k: v.clone() for k, v in new.items()},
        COPY_INTO: lambda: [preallocated[k].copy_(v) for k, v in new.items()],
    }
    # Level 3 right after level 1 in each round, so that each pair of times is taken on
    # the same machine (PAIRS below).
    tasks["diff+encode, level 1, compiled"] = encode_task(1)
    tasks["diff+encode, level 3"] = encode_task(3)
    tasks["apply_to, level 1, compiled"] = apply_to_task(objects[1])
    tasks["apply_to, level 3"] = apply_to_task(objects[3])
    if on_cpu:
        tasks[FLOOR] = read_floor_task(read_delta(objects[3], object_name="bench"), spare)
        tasks["apply_to on 2 threads, level 1, compiled"] = two_threads_task(objects[1])
    tasks["decode+apply_patch, level 1, compiled"] = decode_task(objects[1])
    tasks["decode+apply_patch, level 3"] = decode_task(objects[3])
    # The largest tensor alone, its chunks decoded on 1, 2 and 4 threads.
    # The largest tensor with the most changes (the embedding and the head tie in size).
    changes = {k: int((int_bits(base[k]) != int_bits(new[k])).sum()) for k in new}
    largest = max(new, key=lambda k: (new[k].numel(), changes[k]))
    level3 = read_delta(objects[3], object_name="bench")
    largest_spare = [base[largest].clone() for _ in range(3 * reps)]

    def largest_on(threads: int) -> Callable[[], object]:
        def run() -> object:
            saved = chunked.DECODE_THREADS
            chunked.DECODE_THREADS = threads
            try:
                return level3.apply_to(largest, largest_spare.pop())
            finally:
                chunked.DECODE_THREADS = saved

        return run

    if on_cpu:
        for threads in (1, 2, 4):
            tasks[f"largest tensor, level 3, {threads} thread(s)"] = largest_on(threads)
    load = os.getloadavg()
    times = interleaved_times(tasks, reps, args.device)
    t_clone = statistics.median(times["torch clone of all weights"])
    # The median clone mostly pays page faults for fresh memory; the fastest copy
    # (a clone that reused warm memory, or copy_ into preallocated weights) does not.
    t_warm = min(*times["torch clone of all weights"], *times[COPY_INTO])

    print(
        f"model: preset {args.preset}, {numel / 1e6:.1f}M parameters, lr {args.lr}, "
        f"step {args.steps}; changed {changed} ({100 * changed / numel:.2f}%)"
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}, weights on {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if not on_cpu else "")
    )
    print()
    print(f"{'format':<34}{'bytes':>12}{'B/changed':>11}{'x bound':>9}")
    rows = [
        ("level 1 (default)", float(len(objects[1]))),
        ("  of which positions", float(split_sizes(objects[1])[0])),
        ("  of which contents", float(split_sizes(objects[1])[1])),
        ("level 3 (chunked, buckets)", float(len(objects[3]))),
        ("  of which chunked streams", float(split_sizes(objects[3])[0])),
        ("  of which magnitudes", float(split_sizes(objects[3])[1])),
        ("int32 index + bf16, safetensors", refs["raw_int32_bf16"]),
        ("uint16/uint32 gaps + bf16", refs["gaps_u16_bf16"]),
        ("full bf16", refs["full_bf16"]),
        ("information bound", bound),
        ("  of which positions", refs["bound_positions"]),
        ("  of which contents", refs["bound_contents"]),
    ]
    for label, size in rows:
        print(f"{label:<34}{size:>12.0f}{size / changed:>11.3f}{size / bound:>9.3f}")
    print(f"largest tensor: {largest}, {new[largest].numel()} elements, {changes[largest]} changed")
    for level, data in objects.items():
        header_bytes, records, entries = container_sizes(data)
        print(
            f"container, level {level}: header {header_bytes} bytes (records JSON {records}) "
            f"for {len(new)} tensors, {entries} with an entry"
        )
    print()
    print(f"load average before timing: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    header = f"{'timing, ' + str(reps) + ' runs':<36}{'median s':>10}{'min s':>10}"
    print(f"{header}{'x clone':>9}{'x warm':>8}")
    for label, runs in times.items():
        median = statistics.median(runs)
        row = f"{label:<36}{median:>10.4f}{min(runs):>10.4f}"
        print(f"{row}{median / t_clone:>9.2f}{median / t_warm:>8.2f}")
    print(f"x clone: median / median clone; x warm: median / fastest copy ({t_warm:.4f} s)")
    pairs_timed = [(a, b) for a, b in PAIRS if a in times and b in times]
    if pairs_timed:
        print()
        print(f"{'level 3 / level 1, run by run':<36}{'median':>10}{'min':>10}{'max':>9}")
        for task_3, task_1 in pairs_timed:
            ratios = [x / y for x, y in zip(times[task_3], times[task_1], strict=True)]
            row = f"{task_3:<36}{statistics.median(ratios):>10.2f}{min(ratios):>10.2f}"
            print(f"{row}{max(ratios):>9.2f}")
        print("each ratio: a level-3 run over the level-1 run just before it, same round")


if __name__ == "__main__":
    main()
