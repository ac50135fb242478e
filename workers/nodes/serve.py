"""``deltasync serve``: vLLM's OpenAI-compatible server following a run, in one process.

vLLM's own app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``, ...) is built over an ``AsyncLLM`` with the deltasync
worker extension, and a rollout node runs on a thread of the same process. The node
drives the engine through ``pipeline.targets.vllm.engine.ServedEngine``: each
version is fetched, decoded and proven while the server answers, then applied at a
clean boundary (new requests held, generation paused in ``wait`` mode, patch,
prefix cache reset, resume). No dev-mode route is opened.

Every generation request is tagged with the version that served it: the response
header ``x-deltasync-version: <run>@<version>`` and the OpenAI ``system_fingerprint``
field. A request with ``x-deltasync-min-version: V`` waits until V or newer is
applied (at most ``x-deltasync-wait-timeout`` seconds, else 504).
``GET /deltasync/version`` says what the server holds, the run's head and the lag
(``?wait_for=V&timeout=S``: once V or newer is applied). The port opens once the node
holds its first verified version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pipeline.config import Settings
from pipeline.coord.connection import redact_url, redis_client
from pipeline.errors import ConfigError, DeltasyncError, TargetError, VersionTimeoutError
from pipeline.format.hashes.hashing import state_hash
from pipeline.format.manifest import Manifest
from pipeline.logs import bind_context, configure_logging
from pipeline.rollout.node import RolloutNode, parse_verify
from pipeline.rollout.served import (
    GATE_WAIT_S,
    MIN_VERSION_HEADER,
    VERSION_HEADER,
    VERSION_ROUTE,
    WAIT_TIMEOUT_HEADER,
    WEIGHTS_ROUTE,
    parse_min_version,
    parse_wait_timeout,
)
from pipeline.store.base import ObjectStore
from pipeline.targets import build_target
from pipeline.targets.base import Target
from pipeline.targets.setup import TargetSetup
from pipeline.targets.vllm.engine import ServedEngine, VersionGate
from pipeline.targets.vllm.startup import (
    EXTENSION_CLS,
    engine_start_guard,
    on_cpu,
    prepare_engine_process,
)
from pipeline.versions import chain
from workers.nodes.rollout import (
    default_node_id,
    deregister_node,
    make_node,
    open_node_store,
)
from workers.redis_launcher import ensure_redis
from workers.runtime import current as current_runtime

log = structlog.get_logger(__name__)

_HEAD_CACHE_S = 1.0
_JOIN_S = 60.0  # the node's thread, at shutdown (it may be inside an engine call)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def server_argv(model_path: Path, host: str, port: int, extra: Sequence[str]) -> list[str]:
    """vLLM server arguments: the model folder, address, the deltasync worker
    extension, and on CPU an eager engine with a small KV cache (vLLM's CPU default
    reserves most of the machine's memory); dummy weights when the folder holds none
    (the bootstrap loads the run's). ``extra`` (any vLLM server option) comes last
    and wins."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"vLLM model folder {folder} has no config.json")
    argv = ["--model", str(folder), "--host", host, "--port", str(port)]
    argv += ["--worker-extension-cls", EXTENSION_CLS]
    if not any(folder.glob("*.safetensors")):
        argv += ["--load-format", "dummy"]
    if on_cpu():
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]
    return argv + list(extra)


def parse_server_args(argv: Sequence[str]) -> Any:
    """vLLM's own server argument parser and checks (``--help`` lists them all)."""
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="deltasync serve"))  # type: ignore[no-untyped-call]
    args = parser.parse_args(list(argv))
    validate_parsed_serve_args(args)
    return args


