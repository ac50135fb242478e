"""Part hints: each delta object announced as soon as it is uploaded.

A diff job uploads a version's part objects one after the other and writes the
manifest last. Replicas that hear of each part early can fetch it and decode it
against their held weights while later parts are still being encoded, and only
check the results against the manifest once it exists. Hints travel on a Redis
pub/sub channel per run: fire and forget, nothing is stored, and a missed or
wrong hint costs only the early start (the manifest decides what is applied).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
import structlog

from pipeline.coord.events import DeltaPart, parse_event
from pipeline.coord.keys import part_hints_channel
from pipeline.errors import EventError

log = structlog.get_logger(__name__)

_LISTEN_S = 1.0  # longest wait between checks of the stop flag


channel = part_hints_channel  # the run's pub/sub channel of part hints


def publish_part(client: redis.Redis, hint: DeltaPart) -> None:
    """Announce one uploaded part; a Redis failure is logged, never raised (a hint)."""
    try:
        client.publish(channel(hint.run), hint.to_json())
    except redis.RedisError as exc:
        log.info("part hint not sent", run=hint.run, version=hint.version, error=str(exc))


class PartListener:
    """Calls ``on_part`` (on its own thread) with every valid hint of ``run``."""

    def __init__(self, client: redis.Redis, run: str, on_part: Callable[[DeltaPart], None]) -> None:
        self.client, self.run, self.on_part = client, run, on_part
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PartListener:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._listen, name="deltasync-part-hints", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                try:
                    pubsub.subscribe(channel(self.run))
                    while not self._stop.is_set():
                        message = pubsub.get_message(timeout=_LISTEN_S)
                        if message is not None:
                            self._deliver(message)
                finally:
                    pubsub.close()
            except redis.RedisError as exc:
                log.debug("part hints unavailable", run=self.run, error=str(exc))
                self._stop.wait(_LISTEN_S)

    def _deliver(self, message: dict[str, Any]) -> None:
        try:
            hint = parse_event(message.get("data", b""))
        except EventError as exc:
            log.info("malformed part hint skipped", run=self.run, error=str(exc))
            return
        if not isinstance(hint, DeltaPart) or hint.run != self.run:
            return
        try:
            self.on_part(hint)
        except Exception as exc:  # a hint must never take the listener down
            log.warning("part hint handler failed", run=self.run, error=str(exc))
