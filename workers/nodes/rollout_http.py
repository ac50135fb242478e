"""``deltasync rollout --target vllm-http --url URL``: follow a run by driving a stock
``vllm serve`` that runs the ``deltasync`` weight-transfer backend
(``workers/nodes/vllm_plugin.py``, dev mode on).

For each new version, in order: ``POST /pause?mode=wait`` (in-flight requests finish,
new ones wait; vLLM clears its prefix cache), ``/start_weight_update``,
``/update_weights`` with ``{"run", "version"}`` (every worker fetches, proves and
applies its placement), ``/finish_weight_update`` with ``weight_version``
``RUN@VERSION``, and ``/resume`` whatever happened. ``GET /weight_info`` then reports
the version. The node is a replica like the others: heartbeats, ``delta-applied``
and ``replica-error`` events, lag in ``deltasync status``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import structlog

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError, ConfigError, DeltasyncError, TargetError
from pipeline.format.manifest import Kind, Manifest
from pipeline.format.signing import load_public_key
from pipeline.rollout.report import Reporter
from pipeline.rollout.stream import StreamFollower
from pipeline.store.trust import trusted
from pipeline.versions import chain
from workers.nodes.rollout import open_node_store
from workers.redis_launcher import ensure_redis

log = structlog.get_logger(__name__)

_HTTP_TIMEOUT_S = 600.0
_MAX_BACKOFF_S = 30.0


class VllmHttp:
    """The RL routes of a ``vllm serve`` at ``url``."""

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
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise TargetError(f"vLLM {path} answered HTTP {exc.code}: {detail}") from None
        except OSError as exc:
            raise TargetError(f"vLLM at {self.url} unreachable ({path}): {exc}") from None
        return json.loads(text) if text else None

    def weight_version(self) -> str | None:
        answer = self.call("GET", "/weight_info")
        value = answer.get("weight_version") if isinstance(answer, dict) else None
        return str(value) if value else None

    def update(self, run: str, version: int, verify: str) -> None:
        """One version, at a clean boundary; the server resumes whatever happens."""
        self.call("POST", "/pause?mode=wait")
        try:
            self.call("POST", "/start_weight_update")
            info = {"run": run, "version": version, "verify": verify}
            self.call("POST", "/update_weights", {"update_info": info})
            self.call("POST", "/finish_weight_update", {"weight_version": f"{run}@{version}"})
        finally:
            self.call("POST", "/resume")


def run_http_rollout(
    *,
    run: str,
    url: str,
    node_id: str,
    settings: Settings,
    verify: str = "touched",
    poll_interval_s: float = 2.0,
    until_version: int | None = None,
    stop: threading.Event | None = None,
    wait: bool = False,
) -> int | None:
    """Follow ``run`` until ``stop`` or until ``until_version`` is applied; returns the
    version the server holds. ``wait``: as for ``open_node_store``."""
    server = VllmHttp(url)
    client = redis_client(
        settings.redis_url or ensure_redis(settings.data_dir), name=f"deltasync-node:{node_id}"
    )
    store = open_node_store(settings, client, run, wait=wait)
    events = EventStream(client, run)
    stream = StreamFollower(events, run)
    report = Reporter(run, node_id, events=events, redis=client, heartbeat_interval_s=5.0,
                      replica_ttl_s=settings.replica_ttl_s, first_seen=stream.first_seen,
                      early_start=False)  # fmt: skip
    key = load_public_key(settings.verify_key_path) if settings.verify_key_path else None
    stop = stop or threading.Event()
    held: Manifest | None = None
    label = _held_label(server, run)
    log.info("vllm-http node starting", url=server.url, server_holds=label)
    failures = 0
    after_id = stream.position()
    try:
        while not stop.is_set():
            try:
                index = chain.list_versions(store, run)
                todo = [v for v in index.versions if held is None or v > held.version]
                if held is None and index.head is not None:
                    todo = [index.head]  # the workers bootstrap from anchor and chain
                for version in todo:
                    kind: Kind = "delta" if version in index.deltas else "anchor"
                    manifest = chain.load_manifest(trusted(store, key), run, kind, version)
                    if held is None and label == f"{run}@{version}":
                        log.info("server already holds the head", version=version)
                    else:
                        started = time.perf_counter()
                        server.update(run, version, verify)
                        spent = time.perf_counter() - started
                        report.applied(manifest, fetch_s=0.0, apply_s=spent, pause_s=spent)
                        log.info("applied", version=version, pause_s=round(spent, 4))
                    held = manifest
                    label = f"{run}@{version}"
                    report.heartbeat(held.version, held.state_hash)
                failures = 0
            except DeltasyncError as exc:
                failures += 1
                log.warning("sync failed", held=held.version if held else None, error=str(exc))
                report.failed(held.version if held else None, exc)
                if isinstance(exc, ChainError):
                    held = None
            if held is not None and until_version is not None and held.version >= until_version:
                break
            version_held = held.version if held else None
            report.heartbeat_if_due(version_held, held.state_hash if held else None)
            wait_s = min(_MAX_BACKOFF_S, poll_interval_s * 2 ** max(0, failures - 1))
            _woken, after_id = stream.wait(after_id, wait_s, stop, version_held)
    finally:
        client.close()
    return held.version if held else None


def _held_label(server: VllmHttp, run: str) -> str | None:
    try:
        label = server.weight_version()
    except DeltasyncError as exc:
        log.warning("cannot read the server's weight version", error=str(exc))
        return None
    return label if label and label.startswith(f"{run}@") else None


__all__ = ["VllmHttp", "run_http_rollout"]
