"""Compile the codec's numba kernels while the image is built (NUMBA_CACHE_DIR), so a
new container handles its first version at full speed instead of compiling first.

Runs the real paths on a tiny synthetic run in a temporary folder store: an anchor
and deltas at every level published, then applied by torch-target rollout nodes (with
and without memory for decoded patches), and the codec alone on other float widths.
Every result is checked, so a broken build also fails here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from pipeline.codec import LEVELS, encode_delta, read_delta
from pipeline.publish.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state


def run_once(folder: Path) -> None:
    store = FileStore(folder / "store")
    cache = StateCache(folder / "cache", "warm")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=0)
    state = generator.state()
    for version, level in enumerate([1, *LEVELS]):
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
        assert node.step_once() == len(LEVELS)
        held = dict(target.export())
        assert all(
            torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items()
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        run_once(Path(folder))
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = torch.randn(1 << 16, generator=generator).to(dtype)
        new = base.clone()
        new[::37] += torch.randn(new[::37].shape, generator=generator).to(dtype) * 1e-2
        for level in LEVELS:
            delta = read_delta(encode_delta([("w", base, new)], level=level))
            patch = delta.decode("w", base)
            assert patch.positions.numel() > 0
            held = base.clone()
            delta.apply_to("w", held)
            assert torch.equal(held.view(torch.uint8), new.view(torch.uint8)), (dtype, level)


if __name__ == "__main__":
    main()
