"""Compile the codec's numba kernels ahead of use: numba compiles each kernel on its
first call and caches it on disk (per machine and venv, or ``NUMBA_CACHE_DIR``), so a
process that runs this first, or runs after it, handles its first version at full
speed. Image builds run it (docker/warm_codec.py); so does `deltasync demo` before its
clock starts.

It runs the real paths on a tiny synthetic run in a temporary folder store: an anchor
and deltas published (at the given levels), then applied by torch-target rollout nodes
(with and without memory for decoded patches), and with ``all_widths`` the codec alone
on the other float widths. Every result is checked, so a broken build also fails here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.codec import LEVELS, encode_delta, read_delta
from pipeline.publish.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state


def run_once(folder: Path, levels: Sequence[int] = LEVELS) -> None:
    store = FileStore(folder / "store")
    cache = StateCache(folder / "cache", "warm")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=0)
    state = generator.state()
    for version, level in enumerate([levels[0], *levels]):
        if version:
            state = generator.step()
        path = folder / f"{version}.safetensors"
        save_state(state, path)
        publish_step(store, "warm", version, path, cache, level=level)
    for patch_memory in (1 << 30, 0):
        target = TorchTarget(
            {n: torch.empty_like(t) for n, t in state.items()}, patch_memory_bytes=patch_memory
        )
        node = RolloutNode(store, "warm", target, prefetch=False)
        assert node.step_once() == len(levels)
        held = dict(target.export())
        assert all(
            torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items()
        )


def warm_codec(levels: Sequence[int] = LEVELS, *, all_widths: bool = True) -> None:
    """Run every path once (see the module's text)."""
    with tempfile.TemporaryDirectory() as folder:
        run_once(Path(folder), levels)
    if not all_widths:
        return
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = torch.randn(1 << 16, generator=generator).to(dtype)
        new = base.clone()
        new[::37] += torch.randn(new[::37].shape, generator=generator).to(dtype) * 1e-2
        for level in levels:
            delta = read_delta(encode_delta([("w", base, new)], level=level))
            patch = delta.decode("w", base)
            assert patch.positions.numel() > 0
            held = base.clone()
            delta.apply_to("w", held)
            assert torch.equal(held.view(torch.uint8), new.view(torch.uint8)), (dtype, level)
