"""A rollout node follows a run on every store backend (file, S3, Hub bucket)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import compact
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import ObjectStore
from pipeline.targets.patching import int_view
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state

RUN = "backends"


def test_node_follows_a_run_on_every_backend(store: ObjectStore, tmp_path: Path) -> None:
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-6, seed=3)
    cache = StateCache(tmp_path / "cache", RUN)
    state = generator.state()
    held = {n: torch.zeros_like(t) for n, t in state.items()}
    node = RolloutNode(store, RUN, TorchTarget(held), NodeOptions(node_id="backend-node"))
    for step in range(4):
        if step:
            state = generator.step()
        path = tmp_path / f"{step}.safetensors"
        save_state(state, path)
        publish_step(store, RUN, step, path, cache)
        if step == 2:
            compact(store, RUN)
        assert node.step_once() == step, node.last_error
        for name, tensor in state.items():
            assert torch.equal(int_view(held[name]).view(-1), int_view(tensor).view(-1)), name
    late_held = {n: torch.zeros_like(t) for n, t in state.items()}
    late = RolloutNode(store, RUN, TorchTarget(late_held), NodeOptions(node_id="late-node"))
    assert late.step_once() == 3, late.last_error
    assert late.applied_state_hash == node.applied_state_hash
