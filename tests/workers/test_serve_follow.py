"""`deltasync serve` whose rollout node fails before its first version: the command
fails, naming why, instead of ending as if it had been asked to stop (exit status 0,
so a supervisor that restarts failed servers never does). No vLLM needed: the node
and its target are stand-ins."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.errors import ServiceUnavailableError, TargetError
from pipeline.store.file import FileStore
from workers.nodes import serve


class DyingNode:
    last_error = None
    applied_version = None

    def run(self, stop: threading.Event) -> None:
        raise RuntimeError("engine core died")


def test_a_node_failing_before_its_first_version_fails_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "build_target", lambda name, setup: object())
    monkeypatch.setattr(serve, "make_node", lambda *args, **kwargs: DyingNode())
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's own report
    serving = _serving(tmp_path)
    engine: Any = None
    with pytest.raises(TargetError, match=r"rollout node failed.*RuntimeError: engine core died"):
        asyncio.run(serving._follow(engine))
    assert serving.stop.is_set()


def test_serve_closes_its_redis_client_when_it_cannot_start(tmp_path: Path) -> None:
    """serve refuses to start (here: Redis unreachable while checking the run): the
    Redis client it opened is closed, not left to the garbage collector."""
    closed: list[str] = []

    def client(url: str, **kwargs: Any) -> Any:
        made = redis_client(url, retries=0, **kwargs)
        close = made.close

        def closing() -> None:
            closed.append(url)
            close()

        made.close = closing  # type: ignore[method-assign]
        return made

    settings = Settings.from_env(
        {"DELTASYNC_HOME": str(tmp_path / "home"), "DELTASYNC_REDIS_URL": "redis://127.0.0.1:1/0",
         "DELTASYNC_STORE": (tmp_path / "store").as_uri()}
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "redis_client", client)
        with pytest.raises(ServiceUnavailableError):
            serve.run_serve(run="r", model_path=tmp_path, settings=settings)
    assert closed == ["redis://127.0.0.1:1/0"]


class LaterDyingNode:
    """Applies version 3 (the server opens), then fails once told to."""

    last_error = None
    applied_version = 3

    def __init__(self, on_applied: Any, go: threading.Event) -> None:
        self.on_applied, self.go = on_applied, go

    def run(self, stop: threading.Event) -> None:
        self.on_applied(SimpleNamespace(version=3))
        self.go.wait(30)
        raise RuntimeError("engine core died")


def test_a_node_failing_while_serving_stops_the_http_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a server that answers with version 3 for ever while nothing follows the run:
    uvicorn is told to exit, and the failure is kept for serve to fail with."""
    go = threading.Event()
    monkeypatch.setattr(serve, "build_target", lambda name, setup: object())
    monkeypatch.setattr(
        serve, "make_node", lambda *args, on_applied, **kw: LaterDyingNode(on_applied, go)
    )
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    serving = _serving(tmp_path)
    uvicorn_server = SimpleNamespace(should_exit=False)

    async def scenario() -> None:
        engine: Any = None
        thread = await serving._follow(engine)
        assert thread is not None and serving.gate.label == "r@3"
        serving.fingerprints.state = SimpleNamespace(server=uvicorn_server, _state={})
        go.set()
        await asyncio.to_thread(thread.join, 30)

    asyncio.run(scenario())
    assert uvicorn_server.should_exit
    assert isinstance(serving.failure, RuntimeError)


def _serving(tmp_path: Path) -> serve._Serving:
    """Serve's state for run "r", with no vLLM server nor Redis behind it."""
    return serve._Serving(
        args=None,
        store=FileStore(tmp_path / "store"),
        run="r",
        client=None,
        settings=Settings.from_env({"DELTASYNC_HOME": str(tmp_path / "home")}),
        node_id="n1",
        verify="touched",
        poll_interval_s=1.0,
    )
