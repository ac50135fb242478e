"""Following the event stream for the rollout node.

Events are hints: the follower only says when to sync with the store early. It
copes with an unreachable stream, one trimmed past its position and one
recreated by a Redis restart, and remembers when each version was first
announced, for latency figures.
"""

from __future__ import annotations

import contextlib
import threading

import structlog

from pipeline.coord.events import AnchorAvailable, DeltaAvailable, Event, StepCompleted
from pipeline.coord.stream import EventStream, parse_id
from pipeline.errors import DeltasyncError

# The node's logger, so these lines keep the logger name they always had.
log = structlog.get_logger("pipeline.rollout.node")

_LATENCY_MEMORY = 256  # event times remembered for latency figures
_RECONNECT_S = 1.0  # how often an unreachable event stream is tried again
_STOP_CHECK_S = 1.0  # longest wait between checks of the stop flag


class StreamFollower:
    """Reads ``events`` for ``run`` (None: no stream, only waits)."""

    def __init__(self, events: EventStream | None, run: str) -> None:
        self.events = events
        self.run_name = run
        self._event_times: dict[int, float] = {}  # version -> earliest event time (epoch s)
        self._stream_down = False

    def position(self) -> str:
        """Where reading starts: the stream's current end, or its start."""
        if self.events is None:
            return "0-0"
        try:
            return self.events.last_id()
        except DeltasyncError as exc:
            log.warning("event stream unavailable, polling the store", error=str(exc))
            return "0-0"

    def first_seen(self, version: int) -> float | None:
        """When ``version`` was first announced (epoch s), forgotten once asked."""
        return self._event_times.pop(version, None)

    def wait(
        self, after_id: str, wait_s: float, stop: threading.Event, held: int | None
    ) -> tuple[bool, str]:
        """Wait up to ``wait_s`` for an event announcing a version newer than
        ``held``. Returns (woken, new stream position)."""
        if self.events is None:
            stop.wait(wait_s)
            return False, after_id
        try:
            # Short blocks keep ``stop`` responsive; the caller loops until its deadline.
            block_ms = max(1, int(min(wait_s, _STOP_CHECK_S) * 1000))
            entries = self.events.read(after_id, block_ms=block_ms)
        except DeltasyncError as exc:
            if not self._stream_down:
                log.warning("event stream unavailable, polling the store", error=str(exc))
            self._stream_down = True
            stop.wait(min(wait_s, _RECONNECT_S))
            return False, after_id
        # Events sent while the stream was unreachable are lost: sync once it is back.
        woken, self._stream_down = self._stream_down, False
        if not entries:
            return woken, self._check_stream_reset(after_id)
        woken = self._trimmed_past(after_id) or woken
        for entry_id, event in entries:
            after_id = entry_id
            if event is not None and self._note_event(event, held):
                woken = True
        return woken, after_id

    def _trimmed_past(self, after_id: str) -> bool:
        """Events after our position were trimmed away: some may have announced
        versions, so sync with the store now."""
        assert self.events is not None
        try:
            gap = self.events.check_gap(after_id)
        except DeltasyncError:
            return True
        if gap:
            log.info("event stream trimmed past our position, syncing", position=after_id)
        return gap

    def _check_stream_reset(self, after_id: str) -> str:
        """A stream recreated by a Redis restart restarts its ids below our position:
        read it from the start again (the store sync makes replays harmless)."""
        assert self.events is not None
        try:
            last = self.events.last_id()
        except DeltasyncError:
            return after_id
        if parse_id(last) < parse_id(after_id):
            log.info("event stream was reset, reading it from the start", position=after_id)
            return "0-0"
        return after_id

    def _note_event(self, event: Event, held: int | None) -> bool:
        if event.run != self.run_name:
            return False
        if isinstance(event, StepCompleted | DeltaAvailable | AnchorAvailable):
            with contextlib.suppress(DeltasyncError):
                when = event.at.timestamp()
                known = self._event_times.get(event.version)
                self._event_times[event.version] = when if known is None else min(known, when)
                while len(self._event_times) > _LATENCY_MEMORY:
                    self._event_times.pop(min(self._event_times))
        if isinstance(event, DeltaAvailable | AnchorAvailable):
            return held is None or event.version > held
        return False
