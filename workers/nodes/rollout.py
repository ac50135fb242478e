"""Process entry of a rollout node: settings, logging, store, Redis, target, node.

``deltasync rollout`` calls :func:`run_rollout`. The target is built by name
through the registry (``pipeline.targets.build_target``) from a ``TargetSetup``:
the torch target from the checkpoint at ``model_path`` or the newest anchor's
shapes, the vLLM target over an in-process engine started from the model folder
``model_path`` (``pipeline.targets.vllm.startup``; options from
``DELTASYNC_VLLM_OPTIONS``, then ``vllm_options``). ``vllm-http`` is no registered
target but a remote one: a stock ``vllm serve`` at ``url`` that runs the
``deltasync`` weight-transfer backend (``workers/nodes/vllm_plugin.py``, dev mode
on), driven over HTTP by :class:`VllmHttp`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import redis
import structlog

from pipeline.config import RolloutOptions, Settings
from pipeline.config import vllm_options as env_vllm_options
from pipeline.coord.connection import redact_url, redis_client
from pipeline.coord.events import ReplicaError
from pipeline.coord.replicas import forget_replica
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, DeltasyncError, TargetError
from pipeline.format.manifest import Manifest
from pipeline.logs import bind_context, configure_logging
from pipeline.rollout.node import RemoteTarget, RolloutNode, configured_public_key, parse_verify
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.store.trust import trusted
from pipeline.targets import build_target, target_class
from pipeline.targets.base import Target, VerifyMode
from pipeline.targets.setup import Refused, TargetSetup
from pipeline.versions import binding as run_binding
from pipeline.versions.runs import require_run
from workers import warm
from workers.metrics_http import serve_metrics
from workers.nodes import HTTP_TARGET
from workers.redis_launcher import ensure_redis
from workers.runtime import current as current_runtime

log = structlog.get_logger(__name__)
_HTTP_TIMEOUT_S = 600.0


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_rollout(
    options: RolloutOptions,
    *,
    settings: Settings | None = None,
    stop: threading.Event | None = None,
    configure_logs: bool = False,
) -> int | None:
    """Run a rollout node until ``stop`` (or SIGINT/SIGTERM), or until
    ``options.until_version`` is applied. Returns the applied version. ``settings``
    default to the CLI's (its --home and other root options). A ``vllm-http`` target's
    server (``options.server_url``) holds its weights itself (no dump, no early start)."""
    remote = _remote_target(options)
    if options.target == "torch":
        check_device(options.device)
    settings = settings or current_runtime().settings
    if configure_logs:
        configure_logging(settings.log_level, json=settings.log_json)
    node_id = options.node_id or default_node_id()
    bind_context(run=options.run, node=node_id)
    redis_url = options.redis_url or settings.redis_url or ensure_redis(settings.data_dir)
    client = redis_client(redis_url, name=f"deltasync-node:{node_id}")
    with closing(client):
        store = open_node_store(settings, client, options.run, options.store_url, wait=options.wait)
        log.info(
            "rollout node starting",
            target=options.target,
            store=store.url,
            redis=redact_url(redis_url),
            **({"url": remote.url} if remote else {"device": options.device}),
            verify=options.verify,
            signatures="required" if settings.verify_key_path else "not checked",
        )
        if settings.verify_key_path is None:
            log.warning(
                "signatures are not checked: set DELTASYNC_VERIFY_KEY to refuse unsigned versions"
            )
        serve_metrics(settings.metrics_port)
        if settings.warm and remote is None:  # a remote target's own workers decode
            warm.in_background(settings)
        stop = stop or threading.Event()
        with _signals_stop(stop):
            built = remote or build_target(
                options.target,
                TargetSetup(
                    store=store,
                    run=options.run,
                    stop=stop,
                    device=options.device,
                    model_path=options.model_path,
                    patch_memory_bytes=settings.patch_memory_mb << 20,
                    engine_options={**env_vllm_options(), **options.vllm_options},
                    refused=_refusal_reporter(EventStream(client, options.run), node_id),
                ),
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
                early_start=False if remote else options.early_start,
                held_from=None if remote else options.model_path,
            )
            try:
                applied = node.run(until_version=options.until_version, stop=stop)
            finally:
                try:
                    if options.dump_path is not None and node.applied_version is not None:
                        node.dump(options.dump_path)
                        log.info(
                            "weights dumped",
                            path=str(options.dump_path),
                            version=node.applied_version,
                        )
                finally:
                    deregister_node(client, options.run, node_id)
    log.info("rollout node stopped", version=applied)
    return applied


def _remote_target(options: RolloutOptions) -> VllmHttp | None:
    """The server ``--target vllm-http`` drives, or None for a registered target (an
    unknown name fails here, listing the known ones)."""
    url = options.server_url
    if options.target != HTTP_TARGET:
        target_class(options.target)
        if url is not None:
            raise ConfigError(f"--url is for --target {HTTP_TARGET}, not {options.target}")
        return None
    if url is None:
        raise ConfigError("--target vllm-http needs --url http://HOST:PORT")
    if options.dump_path is not None:
        raise ConfigError("--target vllm-http holds its weights in the server: no --dump")
    return VllmHttp(url)


def check_device(device: str) -> None:
    """``--device`` as torch reads it, on a machine that has it: a ConfigError naming
    the problem otherwise, before the node connects (not torch's error at its first
    tensor)."""
    import torch  # the torch target's own dependency: not loaded for vllm-http

    try:
        place = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
        ) from None
    if place.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"--device {device!r}: torch sees no CUDA device here (--device cpu)")
    if place.index is not None and place.index >= count:
        raise ConfigError(
            f"--device {device!r}: torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
        )


class VllmHttp:
    """The RL routes of a ``vllm serve`` at ``url``: a node's remote target.

    For each new version, in order: ``POST /pause?mode=wait`` (in-flight requests
    finish, new ones wait; vLLM clears its prefix cache), ``/start_weight_update``,
    ``/update_weights`` with ``{"run", "version"}`` (every worker fetches, proves and
    applies its placement), ``/finish_weight_update`` with ``weight_version``
    ``RUN@VERSION``, and ``/resume`` whatever happened. ``GET /weight_info`` then
    reports the version."""

    def __init__(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"content-type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                text = response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise TargetError(f"vLLM {path} answered HTTP {exc.code}: {detail}") from None
        except OSError as exc:
            raise TargetError(f"vLLM at {self.url} unreachable ({path}): {exc}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise TargetError(
                f"{self.url}{path} answered something that is not JSON ({text[:80]!r}): is "
                "--url a `vllm serve` with the deltasync weight-transfer backend (docs/VLLM.md)?"
            ) from None

    def holds(self, manifest: Manifest) -> bool:
        """Whether the server's weight version names ``manifest``'s version."""
        try:
            answer = self.call("GET", "/weight_info")
        except DeltasyncError as exc:
            log.warning("cannot read the server's weight version", error=str(exc))
            return False
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        return label == f"{manifest.run}@{manifest.version}"

    def bring_to(self, manifest: Manifest, verify: VerifyMode) -> None:
        """One version, at a clean boundary; the server resumes whatever happens."""
        run, version = manifest.run, manifest.version
        self.call("POST", "/pause?mode=wait")
        try:
            self.call("POST", "/start_weight_update")
            info = {"run": run, "version": version, "verify": verify}
            self.call("POST", "/update_weights", {"update_info": info})
            self.call("POST", "/finish_weight_update", {"weight_version": f"{run}@{version}"})
        finally:
            self.call("POST", "/resume")


def open_node_store(
    settings: Settings,
    client: redis.Redis,
    run: str,
    store_url: str | None = None,
    *,
    wait: bool = False,
) -> ObjectStore:
    """The store a node of ``run`` reads: every manifest checked against the verify key
    when one is set, and refused at once if the run is bound to another store. Unless
    ``wait``, a run with no version and no event is an error naming the runs there are
    (a misspelled name would otherwise be waited for for ever)."""
    store = trusted(open_store(store_url or settings.store_url), configured_public_key(settings))
    run_binding.check_store(client, run, store)
    if not wait:
        require_run(store, client, run, hint="; --wait waits for its first version")
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
    target: Target | RemoteTarget,
    client: Any,
    settings: Settings,
    *,
    verify: str,
    early_start: bool | None = None,
    **options: Any,
) -> RolloutNode:
    """A rollout node of ``run`` with the process's settings (``RolloutNode.from_settings``:
    signatures, state file, replica TTL, early start unless ``early_start`` says);
    ``options``: its other keywords (``node_id``, ``on_applied``, ``NodeOptions`` fields)."""
    if early_start is not None:
        options["early_start"] = early_start
    return RolloutNode.from_settings(
        run, target, settings, store=store, redis=client, verify=parse_verify(verify), **options
    )


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


__all__ = ["VllmHttp", "default_node_id", "run_rollout"]
