"""``deltasync rollout --target vllm-http --url URL``: follow a run by driving a stock
``vllm serve`` that runs the ``deltasync`` weight-transfer backend
(``workers/nodes/vllm_plugin.py``, dev mode on).

For each new version, in order: ``POST /pause?mode=wait`` (in-flight requests finish,
new ones wait; vLLM clears its prefix cache), ``/start_weight_update``,
``/update_weights`` with ``{"run", "version"}`` (every worker fetches, proves and
applies its placement), ``/finish_weight_update`` with ``weight_version``
``RUN@VERSION``, and ``/resume`` whatever happened. ``GET /weight_info`` then reports
the version. The node is a ``RolloutNode`` like the others, with the server as its
remote target: heartbeats, ``delta-applied`` and ``replica-error`` events, lag in
``deltasync status``, a floor and a state file.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from contextlib import closing
from typing import Any

import structlog

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.errors import ConfigError, DeltasyncError, TargetError
from pipeline.format.manifest import Manifest
from pipeline.targets.base import VerifyMode
from workers.nodes.rollout import deregister_node, make_node, open_node_store
from workers.redis_launcher import ensure_redis

log = structlog.get_logger(__name__)

_HTTP_TIMEOUT_S = 600.0


class VllmHttp:
    """The RL routes of a ``vllm serve`` at ``url``: a node's remote target."""

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
    redis_url = settings.redis_url or ensure_redis(settings.data_dir)
    with closing(redis_client(redis_url, name=f"deltasync-node:{node_id}")) as client:
        store = open_node_store(settings, client, run, wait=wait)
        node = make_node(store, run, server, client, settings, node_id=node_id, verify=verify,
                         poll_interval_s=poll_interval_s, early_start=False)  # fmt: skip
        log.info("vllm-http node starting", url=server.url)
        try:
            return node.run(until_version=until_version, stop=stop)
        finally:
            node.close()
            deregister_node(client, run, node_id)


__all__ = ["VllmHttp", "run_http_rollout"]
