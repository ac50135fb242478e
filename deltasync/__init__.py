"""deltasync: fresh weights from an RL trainer to its inference servers, as lossless
sparse deltas through an object store.

The names a program uses, re-exported from where they live (``pipeline/``, the
library; ``workers/``, the processes). Each is imported on first use, so
``import deltasync`` loads neither torch nor vLLM.

Trainer side
    ``Emitter``            publish a run's steps from a state dict, a module or a checkpoint
    ``ShardedEmitter``     the same on every rank of a sharded trainer, without a gather
    ``Emitted``            what an emit sent
Rollout side
    ``RolloutNode``        keeps a target at the head of a run (bootstrap, follow, verify)
    ``NodeOptions``        how a node follows its run (verify key, polling, state file...)
    ``TorchTarget``        a torch state dict or ``nn.Module`` as a target
    ``VllmTarget``         a vLLM engine as a target; ``start_engine`` starts one for it
    ``VersionClient``      what a ``deltasync serve`` holds; waits for a version
    ``ServedVersion``      its answer (``GET /deltasync/version``)
    ``gate_headers``       the request headers that hold a request until a version is served
Integrations
    ``DeltasyncCallback``  TRL / transformers ``TrainerCallback`` that publishes the policy
    ``DeltasyncRollout``   a ready ``rollout_func`` for TRL's ``GRPOTrainer`` on ``deltasync serve``
Settings and errors
    ``Settings``           every ``DELTASYNC_*`` setting, typed
    ``DeltasyncError``     the root of every error deltasync raises on purpose
    ``VersionTimeoutError``  a server did not reach a version in time
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline import __version__

if TYPE_CHECKING:
    from pipeline.config import Settings as Settings
    from pipeline.errors import DeltasyncError as DeltasyncError
    from pipeline.errors import VersionTimeoutError as VersionTimeoutError
    from pipeline.rollout.node import NodeOptions as NodeOptions
    from pipeline.rollout.node import RolloutNode as RolloutNode
    from pipeline.rollout.served import ServedVersion as ServedVersion
    from pipeline.rollout.served import VersionClient as VersionClient
    from pipeline.rollout.served import gate_headers as gate_headers
    from pipeline.targets.torch import TorchTarget as TorchTarget
    from pipeline.targets.vllm.startup import start_engine as start_engine
    from pipeline.targets.vllm.target import VllmTarget as VllmTarget
    from workers.integrations.trl import DeltasyncCallback as DeltasyncCallback
    from workers.integrations.trl import DeltasyncRollout as DeltasyncRollout
    from workers.trainers.sharded_trainer import ShardedEmitter as ShardedEmitter
    from workers.trainers.trainer import Emitted as Emitted
    from workers.trainers.trainer import Emitter as Emitter

# name -> the module it lives in
_HOMES: dict[str, str] = {
    "Emitter": "workers.trainers.trainer",
    "Emitted": "workers.trainers.trainer",
    "ShardedEmitter": "workers.trainers.sharded_trainer",
    "RolloutNode": "pipeline.rollout.node",
    "NodeOptions": "pipeline.rollout.node",
    "TorchTarget": "pipeline.targets.torch",
    "VllmTarget": "pipeline.targets.vllm.target",
    "start_engine": "pipeline.targets.vllm.startup",
    "VersionClient": "pipeline.rollout.served",
    "ServedVersion": "pipeline.rollout.served",
    "gate_headers": "pipeline.rollout.served",
    "DeltasyncCallback": "workers.integrations.trl",
    "DeltasyncRollout": "workers.integrations.trl",
    "Settings": "pipeline.config",
    "DeltasyncError": "pipeline.errors",
    "VersionTimeoutError": "pipeline.errors",
}

__all__ = [
    "DeltasyncCallback",
    "DeltasyncError",
    "DeltasyncRollout",
    "Emitted",
    "Emitter",
    "NodeOptions",
    "RolloutNode",
    "ServedVersion",
    "Settings",
    "ShardedEmitter",
    "TorchTarget",
    "VersionClient",
    "VersionTimeoutError",
    "VllmTarget",
    "__version__",
    "gate_headers",
    "start_engine",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
