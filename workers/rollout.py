"""Process entry of a rollout node: settings, logging, store, Redis, target, node.

``deltasync rollout`` calls :func:`run_rollout`. The torch target's tensors come
from a checkpoint given with ``model_path`` (a safetensors file or sharded
folder: a node restarted with its own ``--dump`` resumes without a bootstrap),
else they are allocated from the newest anchor's manifest and filled by the
bootstrap. The vLLM target starts an in-process engine from ``model_path``
through ``pipeline.targets.vllm.target.start_engine`` (deltasync's worker extension;
``load_format="dummy"`` when the folder holds no weights: the bootstrap loads
them; options in ``vllm_engine_options``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import redis
import structlog
import torch

from pipeline.config import RolloutOptions, Settings
from pipeline.config import vllm_options as env_vllm_options
from pipeline.coord.connection import redact_url, redis_client
from pipeline.coord.events import ReplicaError
from pipeline.coord.replicas import forget_replica
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, DeltasyncError
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.manifest import Manifest, dtype_from_name
from pipeline.format.signing import load_public_key
from pipeline.logs import bind_context, configure_logging
from pipeline.rollout.node import RolloutNode
from pipeline.rollout.scrub import ScrubPace
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.store.trust import trusted
from pipeline.targets import target_class
from pipeline.targets.base import Target, TensorSpec, VerifyMode
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from workers.metrics_http import serve_metrics
from workers.redis_launcher import ensure_redis
from workers.runtime import current as current_runtime

log = structlog.get_logger(__name__)

TargetName = Literal["torch", "vllm"]
_ANCHOR_WAIT_S = 2.0


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def state_path_for(data_dir: Path, run: str, node_id: str) -> Path:
    """Where a node records the last version it applied (checked, never trusted)."""
    return data_dir / "rollout" / run / f"{node_id}.json"


def run_rollout(
    options: RolloutOptions,
    *,
    settings: Settings | None = None,
    stop: threading.Event | None = None,
    configure_logs: bool = False,
) -> int | None:
    """Run a rollout node until ``stop`` (or SIGINT/SIGTERM), or until
    ``options.until_version`` is applied. Returns the applied version. ``settings``
    default to the CLI's (its --home and other root options)."""
    target_class(options.target)  # an unknown name fails here, listing the known ones
    settings = settings or current_runtime().settings
    if configure_logs:
        configure_logging(settings.log_level, json=settings.log_json)
    node_id = options.node_id or default_node_id()
    bind_context(run=options.run, node=node_id)
    url = options.redis_url or settings.redis_url or ensure_redis(settings.data_dir)
    client = redis_client(url)
    store = open_node_store(settings, client, options.run, options.store_url)
    log.info(
        "rollout node starting",
        target=options.target,
        store=store.url,
        redis=redact_url(url),
        device=options.device,
        verify=options.verify,
        signatures="required" if settings.verify_key_path else "not checked",
    )
    if settings.verify_key_path is None:
        log.warning(
            "signatures are not checked: set DELTASYNC_VERIFY_KEY to refuse unsigned versions"
        )
    serve_metrics(settings.metrics_port)
    stop = stop or threading.Event()
    with _signals_stop(stop):
        built = _build_target(
            options,
            store,
            stop,
            settings.patch_memory_mb,
            _refusal_reporter(EventStream(client, options.run), node_id),
        )
        if built is None:
            return None  # stopped while waiting for the run's first anchor
        node = make_node(
            store,
            options.run,
            built,
            client,
            settings,
            node_id=node_id,
            verify=options.verify,
            poll_interval_s=options.poll_interval_s,
            prefetch=options.prefetch,
            early_start=options.early_start,
        )
        try:
            applied = node.run(until_version=options.until_version, stop=stop)
        finally:
            if options.dump_path is not None and node.applied_version is not None:
                node.dump(options.dump_path)
                log.info(
                    "weights dumped", path=str(options.dump_path), version=node.applied_version
                )
            deregister_node(client, options.run, node_id)
            client.close()
    log.info("rollout node stopped", version=applied)
    return applied


def open_node_store(
    settings: Settings, client: redis.Redis, run: str, store_url: str | None = None
) -> ObjectStore:
    """The store a node of ``run`` reads: every manifest checked against the verify key
    when one is set, and refused at once if the run is bound to another store."""
    verify_key = load_public_key(settings.verify_key_path) if settings.verify_key_path else None
    store = trusted(open_store(store_url or settings.store_url), verify_key)
    run_binding.check_store(client, run, store)
    return store


def deregister_node(client: redis.Redis, run: str, node_id: str) -> None:
    """A node that stops takes its heartbeat along, so garbage collection need not wait
    out its TTL; with Redis gone the heartbeat simply expires."""
    try:
        forget_replica(client, run, node_id)
    except DeltasyncError as exc:
        log.warning("could not remove the heartbeat", error=str(exc))


def make_node(
    store: ObjectStore,
    run: str,
    target: Target,
    client: Any,
    settings: Settings,
    *,
    node_id: str,
    verify: str,
    poll_interval_s: float,
    prefetch: bool = True,
    early_start: bool | None = None,
    on_applied: Callable[[Manifest], None] | None = None,
) -> RolloutNode:
    """A rollout node of ``run`` with the process's settings (signatures, state file,
    replica TTL, early start unless ``early_start`` says)."""
    return RolloutNode(
        store,
        run,
        target,
        events=EventStream(client, run),
        redis=client,
        node_id=node_id,
        verify=_verify_mode(verify),
        poll_interval_s=poll_interval_s,
        prefetch=prefetch,
        public_key=(
            load_public_key(settings.verify_key_path) if settings.verify_key_path else None
        ),
        state_path=state_path_for(settings.data_dir, run, node_id),
        replica_ttl_s=settings.replica_ttl_s,
        early_start=settings.early_start if early_start is None else early_start,
        on_applied=on_applied,
        scrub=(
            ScrubPace(settings.scrub_minutes * 60, settings.scrub_cpu)
            if settings.scrub_minutes > 0
            else None
        ),
    )


