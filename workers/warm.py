"""Compile the kernels (numba) that publishing and applying versions use, before the
first version needs them.

numba compiles each kernel on its first call: 5-30 s on a new machine, virtual
environment or container, paid by the first version a diff worker publishes and the
first a node applies. Compiled once, they load from the kernel cache
(pipeline/kernel_cache.py) in well under a second. :func:`warm` runs the real paths
on a small synthetic run in a temporary folder store: an anchor and deltas published
from checkpoint files, then bootstrapped and applied by a torch target (with and
without memory for decoded patches). Its tensors make the codec pick every encoding
it has (sparse with small and large differences, bitmap, dense, unchanged; tensors
decoded alone and in batches), and every result is checked, so a broken build fails
here. `deltasync warm`, scripts/setup.sh, the images and `deltasync demo` (before its
clock starts) run it; rollout nodes and diff workers run it on a thread of their own
as they start (:func:`in_background`), so that the kernels are ready, or loaded,
before the first version comes.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch

from pipeline import kernel_cache, logs
from pipeline.codec import DEFAULT_LEVEL, LEVELS, encode_delta, read_delta
from pipeline.config import Settings
from pipeline.format.hashes import content_hashes
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.rollout.fetch import fetch_delta, stream_anchor
from pipeline.store.file import FileStore
from pipeline.targets.proving import SMALL_CHANGES
from pipeline.targets.torch import TorchTarget
from pipeline.testing import faults
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain

log = structlog.get_logger(__name__)

RUN = "warm"


def synthetic_states(
    count: int, dtype: torch.dtype = torch.bfloat16
) -> list[dict[str, torch.Tensor]]:
    """``count`` versions of a small state whose deltas use every encoding: sparse
    changes in a tensor with more than a proof batches (decoded alone) and in small
    ones (batched), by +-1 and +-2 with a few large differences (sign and magnitude)
    or by large ones only (byte planes); a tensor changed densely (bitmap), one
    changed in every element (dense), and one never changed."""
    generator = torch.Generator().manual_seed(0)
    # name: (shape, one element in how many changes, differences all large)
    plan = {
        "embed.weight": ((2 * SMALL_CHANGES + 4096, 20), 40, False),
        "layer.q.weight": ((96, 64), 40, False),
        "layer.k.weight": ((32, 64), 40, True),
        "layer.norm.weight": ((64,), 16, False),
        "layer.dense.weight": ((64, 64), 3, False),
        "layer.every.weight": ((256,), 1, False),
        "head.fixed.weight": ((16, 64), 0, False),
    }
    state = {
        name: (0.02 * torch.randn(shape, generator=generator)).to(dtype)
        for name, (shape, _, _) in plan.items()
    }
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    states = [{n: t.clone() for n, t in state.items()}]
    for _ in range(count - 1):
        for name, (_, every, large) in plan.items():
            if not every:
                continue
            bits = state[name].view(ints).reshape(-1)[::every]
            step = torch.randint(1, 3, bits.shape, generator=generator, dtype=ints)
            step[:: 1 if large else 7] = 300
            sign = torch.randint(0, 2, bits.shape, generator=generator, dtype=ints) * 2 - 1
            bits += step * sign
        states.append({n: t.clone() for n, t in state.items()})
    return states


def run_once(
    folder: Path,
    levels: Sequence[int],
    content_hash: str = content_hashes.DEFAULT,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Publish an anchor and a delta at each of ``levels``, then bootstrap and apply
    them into two torch targets (patches kept; patches walked), checking each."""
    store = FileStore(folder / "store")
    cache = StateCache(folder / "cache", RUN)
    states = synthetic_states(len(levels) + 1, dtype)
    for version, (state, level) in enumerate(zip(states, [levels[0], *levels], strict=True)):
        path = folder / f"{version}.safetensors"
        save_state(state, path)
        publish_step(
            store, RUN, version, path, cache, PublishOptions(level=level, content_hash=content_hash)
        )
    anchor = chain.load_manifest(store, RUN, "anchor", 0)
    last = states[-1]
    for patch_memory in (1 << 30, 0):
        target = TorchTarget(
            {n: torch.empty_like(t) for n, t in last.items()}, patch_memory_bytes=patch_memory
        )
        target.use_content_hash(anchor.content_hash)
        target.load_state(
            stream_anchor(store, anchor, _now, 1, False), {t.name: t.hash for t in anchor.tensors}
        )
        for version in range(1, len(states)):
            manifest = chain.load_manifest(store, RUN, "delta", version)
            target.apply_delta(manifest, fetch_delta(store, manifest, False).objects)
        held = dict(target.export())
        for name, want in last.items():
            if not torch.equal(held[name].view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"kernel warm-up: tensor {name} differs after the applies")


def _now(function: Callable[..., Any], *args: Any) -> Future[Any]:
    """A ``submit`` that runs at once (no download runs ahead)."""
    future: Future[Any] = Future()
    future.set_result(function(*args))
    return future


def warm(
    levels: Sequence[int] = (DEFAULT_LEVEL,),
    *,
    content_hash: str = content_hashes.DEFAULT,
    all_widths: bool = False,
) -> float:
    """Compile (or load) the kernels of publishing and applying at ``levels`` with
    ``content_hash``; with ``all_widths``, also the codec on 2- and 4-byte floats
    other than bf16. Returns the seconds it took."""
    started = time.perf_counter()
    # The small run's own log lines would read as the caller's.
    with (
        logs.quiet(),
        faults.disarmed(),
        tempfile.TemporaryDirectory(prefix="deltasync-warm-") as folder,
    ):
        run_once(Path(folder), levels, content_hash)
    if all_widths:
        generator = torch.Generator().manual_seed(0)
        for dtype in (torch.float16, torch.float32):
            base = torch.randn(1 << 16, generator=generator).to(dtype)
            new = base.clone()
            new[::37] += torch.randn(new[::37].shape, generator=generator).to(dtype) * 1e-2
            for level in levels:
                delta = read_delta(encode_delta([("w", base, new)], level=level))
                held = base.clone()
                delta.apply_to("w", held)
                if not torch.equal(held.view(torch.uint8), new.view(torch.uint8)):
                    raise AssertionError(f"kernel warm-up: {dtype} at level {level} differs")
    return time.perf_counter() - started


def warm_all() -> float:
    """:func:`warm` of every level, hash and width (images, `deltasync warm --all`)."""
    took = warm(LEVELS, all_widths=True)
    for name in content_hashes.ALGORITHMS:
        if name != content_hashes.DEFAULT:
            took += warm(content_hash=name)
    return took


def in_background(settings: Settings) -> threading.Thread:
    """:func:`warm` of the configured level and content hash on a thread of its own; one
    log line when done, or on a failure (the kernels then compile on first use)."""

    def run() -> None:
        try:
            took = warm((settings.level,), content_hash=settings.content_hash)
        except Exception as exc:  # logged: the kernels then compile on first use
            log.warning("kernel warm-up failed", error=str(exc))
        else:
            log.info("kernels ready", seconds=round(took, 2))

    kernel_cache.import_kernels()
    # Not a daemon: the interpreter waits for it at exit. A daemon thread still in
    # compiled code while the runtime tears down aborts the process.
    thread = threading.Thread(target=run, name="deltasync-warm", daemon=False)
    thread.start()
    return thread
