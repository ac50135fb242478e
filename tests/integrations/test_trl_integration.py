"""workers/integrations/trl.py without a server: what DeltasyncCallback publishes at
each trainer event (real transformers TrainerState, real Redis, real store), and the
rollout function's settings. The loop with a server is tests/integrations/test_trl_grpo.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pipeline.config import Settings
from pipeline.coord.events import StepCompleted
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError, ConfigError
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from tests.pipeline_helpers import deltasync_env
from workers.integrations.trl import DeltasyncCallback, DeltasyncRollout, _runs, policy_version
from workers.trainers.trainer import Emitter

transformers = pytest.importorskip("transformers")

RUN = "trl-callback"


def state(step: int, *, main: bool = True) -> Any:
    return transformers.TrainerState(global_step=step, is_world_process_zero=main)


def emitted_steps(emitter: Emitter) -> list[int]:
    stream = EventStream(emitter.runtime.redis, RUN)
    return [e.version for _, e in stream.read("0-0", count=100) if isinstance(e, StepCompleted)]


@pytest.fixture
def emitter(tmp_path: Path, redis_url: str) -> Emitter:
    return Emitter(RUN, settings=Settings.from_env(deltasync_env(redis_url, tmp_path)))


def test_the_callback_publishes_version_0_then_every_k_steps_and_the_last(
    emitter: Emitter,
) -> None:
    model = torch.nn.Linear(4, 4)
    callback = DeltasyncCallback(emitter, every=2)
    args, control = None, transformers.TrainerControl()
    callback.on_train_begin(args, state(0), control, model=model)
    assert callback.version == 0 and emitted_steps(emitter) == [0]
    for step in (1, 2, 3):
        callback.on_step_end(args, state(step), control, model=model)
    assert callback.version == 2 and emitted_steps(emitter) == [0, 2]
    callback.on_train_end(args, state(3), control, model=model)
    assert callback.version == 3 and emitted_steps(emitter) == [0, 2, 3]
    callback.on_train_end(args, state(3), control, model=model)  # nothing new
    assert emitted_steps(emitter) == [0, 2, 3]
    assert callback.emitted is not None and callback.emitted.step == 3


def test_only_the_main_process_publishes_and_every_process_tracks_the_version(
    emitter: Emitter,
) -> None:
    other = DeltasyncCallback(emitter)
    control = transformers.TrainerControl()
    other.on_train_begin(None, state(0, main=False), control, model=torch.nn.Linear(2, 2))
    other.on_step_end(None, state(1, main=False), control, model=torch.nn.Linear(2, 2))
    assert other.version == 1 and emitted_steps(emitter) == []


def test_a_resumed_trainer_publishes_only_what_the_run_lacks(
    emitter: Emitter, tmp_path: Path
) -> None:
    model = torch.nn.Linear(4, 4)
    checkpoint = tmp_path / "v3.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, str(checkpoint))
    cache = StateCache(tmp_path / "cache", RUN)
    publish_step(emitter.runtime.store, RUN, 3, checkpoint, cache)
    assert emitter.head() == 3
    control = transformers.TrainerControl()
    resumed = DeltasyncCallback(emitter)
    resumed.on_train_begin(None, state(3), control, model=model)  # the run holds step 3
    assert resumed.version == 3 and emitted_steps(emitter) == []
    with pytest.raises(ChainError, match="already holds version 3, past the trainer's step 1"):
        DeltasyncCallback(emitter).on_train_begin(None, state(1), control, model=model)
    assert emitted_steps(emitter) == []


def trainer_at(step: int, callbacks: list[Any], folder: Path) -> Any:
    """A transformers Trainer (a tiny model on the CPU) at global step ``step``."""
    args = transformers.TrainingArguments(
        output_dir=str(folder), use_cpu=True, report_to="none", disable_tqdm=True
    )
    trainer = transformers.Trainer(model=torch.nn.Linear(2, 2), args=args, callbacks=callbacks)
    trainer.state.global_step = step
    return trainer


def test_the_rollout_gates_at_the_policy_version_or_k_below_it(
    emitter: Emitter, tmp_path: Path
) -> None:
    callback = DeltasyncCallback(emitter, every=4)
    callback.version = 8  # the newest version the trainer published, at step 10
    trainer = trainer_at(10, [callback], tmp_path / "a")
    assert policy_version(trainer) == 8
    assert DeltasyncRollout("http://h:1").gate(trainer) == 8
    assert DeltasyncRollout("http://h:1", max_staleness=2).gate(trainer) == 6
    assert DeltasyncRollout("http://h:1", on_policy=False, max_staleness=20).gate(trainer) == 0
    assert policy_version(trainer_at(10, [], tmp_path / "b")) == 10  # no callback: the step


def test_rollout_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="on_policy=False needs max_staleness"):
        DeltasyncRollout("http://h:1", on_policy=False)
    with pytest.raises(ConfigError, match="give one of the two"):
        DeltasyncRollout("http://h:1", on_policy=True, max_staleness=1)
    with pytest.raises(ConfigError, match="integer >= 0"):
        DeltasyncRollout("http://h:1", max_staleness=True)
    with pytest.raises(ConfigError, match="at least one server"):
        DeltasyncRollout([])
    with pytest.raises(ConfigError, match="must look like http"):
        DeltasyncRollout("h:1")
    with pytest.raises(ConfigError, match="wait_timeout_s must be seconds"):
        DeltasyncRollout("http://h:1", wait_timeout_s=0)
    with pytest.raises(ConfigError, match="every must be an integer >= 1"):
        DeltasyncCallback(RUN, every=0)


def test_repeated_prompts_become_one_request_each() -> None:
    chat = [{"role": "user", "content": "a"}]
    prompts = ["a", "a", "a", "b", "b", "a", chat, chat]
    assert _runs(prompts) == [("a", 3), ("b", 2), ("a", 1), (chat, 2)]
