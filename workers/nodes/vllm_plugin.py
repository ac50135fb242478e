"""The ``deltasync`` weight-transfer backend for a stock ``vllm serve``.

vLLM loads ``register`` in every process through the ``vllm.general_plugins``
entry point (pyproject). Then

    DELTASYNC_STORE=... DELTASYNC_VLLM_CPU_PLAIN_LINEAR=1 VLLM_SERVER_DEV_MODE=1 \\
    vllm serve DIR --load-format dummy --weight-transfer-config '{"backend": "deltasync"}'

accepts ``POST /update_weights`` with ``{"update_info": {"run": R, "version": V}}``:
each worker fetches version V of run R from the store (its anchor and chain the
first time, the deltas after what it holds afterwards), proves it and applies its
own placement, through the same worker-extension code as ``deltasync serve`` and
the in-process target (``DeltasyncWorkerExtension`` methods on a host object that
holds the worker's model). ``deltasync rollout --target vllm-http --url URL``
drives those routes. vLLM's dev mode opens ``/collective_rpc`` and the other RL
routes to anyone who reaches the port: keep such a server on a private network.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
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
from pipeline.errors import ConfigError, DeltasyncError
from pipeline.format.manifest import Manifest
from pipeline.format.signing import load_public_key
from pipeline.rollout.fetch import fetch_delta, stream_anchor
from pipeline.store import open_store
from pipeline.store.trust import trusted
from pipeline.targets.base import VerifyMode
from pipeline.targets.vllm.cpu import install as install_cpu_linear_hook
from pipeline.targets.vllm.extension import DeltasyncWorkerExtension
from pipeline.targets.vllm.protocol import PrepareRequest, PrepareSummary
from pipeline.targets.vllm.target import _raise
from pipeline.targets.vllm.worker_state import Envelope
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
    engine (which vLLM hands the model and config, not the worker)."""

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


def _unwrap(envelope: Envelope) -> Any:
    if not envelope["ok"]:
        _raise(envelope)
    return envelope["value"]


def _run_now(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    future: Future[Any] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
    return future


class DeltasyncTransferEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):
    """vLLM weight-transfer engine: brings this worker's model to a run's version."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.host = ExtensionHost(model, vllm_config)
        self.run: str | None = None
        self.version: int | None = None  # what the model holds, proven
        self._lock = threading.Lock()

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        return None  # in place: no layer-wise reload to set up

    def finish_weight_update(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        info = update_info
        if info.verify not in ("touched", "all", "none"):
            raise ConfigError(f"verify mode {info.verify!r} is not one of touched, all, none")
        with self._lock:
            try:
                self._bring_to(info)
            except DeltasyncError as exc:
                log.warning("deltasync update refused", run=info.run, version=info.version,
                            held=self.version, error=str(exc))  # fmt: skip
                raise

    def _bring_to(self, info: DeltasyncUpdateInfo) -> None:
        settings = Settings.from_env()
        key = load_public_key(settings.verify_key_path) if settings.verify_key_path else None
        store = trusted(open_store(info.store or settings.store_url), key)
        version = int(info.version)
        if self.run == info.run and self.version == version:
            return
        path: list[Manifest] | None = None
        if self.run == info.run and self.version is not None and version > self.version:
            path = _deltas_between(store, info.run, self.version, version)
        if path is None:
            plan = chain.resolve(store, info.run, version)
            self._load_anchor(store, plan.anchor)
            path = list(plan.deltas)
        verify: VerifyMode = "touched"
        if info.verify in ("all", "none"):
            verify = "all" if info.verify == "all" else "none"
        for manifest in path:
            fetched = fetch_delta(store, manifest, False)
            request = PrepareRequest.for_delta(
                manifest, fetched.objects, verify, patch_memory_bytes=settings.patch_memory_mb << 20
            ).wire()
            summary = PrepareSummary.parse(_unwrap(self.host.deltasync_prepare(request)))
            _unwrap(self.host.deltasync_commit())
            self.version = manifest.version
            log.info(
                "deltasync version applied",
                run=info.run,
                version=manifest.version,
                tensors=summary.tensors,
                walked=summary.walked,
            )

    def _load_anchor(self, store: Any, anchor: Manifest) -> None:
        self.run, self.version = anchor.run, None  # mid-load: no provable version
        tensors = dict(stream_anchor(store, anchor, _run_now, 1, False))
        self.host._ds_adopt(tensors, push=True)
        self.version = anchor.version
        log.info("deltasync anchor loaded", run=anchor.run, version=anchor.version)


def _deltas_between(store: Any, run: str, held: int, version: int) -> list[Manifest] | None:
    """Delta manifests from ``held`` (exclusive) to ``version`` by parent links; None
    when the chain does not lead back to ``held``."""
    deltas = chain.list_versions(store, run).deltas
    return chain.deltas_after(
        held, version, deltas, lambda v: chain.load_manifest(store, run, "delta", v)
    )


__all__ = ["BACKEND", "DeltasyncTransferEngine", "register"]
