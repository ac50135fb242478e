"""The cyclic collector is held off for an apply and comes back after it, whatever
happened inside, with nesting and overlapping threads."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import collector
from pipeline.errors import MismatchError
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import Manifest
from pipeline.publish.step import publish_step
from pipeline.store.file import FileStore
from pipeline.targets import torch as torch_target
from pipeline.targets.torch import TorchTarget
from tests.publish.test_chain import SyntheticRun
from tests.targets.test_walked_apply import make_delta, mixed_next, mixed_state


@pytest.fixture(autouse=True)
def enabled() -> None:
    gc.enable()


def test_held_off_nests_and_restores_what_it_found() -> None:
    with collector.held_off():
        assert not gc.isenabled()
        with collector.held_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer one still holds it
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    with collector.held_off():
        pass
    assert not gc.isenabled()
    gc.enable()


def test_overlapping_threads_enable_it_when_the_last_one_leaves() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector.held_off():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with collector.held_off():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_an_apply_gives_the_collector_back_even_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = mixed_state()
    target = TorchTarget(held)
    new = mixed_next(held, seed=3)
    manifest, objects = make_delta(held, new)
    seen: list[bool] = []
    real = torch_target.check_base

    def check_base(*args: Any, **kwargs: Any) -> None:
        seen.append(gc.isenabled())
        real(*args, **kwargs)

    monkeypatch.setattr(torch_target, "check_base", check_base)
    target.apply_delta(manifest, objects, "touched")
    assert seen == [False] and gc.isenabled()
    wrong = {n: torch.zeros_like(t) for n, t in held.items()}
    with pytest.raises(MismatchError):
        TorchTarget(wrong).apply_delta(manifest, objects, "touched")
    assert gc.isenabled()


def test_the_diff_job_holds_it_off_until_the_version_is_announced(tmp_path: Path) -> None:
    trainer = SyntheticRun(tmp_path, FileStore(tmp_path / "store"))
    seen: list[bool] = []

    def announced(_: Manifest) -> None:
        seen.append(gc.isenabled())

    for step in range(2):  # the first anchor, then a delta
        assert trainer.publish(step, on_published=announced).status == "published"
        assert gc.isenabled()  # back for the state cache's update and after
    assert seen == [False, False]
    # A job that fails gives it back too: a checkpoint with a tensor missing.
    state = trainer.gen.step()
    path = tmp_path / "short.safetensors"
    write_checkpoint(path, list(state.items())[1:])
    with pytest.raises(MismatchError):
        publish_step(trainer.store, trainer.run, 2, path, trainer.cache)
    assert gc.isenabled()
