"""One node loop for every target: options checked when built, a remote target handed
each version in chain order (what ``--target vllm-http`` drives), and ``bring_to``
stopping at the version asked for (what each worker of the vLLM plugin runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError, StoreError
from pipeline.format.manifest import Manifest
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.base import VerifyMode
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import save_state

RUN = "loop"
UNSIGNED = NodeOptions(public_key=None, progress=False)


class Publisher:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = FileStore(tmp / "store")
        self.cache = StateCache(tmp / "cache", RUN)
        g = torch.Generator().manual_seed(5)
        self.state = {f"w.{i}": torch.randn(32, 32, generator=g).bfloat16() for i in range(2)}
        self.states: list[dict[str, torch.Tensor]] = []

    def publish(self) -> int:
        version = len(self.states)
        if version:
            self.state = {n: t.clone() for n, t in self.state.items()}
            for t in self.state.values():
                t.view(-1)[version::7] += 0.01
        path = self.tmp / f"{version}.safetensors"
        save_state(self.state, path)
        assert publish_step(self.store, RUN, version, path, self.cache).status == ("published")
        self.states.append(self.state)
        return version


class Remote:
    """A remote target that records the versions it is handed."""

    def __init__(self, label: tuple[str, int] | None = None) -> None:
        self.label = label
        self.handed: list[tuple[int, VerifyMode]] = []

    def holds(self, manifest: Manifest) -> bool:
        return self.label == (manifest.run, manifest.version)

    def bring_to(self, manifest: Manifest, verify: VerifyMode) -> None:
        self.handed.append((manifest.version, verify))
        self.label = (manifest.run, manifest.version)


def test_options_are_checked_when_built() -> None:
    with pytest.raises(ConfigError, match="verify mode"):
        NodeOptions(verify="some")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prefetch_depth"):
        NodeOptions(prefetch_depth=0)
    with pytest.raises(ConfigError, match="poll_interval_s"):
        NodeOptions(poll_interval_s=-1)


def test_a_target_must_be_a_target_subclass_or_remote(tmp_path: Path) -> None:
    """A weights holder that only looks like a target declares no capabilities: refused
    when the node is built, not at its first sync."""

    class LooksLike:
        def specs(self) -> dict[str, object]:
            return {}

    store = FileStore(tmp_path)
    with pytest.raises(ConfigError, match="LooksLike is not a Target subclass"):
        RolloutNode(store, "r", LooksLike(), UNSIGNED)  # type: ignore[arg-type]
    RolloutNode(store, "r", Remote(), UNSIGNED)  # a remote target needs no base class


def test_a_remote_target_is_handed_the_head_then_each_version_in_order(tmp_path: Path) -> None:
    run = Publisher(tmp_path)
    for _ in range(3):
        run.publish()
    remote = Remote()
    node = RolloutNode(run.store, RUN, remote, NodeOptions(verify="all", public_key=None))
    assert node.step_once() == 2, node.last_error
    assert remote.handed == [(2, "all")]  # its workers bootstrap from the anchor
    run.publish()
    run.publish()
    assert node.step_once() == 4, node.last_error
    assert remote.handed == [(2, "all"), (3, "all"), (4, "all")]
    assert [a.version for a in node.history] == [2, 3, 4]

    # A remote that says it holds the head already is not asked again.
    again = Remote(label=(RUN, 4))
    node = RolloutNode(run.store, RUN, again, UNSIGNED)
    assert node.step_once() == 4 and again.handed == []


def test_bring_to_stops_at_the_version_asked_for(tmp_path: Path) -> None:
    run = Publisher(tmp_path)
    for _ in range(4):
        run.publish()
    held = {n: torch.zeros_like(t) for n, t in run.states[0].items()}
    node = RolloutNode(run.store, RUN, TorchTarget(held), UNSIGNED)
    node.bring_to(1)
    assert node.applied_version == 1
    assert all(torch.equal(held[n], t) for n, t in run.states[1].items())
    node.bring_to(2)
    assert node.applied_version == 2
    assert all(torch.equal(held[n], t) for n, t in run.states[2].items())
    with pytest.raises(StoreError, match="v9 is not in the store"):
        node.bring_to(9)
    assert node.applied_version == 2  # nothing applied on the way
    node.bring_to(3)
    assert all(torch.equal(held[n], t) for n, t in run.states[3].items())
