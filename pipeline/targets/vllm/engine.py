"""The engine a ``VllmTarget`` drives: a synchronous ``vllm.LLM`` or a served ``AsyncLLM``.

``VllmTarget`` needs three things from an engine: ``collective_rpc`` to the
deltasync worker extension, ``reset_prefix_cache``, and a clean boundary around
every change of the model's weights (``weights_change``). ``SyncEngine`` wraps an
in-process ``LLM``, whose ``generate`` runs on the caller's thread: applies always
fall between two calls, so its boundary is empty. ``ServedEngine`` wraps the
``AsyncLLM`` of an OpenAI-compatible server running on an asyncio loop in the same
process; the target calls it from the rollout node's thread.

The served boundary is where versions change. It closes a ``VersionGate`` (new
generation requests wait at the HTTP layer; in-flight ones finish), pauses
generation in ``wait`` mode, lets the target patch and reset the prefix cache, and
resumes with the new version's label before the gate opens again. A request is
admitted only while the gate is open and holds it until its response is sent, so
no request runs across two versions and the label it was admitted under is the
version that produced it. vllm is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

from pipeline.errors import TargetError, VersionTimeoutError

T = TypeVar("T")
PAUSES_KEPT = 100


@runtime_checkable
class EngineDriver(Protocol):
    """What ``VllmTarget`` calls on an engine."""

    def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[Any]:
        """Call ``method`` of every worker's extension; one answer per worker."""

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (computed with other weights); False when refused."""

    def weights_change(self, version: int | None) -> contextlib.AbstractContextManager[None]:
        """Around every change of the model's weights. ``version``: what the model
        holds when the block succeeds, None when not known yet (a load whose
        version the node names afterwards, through ``ServedEngine.publish``)."""


class SyncEngine:
    """A synchronous in-process ``vllm.LLM``."""

    def __init__(self, llm: Any) -> None:
        if not hasattr(llm, "collective_rpc"):
            raise TargetError(f"{type(llm).__name__} is not a vLLM LLM (no collective_rpc)")
        self.llm = llm

    def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[Any]:
        return list(self.llm.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def weights_change(self, version: int | None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def as_driver(engine: Any) -> EngineDriver:
    """``engine`` itself when it is a driver, else a ``SyncEngine`` over it."""
    if isinstance(engine, EngineDriver):
        return engine
    return SyncEngine(engine)


class VersionGate:
    """Admission of generation requests by version (lives on the server's loop).

    Open: requests enter with the current label (``RUN@VERSION``). Closed: new
    requests wait; the closer waits for the ones inside to leave. ``version`` None
    while open means the model holds no known version: requests are refused
    (``enter`` returns None). A request may ask for a version (``min_version``): it
    waits, without polling, until the gate is open at that version or a newer one,
    for at most ``timeout_s`` (then ``VersionTimeoutError``; it was never admitted).
    """

    def __init__(self, run: str, version: int | None = None) -> None:
        self.run = run
        self.version = version
        self.active = 0
        self._open = version is not None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closers = 0
        # One future per waiting request, resolved when the gate reopens (or its
        # time is up): each waiter wakes once per reopening, never by a timer loop.
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def label(self) -> str | None:
        return None if self.version is None else f"{self.run}@{self.version}"

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def waiting(self) -> int:
        """Requests (and long polls) waiting for the gate or for a version."""
        return len(self._waiters)

    def admits(self, min_version: int | None = None) -> bool:
        return self._open and (min_version is None or self.reached(min_version))

    def reached(self, version: int) -> bool:
        """The model holds ``version`` or a newer one (open or not)."""
        return self.version is not None and self.version >= version

    async def enter(
        self, min_version: int | None = None, *, timeout_s: float | None = None
    ) -> str | None:
        """Wait until admitted (at ``min_version`` or newer when given), count the
        request in, and return the label it runs under (None: refused)."""
        if min_version is None:
            await self._until(self.admits, None)
        else:
            await self._until(lambda: self.admits(min_version), timeout_s, min_version)
        self.active += 1
        self._idle.clear()
        return self.label

    async def wait_for(self, version: int, *, timeout_s: float | None = None) -> None:
        """Return once the model holds ``version`` or newer (a long poll; admits nothing)."""
        await self._until(lambda: self.reached(version), timeout_s, version)

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def close(self) -> None:
        """Stop admitting, then wait until no admitted request is left."""
        self._closers += 1
        self._open = False
        await self._idle.wait()

    def reopen(self, version: int | None, *, keep_closed: bool = False) -> None:
        """Set the version (no request is inside) and admit again, unless another
        closer still holds the gate or ``keep_closed``."""
        self._closers = max(0, self._closers - 1)
        self.version = version
        if not keep_closed and self._closers == 0:
            self._open = True
        for waiter in list(self._waiters):
            _wake(waiter)

    async def _until(
        self, ready: Callable[[], bool], timeout_s: float | None, asked: int | None = None
    ) -> None:
        if ready():
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            timer = None if deadline is None else loop.call_at(deadline, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiters.discard(waiter)
                if timer is not None:
                    timer.cancel()
            if ready():
                return
            if deadline is not None and loop.time() >= deadline:
                held = "no version" if self.version is None else f"version {self.version}"
                raise VersionTimeoutError(
                    f"version {asked} not reached within {timeout_s:g} s; the model holds {held}"
                )


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ServedEngine:
    """An ``AsyncLLM`` serving on ``loop``, driven from another thread.

    ``on_label(label)`` runs on the loop whenever the served version changes, while
    no request is admitted (the server stamps it on its responses from then on).
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        run: str,
        gate: VersionGate,
        on_label: Callable[[str | None], None] = lambda _label: None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.run = run
        self.gate = gate
        self.on_label = on_label
        self.version: int | None = None
        self.pauses = 0  # weight changes made (each one pause of generation)
        # Of the latest weight changes: (version or None for a full load, seconds new
        # requests were held (gate closed to gate open), of which the drain: waiting
        # for the requests already admitted to finish).
        self.recent_pauses: deque[tuple[int | None, float, float]] = deque(maxlen=PAUSES_KEPT)
        self._drained_s = 0.0

    def label_of(self, version: int | None) -> str | None:
        return None if version is None else f"{self.run}@{version}"

    def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        async def wrapped() -> T:
            return await make()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise TargetError("ServedEngine is called from the server's loop; use a thread")
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result()

    def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[Any]:
        return list(self._call(lambda: self.engine.collective_rpc(method, args=args)))

    def reset_prefix_cache(self) -> bool:
        return bool(self._call(self.engine.reset_prefix_cache))

    async def _pause(self) -> None:
        started = time.perf_counter()
        await self.gate.close()
        self._drained_s = time.perf_counter() - started
        # Nothing admitted is left running; "wait" also lets any request that
        # reached the engine another way finish on the old weights.
        await self.engine.pause_generation(mode="wait", clear_cache=False)

    async def _resume(self, version: int | None, known: bool) -> None:
        try:
            await self.engine.resume_generation()
        finally:
            label = self.label_of(version)
            if label != self.gate.label:
                self.on_label(label)
            # A load whose version the node has not named yet stays closed until
            # ``publish``; a failed one opens with no label (requests refused).
            self.gate.reopen(version, keep_closed=not known)

    @contextlib.contextmanager
    def weights_change(self, version: int | None) -> Iterator[None]:
        started = time.perf_counter()
        self._call(self._pause)
        self.pauses += 1
        done = False
        try:
            yield
            done = True
        finally:
            if done:
                if version is not None:
                    self.version = version
                after, known = self.version, version is not None
            else:
                # A failed patch is rolled back by the workers (the old version
                # stands); a failed load leaves no known version.
                after, known = (self.version if version is not None else None), True
                if version is None:
                    self.version = None
            self._call(lambda: self._resume(after, known))
            held = time.perf_counter() - started
            self.recent_pauses.append((version, held, self._drained_s))

    def publish(self, version: int | None) -> None:
        """The node holds ``version`` (verified): label it and admit requests. Called
        by the node after every apply; a no-op when the label already says so."""

        async def relabel() -> None:
            if self.gate.is_open and self.gate.label == self.label_of(version):
                return
            if self.gate.is_open:
                await self.gate.close()
            self.version = version
            label = self.label_of(version)
            if label != self.gate.label:
                self.on_label(label)
            self.gate.reopen(version)

        self._call(relabel)
