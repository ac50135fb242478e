"""The ``deltasync`` weight-transfer backend for a stock ``vllm serve``.

vLLM loads ``register`` in every process through the ``vllm.general_plugins``
entry point (pyproject). Then

    DELTASYNC_STORE=... DELTASYNC_VLLM_CPU_PLAIN_LINEAR=1 VLLM_SERVER_DEV_MODE=1 \\
    vllm serve DIR --load-format dummy --weight-transfer-config '{"backend": "deltasync"}'

accepts ``POST /update_weights`` with ``{"update_info": {"run": R, "version": V}}``:
each worker fetches version V of run R from the store (its anchor and chain the
first time, the deltas after what it holds afterwards), proves it and applies its
own placement: a ``RolloutNode`` per worker, told which version to hold, over a
``VllmTarget`` whose engine is this worker (``DeltasyncWorkerExtension`` methods on
a host object that holds the worker's model), as in ``deltasync serve`` and the
in-process target. ``deltasync rollout --target vllm-http --url URL``
drives those routes. vLLM's dev mode opens ``/collective_rpc`` and the other RL
routes to anyone who reaches the port: keep such a server on a private network.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from pipeline.config import Settings
from pipeline.errors import DeltasyncError
from pipeline.format.matching import spec_of
from pipeline.rollout.node import NodeOptions, RolloutNode, configured_public_key, parse_verify
from pipeline.store import open_store
from pipeline.store.trust import trusted
from pipeline.targets.vllm.cpu import install as install_cpu_linear_hook
from pipeline.targets.vllm.extension import DeltasyncWorkerExtension
from pipeline.targets.vllm.target import VllmTarget
from pipeline.versions import chain

log = structlog.get_logger(__name__)

BACKEND = "deltasync"


def register() -> None:
    """Entry point: register the backend (lazily imported) and the CPU linear hook."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    install_cpu_linear_hook()
    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "workers.nodes.vllm_plugin", "DeltasyncTransferEngine"
        )


@dataclass
class DeltasyncInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the workers read the store named by the environment."""


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):
    run: str
    version: int
    verify: str = "touched"
    store: str | None = None  # default: DELTASYNC_STORE


class _Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def get_model(self) -> torch.nn.Module:
        return self._model


class ExtensionHost(DeltasyncWorkerExtension):
    """The worker extension's methods over one worker's model, for a weight-transfer
    engine (which vLLM hands the model and config, not the worker); and this worker
    as the engine a ``VllmTarget`` drives, whose RPCs are calls here. The server is
    paused around an update (vLLM clears its prefix cache then)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model_runner = _Runner(model)
        self.model_config = vllm_config.model_config
        self.vllm_config = vllm_config

    def reload_weights(
        self, weights_iterator: Iterable[tuple[str, torch.Tensor]], is_checkpoint_format: bool
    ) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with set_current_vllm_config(self.vllm_config):
            reload_weights(
                self.vllm_config,
                self.model_runner.get_model(),
                weights_iterator=list(weights_iterator),
                weights_path=None,
                is_checkpoint_format=is_checkpoint_format,
            )

    def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[Any]:
        return [getattr(self, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        return True

    def weights_change(self, version: int | None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class DeltasyncTransferEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):
    """vLLM weight-transfer engine: brings this worker's model to a run's version."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.host = ExtensionHost(model, vllm_config)
        self.node: RolloutNode | None = None  # of the run and store last asked for
        self._store_url: str | None = None
        self._lock = threading.Lock()

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        return None  # in place: no layer-wise reload to set up

    def finish_weight_update(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.node is not None:
            self.node.close()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        info = update_info
        verify = parse_verify(info.verify)
        with self._lock:
            try:
                node = self._node_for(info)
                node.verify = verify
                node.bring_to(int(info.version))
            except DeltasyncError as exc:
                held = None if self.node is None else self.node.applied_version
                log.warning("deltasync update refused", run=info.run, version=info.version,
                            held=held, error=str(exc))  # fmt: skip
                raise

    def _node_for(self, info: DeltasyncUpdateInfo) -> RolloutNode:
        """The node that keeps this worker at versions of ``info``'s run and store (a
        new one, which bootstraps, for another run or store)."""
        settings = Settings.from_env()
        url = info.store or settings.store_url
        if self.node is not None and (self.node.run_name, self._store_url) == (info.run, url):
            return self.node
        if self.node is not None:
            self.node.close()
            self.node = None
        store = open_store(url)
        key = configured_public_key(settings)
        # Until the bootstrap loads it, the model takes the anchor's tensors.
        anchor = chain.resolve(trusted(store, key), info.run, int(info.version)).anchor
        target = VllmTarget(
            self.host,
            expected_specs={t.name: spec_of(t) for t in anchor.tensors},
            background_prepare=False,
            patch_memory_bytes=settings.patch_memory_mb << 20,
        )
        options = NodeOptions(node_id="vllm-worker", prefetch=False, progress=False, public_key=key)
        self.node, self._store_url = RolloutNode(store, info.run, target, options), url
        return self.node


__all__ = ["BACKEND", "DeltasyncTransferEngine", "register"]
