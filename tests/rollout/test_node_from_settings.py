"""A rollout node built in the user's own process is safe by default: built as the README
shows, it checks signatures against the configured verify key; ``from_settings`` wires the
store, the key and the state file from the settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.errors import SignatureError
from pipeline.format.signing import generate_keypair
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import save_state

RUN = "wired"


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    first = {f"layer.{i}.weight": torch.randn(64, 64, generator=g).bfloat16() for i in range(3)}
    second = {n: t.clone() for n, t in first.items()}
    for t in second.values():
        t.view(-1)[::11] += 0.01
    return [first, second]


def _publish_unsigned(tmp: Path) -> tuple[FileStore, dict[str, torch.Tensor]]:
    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", RUN)
    states = _states()
    for version, state in enumerate(states):
        path = tmp / f"{version}.safetensors"
        save_state(state, path)
        assert publish_step(store, RUN, version, path, cache).status == "published"
    return store, states[-1]


def _empty_like(state: dict[str, torch.Tensor]) -> TorchTarget:
    return TorchTarget({n: torch.zeros_like(t) for n, t in state.items()})


def test_a_hand_built_node_checks_the_configured_verify_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, last = _publish_unsigned(tmp_path)
    _, public = generate_keypair(tmp_path / "keys")
    monkeypatch.setenv("DELTASYNC_VERIFY_KEY", str(public))

    node = RolloutNode(store, RUN, _empty_like(last), NodeOptions(progress=False))
    try:
        assert node.step_once() is None, "an unsigned run was served with a verify key set"
        assert isinstance(node.last_error, SignatureError), node.last_error
    finally:
        node.close()

    # Opting out is explicit.
    target = _empty_like(last)
    node = RolloutNode(store, RUN, target, NodeOptions(public_key=None, progress=False))
    try:
        assert node.step_once() == 1
    finally:
        node.close()
    held = dict(target.export())
    assert all(torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in last.items())


def test_from_settings_wires_store_key_and_state_file(tmp_path: Path) -> None:
    store, last = _publish_unsigned(tmp_path)
    home = tmp_path / "home"
    settings = Settings.from_env({"DELTASYNC_HOME": str(home), "DELTASYNC_STORE": store.url})
    target = _empty_like(last)
    node = RolloutNode.from_settings(RUN, target, settings, node_id="n1", progress=False)
    try:
        assert node.public_key is None and node.step_once() == 1
    finally:
        node.close()
    held = dict(target.export())
    assert all(torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in last.items())
    assert (home / "rollout" / RUN / "n1.json").is_file(), "no state file where settings say"

    _, public = generate_keypair(tmp_path / "keys")
    signed = Settings.from_env(
        {
            "DELTASYNC_HOME": str(home),
            "DELTASYNC_STORE": store.url,
            "DELTASYNC_VERIFY_KEY": str(public),
        }
    )
    node = RolloutNode.from_settings(RUN, _empty_like(last), signed, node_id="n2", progress=False)
    try:
        assert node.step_once() is None
        assert isinstance(node.last_error, SignatureError), node.last_error
    finally:
        node.close()