@dataclass(eq=False)
class VersionTagger:
    """ASGI middleware: generation requests (POST) pass the version gate, and their
    response carries the version they were admitted under.

    A request with ``x-deltasync-min-version: V`` is held until V or newer is served,
    at most ``x-deltasync-wait-timeout`` seconds (``wait_s`` otherwise), then answered
    504 naming the held version and the head (``status()``, the version route's
    document). A malformed header is answered 400."""

    app: ASGIApp
    gate: VersionGate
    _: KW_ONLY
    wait_s: float = GATE_WAIT_S
    status: Callable[[], Awaitable[dict[str, Any]]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or str(scope.get("path", "")).startswith("/deltasync")
        ):
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            min_version, wait_s = gate_request(headers, self.gate.run, self.wait_s)
        except ConfigError as exc:
            await _error(send, 400, str(exc), "BadRequestError", self.gate.label)
            return
        try:
            label = await self.gate.enter(min_version, timeout_s=wait_s)
        except VersionTimeoutError:
            await self._timed_out(send, min_version, wait_s)
            return
        try:
            if label is None:
                message = "the server holds no verified version (recovering)"
                await _error(send, 503, message, "ServiceUnavailable", None, retry=True)
                return
            header = (VERSION_HEADER.encode(), label.encode())

            async def tagged(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = dict(message)
                    message["headers"] = [*message.get("headers", []), header]
                await send(message)

            await self.app(scope, receive, tagged)
        finally:
            self.gate.leave()

    async def _timed_out(self, send: Send, min_version: int | None, wait_s: float) -> None:
        status = await self.status() if self.status is not None else {}
        version, head = status.get("version", self.gate.version), status.get("head")
        message = (
            f"version {min_version} was not applied within {wait_s:g} s "
            f"({WAIT_TIMEOUT_HEADER}): this server holds version {version}, "
            f"the run's head is {head}"
        )
        fields = {"min_version": min_version, "version": version, "head": head}
        await _error(send, 504, message, "VersionTimeout", self.gate.label, fields)


def _headers(scope: Scope) -> dict[str, str]:
    return {
        bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
        for name, value in scope.get("headers", [])
    }


def gate_request(
    headers: Mapping[str, str], run: str, default_wait_s: float
) -> tuple[int | None, float]:
    """The version a request asks for (None: any) and how long it may wait for it."""
    raw = headers.get(MIN_VERSION_HEADER)
    min_version = None if raw is None else parse_min_version(raw, run)
    raw_wait = headers.get(WAIT_TIMEOUT_HEADER)
    wait_s = default_wait_s if raw_wait is None else parse_wait_timeout(raw_wait)
    return min_version, wait_s


async def _error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    label: str | None,
    fields: Mapping[str, Any] | None = None,
    *,
    retry: bool = False,
) -> None:
    """An OpenAI-shaped JSON error. Unless ``retry``, ``x-should-retry: false`` tells
    the official clients not to repeat the request by themselves."""
    error = {"message": message, "type": kind, "param": None, "code": status, **(fields or {})}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json")]
    if not retry:
        headers.append((b"x-should-retry", b"false"))
    if label is not None:
        headers.append((VERSION_HEADER.encode(), label.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Fingerprints:
    """Stamps the served version on vLLM's serving objects (``system_fingerprint``,
    read at each response); called while no request is admitted."""

    def __init__(self) -> None:
        self.state: Any = None

    def __call__(self, label: str | None) -> None:
        if self.state is None:
            return
        for value in vars(self.state).get("_state", {}).values():
            if hasattr(value, "system_fingerprint"):
                value.system_fingerprint = label


@dataclass(eq=False)
class HeadCache:
    """The run's head from the store, listed at most once a second."""

    store: ObjectStore
    run: str
    _at: float = 0.0
    _head: int | None = None

    def head(self) -> int | None:
        if time.monotonic() - self._at >= _HEAD_CACHE_S:
            self._head = chain.list_versions(self.store, self.run).head
            self._at = time.monotonic()
        return self._head


def run_serve(
    *,
    run: str,
    model_path: Path,
    host: str = "0.0.0.0",
    port: int = 8000,
    vllm_args: Sequence[str] = (),
    node_id: str | None = None,
    verify: str = "touched",
    poll_interval_s: float = 2.0,
    early_start: bool | None = None,
    settings: Settings | None = None,
    gate_wait_s: float = GATE_WAIT_S,
    wait: bool = False,
) -> None:
    """Serve ``model_path``'s model with the weights of run ``run`` until SIGINT/SIGTERM.
    ``gate_wait_s``: how long a request asking for a version waits for it by default.
    ``wait``: as for ``open_node_store`` (checked before vLLM is loaded)."""
    parse_verify(verify)
    if poll_interval_s <= 0:
        raise ConfigError(f"poll interval must be positive, got {poll_interval_s}")
    parse_wait_timeout(str(gate_wait_s), name="--wait-timeout")
    settings = settings or current_runtime().settings
    node_id = node_id or default_node_id()
    bind_context(run=run, node=node_id)
    url = settings.redis_url or ensure_redis(settings.data_dir)
    client = redis_client(url, name=f"deltasync-serve:{node_id}")
    with contextlib.closing(client):
        store = open_node_store(settings, client, run, wait=wait)
        args = parse_server_args(server_argv(model_path, host, port, vllm_args))
        log.info("serve starting", store=store.url, redis=redact_url(url), host=host, port=port)
        # Keep CPU linear weights plain, so deltas are written in place; spawned engine
        # processes inherit the setting and install the hook with the extension.
        prepare_engine_process(cpu_plain_linear=True)
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

        cli_env_setup()  # type: ignore[no-untyped-call]
        serving = _Serving(args, store, run, client, settings, node_id, verify, poll_interval_s)
        serving.early_start, serving.gate_wait_s = early_start, gate_wait_s
        import uvloop

        try:
            uvloop.run(serving.main())
        finally:
            deregister_node(client, run, node_id)
    log.info("serve stopped", version=serving.driver.version if serving.driver else None)


@dataclass(eq=False)
class _Serving:
    args: Any
    store: ObjectStore
    run: str
    client: Any
    settings: Settings
    node_id: str
    verify: str
    poll_interval_s: float
    early_start: bool | None = None
    gate_wait_s: float = GATE_WAIT_S
    stop: threading.Event = field(default_factory=threading.Event)
    driver: ServedEngine | None = None
    node: RolloutNode | None = None
    target: Target | None = None  # the node's, over this process's engine
    failure: Exception | None = None  # what ended the node's thread, if anything did

    def __post_init__(self) -> None:
        self.heads = HeadCache(self.store, self.run)

    async def main(self) -> None:
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

        # Until uvicorn installs its handlers, SIGINT/SIGTERM stop the start-up.
        def interrupt(*_: object) -> None:
            self.stop.set()
            raise KeyboardInterrupt("terminated")

        signal.signal(signal.SIGTERM, interrupt)
        async with contextlib.AsyncExitStack() as stack:
            with engine_start_guard():
                engine = await stack.enter_async_context(build_async_engine_client(self.args))
            # vLLM's start-up reconfigures logging, and the root logger's level is
            # raised later on: route ours (and uvicorn's) again, at our own level.
            configure_logging(self.settings.log_level, json=self.settings.log_json)
            for name in ("pipeline", "workers"):
                logging.getLogger(name).setLevel(logging.getLogger().level)
            thread = await self._follow(engine)
            try:
                if thread is not None:
                    await self._serve(engine)
            finally:
                self.stop.set()
                if thread is not None:
                    # The node may be inside an engine call: keep the loop running.
                    await asyncio.to_thread(thread.join, _JOIN_S)
            self._raise_failure("")  # serve fails with it, not as a clean stop

    def _raise_failure(self, when: str) -> None:
        """A TargetError naming what ended the node's thread, if anything did."""
        if self.failure is not None:
            failure = f"{type(self.failure).__name__}: {self.failure}".splitlines()[0]
            raise TargetError(f"the rollout node failed{when}: {failure}")

    async def _follow(self, engine: Any) -> threading.Thread | None:
        """Start the node on its thread; return once it holds a verified version
        (None: stopped first)."""
        loop = asyncio.get_running_loop()
        fingerprints = Fingerprints()
        self.fingerprints = fingerprints
        self.gate = VersionGate(self.run)
        driver = ServedEngine(engine, loop, self.run, self.gate, on_label=fingerprints)
        self.driver = driver
        setup = TargetSetup(store=self.store, run=self.run, stop=self.stop, engine=driver)
        # Waits for the run's first anchor (None: stopped meanwhile).
        target = await asyncio.to_thread(build_target, "vllm", setup)
        if target is None:
            return None
        self.target = target

        def applied(manifest: Manifest) -> None:
            driver.publish(manifest.version)

        node = make_node(
            self.store,
            self.run,
            target,
            self.client,
            self.settings,
            node_id=self.node_id,
            verify=self.verify,
            poll_interval_s=self.poll_interval_s,
            early_start=self.early_start,
            on_applied=applied,
        )
        self.node = node

        def follow() -> None:
            try:
                node.run(stop=self.stop)
            except Exception as exc:
                log.exception("rollout node failed")
                self.failure = exc
                self.stop.set()
                # Serving already: the HTTP server stops too (serve_http keeps uvicorn's
                # server in the app's state), not answering with a frozen version.
                server = getattr(fingerprints.state, "server", None)
                if server is not None:
                    server.should_exit = True
                raise

        thread = threading.Thread(target=follow, name="deltasync-node", daemon=True)
        thread.start()
        while driver.version is None or not self.gate.is_open:
            if self.stop.is_set() or not thread.is_alive():
                await asyncio.to_thread(thread.join)
                self._raise_failure(" before its first version")  # not asked to stop
                return None
            await asyncio.sleep(0.1)
        log.info("first version loaded, opening the server", version=driver.version)
        return thread

    async def _serve(self, engine: Any) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import serve_http, setup_server

        args = self.args
        args.fingerprint_mode = "custom"
        args.fingerprint_value = self.gate.label
        # Closed while the app is built: a relabel then waits for it.
        await self.gate.close()
        try:
            supported_tasks = await engine.get_supported_tasks()
            app = build_app(args, supported_tasks, engine.model_config)
            await init_app_state(engine, app.state, args, supported_tasks)
            self.fingerprints.state = app.state
            self.fingerprints(self.gate.label)
            app.add_api_route(VERSION_ROUTE, self._version_route, methods=["GET"])
            app.add_api_route(WEIGHTS_ROUTE, self._weights_route, methods=["GET"])
            wait_s, status = self.gate_wait_s, self._status
            if app.middleware_stack is None:
                app.add_middleware(VersionTagger, gate=self.gate, wait_s=wait_s, status=status)
            else:  # vLLM built the stack already: wrap it, outermost
                app.middleware_stack = VersionTagger(
                    app.middleware_stack, self.gate, wait_s=wait_s, status=status
                )
        finally:
            self.gate.reopen(self.gate.version)
        listen_address, sock = setup_server(args, reuse_port=False)
        log.info("serving", address=listen_address, version=self.gate.label)
        try:
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                log_config=None,  # uvicorn's loggers go through deltasync's handler
            )
            await shutdown
        finally:
            sock.close()

    async def _version_route(self, wait_for: str | None = None, timeout: str | None = None) -> Any:
        """What the server holds; with ``wait_for=V``, once it holds V or newer (a long
        poll of at most ``timeout`` seconds, the gate's default otherwise: then 504)."""
        from fastapi.responses import JSONResponse

        if wait_for is None:
            return await self._status()
        try:
            version = parse_min_version(wait_for, self.run, name="wait_for")
            wait_s = (
                self.gate_wait_s if timeout is None else parse_wait_timeout(timeout, name="timeout")
            )
        except ConfigError as exc:
            error = {"message": str(exc), "type": "BadRequestError", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        try:
            await self.gate.wait_for(version, timeout_s=wait_s)
        except VersionTimeoutError:
            status = await self._status()
            message = (
                f"version {version} was not applied within {wait_s:g} s: this server holds "
                f"version {status['version']}, the run's head is {status['head']}"
            )
            fields = {"min_version": version, "version": status["version"], "head": status["head"]}
            error = {"message": message, "type": "VersionTimeout", "code": 504, **fields}
            return JSONResponse({**status, "error": error}, status_code=504)
        return await self._status()

    async def _status(self) -> dict[str, Any]:
        driver = self.driver
        version = driver.version if driver is not None else None
        try:
            head = await asyncio.to_thread(self.heads.head)
        except DeltasyncError as exc:
            log.warning("cannot list the run's head", error=str(exc))
            head = None
        node = self.node
        error = node.last_error if node is not None else None
        return {
            "run": self.run,
            "node": self.node_id,
            "version": version,
            "label": self.gate.label,
            "head": head,
            "lag": None if head is None or version is None else max(0, head - version),
            "updates": driver.pauses if driver is not None else 0,
            "waiting": self.gate.waiting,
            # [version (None: a full load), seconds new requests were held, of which
            # waiting for admitted requests to finish], newest last
            "recent_pauses": [
                [v, round(held, 6), round(drain, 6)]
                for v, held, drain in (driver.recent_pauses if driver else ())
            ],
            "last_error": None if error is None else str(error),
        }

    async def _weights_route(self) -> Any:
        """Content hashes of the held weights, read from the workers (checks)."""
        from fastapi.responses import JSONResponse

        node, target, driver = self.node, self.target, self.driver
        if node is None or target is None:
            return JSONResponse({"error": "no weights loaded"}, status_code=503)

        def held() -> tuple[int, int | None]:
            """(weight changes made, the version the engine holds): what status reports,
            set once a change's weights are in, before the node's loop records it."""
            if driver is None:
                return 0, node.applied_version
            return driver.pauses, driver.version

        before = held()
        try:
            hashes = await asyncio.to_thread(target.hashes)
        except DeltasyncError as exc:  # e.g. a delta being prepared right now
            return JSONResponse({"error": str(exc)}, status_code=409)
        if held() != before or (driver is not None and not self.gate.is_open):
            # The hashes and the version must come from the same weights.
            error = "the weights changed while they were hashed; ask again"
            return JSONResponse({"error": error}, status_code=409)
        version = before[1]
        digest = state_hash(sorted(hashes.items()))
        return {"version": version, "state_hash": digest, "tensors": hashes}


__all__ = ["VersionTagger", "gate_request", "run_serve", "server_argv"]
