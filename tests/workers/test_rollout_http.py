"""`deltasync rollout --target vllm-http` is the one node entry with a remote target: a
server speaking vLLM's RL routes is paused, updated, labelled and resumed per version,
and the node leaves no heartbeat behind. (The real vLLM server: tests/targets/
test_vllm_plugin.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import RolloutOptions, Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.replicas import list_replicas
from pipeline.errors import ConfigError, TargetError
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store.file import FileStore
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain
from tests.pipeline_helpers import deltasync_env
from workers.nodes.rollout import VllmHttp, run_rollout

RUN = "http"


class FakeServer(ThreadingHTTPServer):
    """vLLM's RL routes, recording each call; /update_weights takes any version."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Routes)
        self.calls: list[tuple[str, str, Any]] = []
        self.weight_version: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Routes(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.calls.append(("GET", self.path, None))
        self.answer({"weight_version": self.server.weight_version})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append(("POST", self.path, body))
        if self.path == "/finish_weight_update":
            self.server.weight_version = body["weight_version"]
        self.answer({})


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.shutdown()
        fake.server_close()


def publish(tmp: Path, versions: int) -> None:
    store, cache = FileStore(tmp / "store"), StateCache(tmp / "cache", RUN)
    state = {"w": torch.arange(64, dtype=torch.float32).bfloat16()}
    for version in range(versions):
        state = {"w": state["w"] + 1} if version else state
        save_state(state, tmp / f"{version}.safetensors")
        publish_step(store, RUN, version, tmp / f"{version}.safetensors", cache)


def test_the_rollout_entry_drives_a_server_over_http(
    tmp_path: Path, redis_url: str, server: FakeServer
) -> None:
    publish(tmp_path, 2)
    settings = Settings.from_env(deltasync_env(redis_url, tmp_path))
    options = RolloutOptions(
        run=RUN,
        target="vllm-http",
        node_id="remote",
        verify="all",
        until_version=1,
        server_url=server.url + "/",
    )
    assert run_rollout(options, settings=settings) == 1
    posted = [(path, body) for method, path, body in server.calls if method == "POST"]
    assert posted == [  # the head at once: the server's workers bootstrap from its anchor
        ("/pause?mode=wait", None),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {"run": RUN, "version": 1, "verify": "all"}}),
        ("/finish_weight_update", {"weight_version": f"{RUN}@1"}),
        ("/resume", None),
    ]
    assert server.weight_version == f"{RUN}@1"
    assert list_replicas(redis_client(redis_url), RUN) == []


def test_a_remote_target_needs_an_http_url_and_dumps_nothing(tmp_path: Path) -> None:
    settings = Settings.from_env(deltasync_env("redis://127.0.0.1:1/0", tmp_path))
    http = RolloutOptions(run=RUN, target="vllm-http")
    with pytest.raises(ConfigError, match="needs --url"):
        run_rollout(http, settings=settings)
    with pytest.raises(ConfigError, match="not an http"):
        run_rollout(replace(http, server_url="127.0.0.1:8000"), settings=settings)
    dumping = replace(http, server_url="http://127.0.0.1:8000", dump_path=tmp_path / "w.st")
    with pytest.raises(ConfigError, match="no --dump"):
        run_rollout(dumping, settings=settings)
    elsewhere = RolloutOptions(run=RUN, target="torch", server_url="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match="--url is for --target vllm-http"):
        run_rollout(elsewhere, settings=settings)


class NotVllm(BaseHTTPRequestHandler):
    """Some other web server at the --url given (a login page on every path)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        data = b"<html><body>sign in</body></html>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        self.do_GET()


def test_a_url_that_is_not_a_vllm_server_is_a_target_error(tmp_path: Path) -> None:
    """Its answers are not JSON: a TargetError the node reports and retries, not a
    JSONDecodeError that ends the node with a traceback."""
    other = ThreadingHTTPServer(("127.0.0.1", 0), NotVllm)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        remote = VllmHttp(f"http://127.0.0.1:{other.server_address[1]}")
        with pytest.raises(TargetError, match=r"not JSON.*weight-transfer backend"):
            remote.call("GET", "/weight_info")
        publish(tmp_path, 1)
        manifest = chain.load_manifest(FileStore(tmp_path / "store"), RUN, "anchor", 0)
        assert not remote.holds(manifest)
        with pytest.raises(TargetError, match="not JSON"):
            remote.bring_to(manifest, "touched")
    finally:
        other.shutdown()
        other.server_close()