def _verify_mode(value: str) -> VerifyMode:
    if value == "all":
        return "all"
    if value == "none":
        return "none"
    return "touched"


def _refusal_reporter(events: EventStream, node_id: str) -> Refused:
    """Reports each distinct refusal of the anchor a node would start from, once."""
    seen: set[str] = set()

    def refused(version: int, exc: DeltasyncError) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if error in seen:
            return
        seen.add(error)
        with contextlib.suppress(DeltasyncError):
            events.publish(
                ReplicaError.now(
                    run=events.run, version=version, node=node_id, error=error, recovering=True
                )
            )

    return refused


def _build_target(
    options: RolloutOptions,
    store: ObjectStore,
    stop: threading.Event,
    patch_memory_mb: int,
    refused: Refused | None = None,
) -> Target | None:
    name, run, device, model_path = options.target, options.run, options.device, options.model_path
    cls = target_class(name)  # ConfigError listing the known targets
    if name == "vllm":
        if model_path is None:
            raise ConfigError("--target vllm needs --model (a model folder with config.json)")
        llm = _start_vllm(model_path, options.vllm_options)
        # Until the bootstrap loads it, the engine holds no checkpoint-named state:
        # it is expected to take the run's tensors (the model's loader checks names).
        specs = _anchor_specs(store, run, stop, refused)
        if specs is None:
            return None
        built: Target = cls(llm, expected_specs=specs)
        return built
    if name == "torch":
        tensors = (
            _tensors_from_checkpoint(model_path, device)
            if model_path is not None
            else _tensors_from_anchor(store, run, device, stop, refused)
        )
        if tensors is None:
            return None
        built = cls(tensors, patch_memory_bytes=patch_memory_mb << 20)
        return built
    raise ConfigError(f"target {name!r} cannot be built by the rollout command")


def _tensors_from_checkpoint(path: Path, device: str) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.get(name).to(device) for name in reader.names()}


def _tensors_from_anchor(
    store: ObjectStore,
    run: str,
    device: str,
    stop: threading.Event,
    refused: Refused | None = None,
) -> dict[str, torch.Tensor] | None:
    """Empty tensors shaped like the newest anchor (the bootstrap fills them); waits for
    the run's first anchor if there is none yet."""
    specs = _anchor_specs(store, run, stop, refused)
    if specs is None:
        return None
    return {
        name: torch.empty(spec.shape, dtype=spec.dtype, device=device)
        for name, spec in specs.items()
    }


Refused = Callable[[int, DeltasyncError], None]


def _anchor_specs(
    store: ObjectStore, run: str, stop: threading.Event, refused: Refused | None = None
) -> dict[str, TensorSpec] | None:
    """Names, dtypes and shapes of the newest anchor's tensors; waits for the run's
    first anchor if there is none yet (None: stopped while waiting). An anchor that
    fails its signature or checks goes to ``refused`` (and is waited past)."""
    anchor: int | None = None
    while not stop.is_set():
        try:
            index = chain.list_versions(store, run)
            anchor = index.anchor_at_or_below(index.head) if index.head is not None else None
            if anchor is not None:
                manifest = chain.load_manifest(store, run, "anchor", anchor)
                return {
                    t.name: TensorSpec(dtype_from_name(t.dtype), tuple(t.shape))
                    for t in manifest.tensors
                }
            log.info("waiting for the run's first anchor", store=store.url)
        except DeltasyncError as exc:
            log.warning("cannot read the run's anchors yet", error=str(exc))
            if refused is not None and anchor is not None:
                refused(anchor, exc)
        stop.wait(_ANCHOR_WAIT_S)
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def vllm_engine_options(model_path: Path, options: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a rollout node's engine over ``model_path``.

    Defaults: dummy weights when the folder holds none (the bootstrap loads the
    run's anchor), no tokenizer when the folder has none (the node never decodes
    text), and on CPU an eager engine with a small KV cache (vLLM's CPU default
    reserves most of the machine's memory). Then, overriding those, a JSON object in
    ``DELTASYNC_VLLM_OPTIONS``, then ``options``.
    """
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"vLLM model folder {folder} has no config.json")
    kwargs: dict[str, Any] = {"model": str(folder)}
    if not any(folder.glob("*.safetensors")):
        kwargs["load_format"] = "dummy"
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        kwargs["skip_tokenizer_init"] = True
    if _vllm_on_cpu():
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    kwargs.update(env_vllm_options())
    kwargs.update(options)
    return kwargs


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform  # vLLM is optional and slow to import

    return bool(current_platform.is_cpu())


def _start_vllm(model_path: Path, options: Mapping[str, Any]) -> Any:
    # One process for engine and worker: a rollout node has no use for vLLM's
    # engine-core process, and in-process start is several times faster.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kwargs = vllm_engine_options(model_path, options)
    parallel = int(kwargs.get("tensor_parallel_size", 1))
    if parallel * int(kwargs.get("pipeline_parallel_size", 1)) == 1:
        kwargs.setdefault("distributed_executor_backend", "uni")
    from pipeline.targets.vllm.target import start_engine

    # start_engine hides objects (numba's llvmlite) that break vLLM's CPU start-up.
    return start_engine(**kwargs)


@contextmanager
def _signals_stop(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set ``stop`` (main thread only; elsewhere the caller stops us)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


__all__ = ["default_node_id", "run_rollout", "state_path_for"]
