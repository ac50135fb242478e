"""The Redis stream a run's events travel on.

One stream per run, ``deltasync:run:<run>:events``; each entry holds one JSON
object in its ``event`` field. Events are hints: the store is the truth, so a
reader logs and skips anything malformed, and a consumer that finds the stream
trimmed past its position falls back to the store (``EventStream.check_gap``).
The events themselves are defined in pipeline/coord/events.py.
"""

from __future__ import annotations

import re
import time as _time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

import redis
import structlog

from pipeline.coord.connection import redis_errors, text
from pipeline.coord.events import (
    MAX_EVENT_BYTES,
    RUN_NAME_PATTERN,
    DeltaAvailable,
    Event,
    check_run_name,
    parse_event,
)
from pipeline.coord.keys import announced_head_key, runs_key, stream_added_key, stream_key
from pipeline.errors import ConfigError, EventError

log = structlog.get_logger(__name__)

DEFAULT_MAXLEN = 10_000
RUNS_KEY = runs_key()
ENTRY_FIELD = "event"
_STREAM_ID = re.compile(r"(\d+)-(\d+)")
# Blocking reads stop this long before the client's socket timeout would fire.
_BLOCK_MARGIN_MS = 1000
ANNOUNCED_HEAD_TTL_S = 30 * 24 * 3600  # as long as the once-only markers of announcements

# Raise the announced head to ARGV[1] unless it is higher already. KEYS: announced head.
_RAISE_ANNOUNCED = """
local held = tonumber(redis.call('GET', KEYS[1]) or '-1') or -1
if tonumber(ARGV[1]) > held then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""


# --------------------------------------------------------------------------- stream ids


def parse_id(stream_id: str | bytes) -> tuple[int, int]:
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    match = _STREAM_ID.fullmatch(text)
    if match is None:
        raise EventError(f"invalid stream id {text!r}")
    return int(match.group(1)), int(match.group(2))


# --------------------------------------------------------------------------- the stream


class EventStream:
    """The event stream of one run.

    ``publish`` appends (trimming approximately to ``maxlen``); ``read`` and
    ``follow`` tail it from an id. Malformed entries never raise: they are
    logged and come back as ``None`` (``read``) or are skipped (``follow``).
    Connection failures raise ServiceUnavailableError.
    """

    def __init__(self, client: redis.Redis, run: str, maxlen: int = DEFAULT_MAXLEN) -> None:
        if maxlen < 1:
            raise ConfigError(f"event stream maxlen must be >= 1, got {maxlen}")
        self.redis = client
        self.run = check_run_name(run)
        self.maxlen = maxlen
        self.key = stream_key(run)
        # Counts every entry ever added; with XLEN it tells whether trimming happened.
        self.added_key = stream_added_key(run)
        # The newest version a delta-available event was ever sent for: a store that
        # no longer shows it was frozen or rolled back behind the run's back.
        self.announced_key = announced_head_key(run)

    # -- writing

    @overload
    def publish(self, event: Event) -> str: ...

    @overload
    def publish(self, event: Event, *, pipeline: redis.client.Pipeline) -> None: ...

    def publish(self, event: Event, *, pipeline: redis.client.Pipeline | None = None) -> str | None:
        """Append ``event``; returns its stream id.

        With ``pipeline``, the commands are queued there (the XADD first, so
        its id is the first result of ``execute()``) and None is returned.
        """
        if event.run != self.run:
            raise EventError(f"{event.type} event of run {event.run} sent to stream of {self.run}")
        payload = event.to_json()
        if len(payload.encode()) > MAX_EVENT_BYTES:
            raise EventError(
                f"{event.type} event of run {self.run} v{event.version} "
                f"exceeds {MAX_EVENT_BYTES} bytes"
            )
        if pipeline is not None:
            self._queue(pipeline, payload, event)
            return None
        with (
            redis_errors(self.redis, f"publishing to {self.key}"),
            self.redis.pipeline(transaction=True) as pipe,
        ):
            self._queue(pipe, payload, event)
            results = pipe.execute()
        return text(results[0])

    def _queue(self, pipe: redis.client.Pipeline, payload: str, event: Event) -> None:
        pipe.xadd(self.key, {ENTRY_FIELD: payload}, maxlen=self.maxlen, approximate=True)
        pipe.incr(self.added_key)
        pipe.sadd(RUNS_KEY, self.run)
        if isinstance(event, DeltaAvailable):
            pipe.eval(_RAISE_ANNOUNCED, 1, self.announced_key, event.version, ANNOUNCED_HEAD_TTL_S)

    def trim(self, maxlen: int | None = None, *, approximate: bool = True) -> int:
        """Keep about ``maxlen`` (default: the stream's) newest entries; returns how many went."""
        with redis_errors(self.redis, f"trimming {self.key}"):
            return int(
                self.redis.xtrim(
                    self.key,
                    maxlen=self.maxlen if maxlen is None else maxlen,
                    approximate=approximate,
                )
            )

    # -- reading

    def read(
        self, after_id: str = "0-0", block_ms: int | None = None, count: int = 100
    ) -> list[tuple[str, Event | None]]:
        """Up to ``count`` entries after ``after_id``; waits up to ``block_ms`` for one."""
        parse_id(after_id)
        block = None if block_ms is None else self._block_ms(block_ms)
        with redis_errors(self.redis, f"reading {self.key}"):
            response: Any = self.redis.xread({self.key: after_id}, count=count, block=block)
        entries: list[tuple[str, Event | None]] = []
        for _stream, items in response or []:
            for raw_id, raw_fields in items:
                entry_id = text(raw_id)
                entries.append((entry_id, self._decode(entry_id, raw_fields)))
        return entries

    def follow(
        self,
        after_id: str = "0-0",
        block_ms: int = 1000,
        stop: Callable[[], bool] = lambda: False,
        on_gap: Callable[[str], None] | None = None,
        count: int = 100,
    ) -> Iterator[tuple[str, Event]]:
        """Yield valid events after ``after_id`` until ``stop()`` is true.

        Each read continues from the last id received (never ``$``), so
        nothing written between two reads is lost. Whenever new entries arrive,
        ``on_gap(position)`` is called first if entries after ``position`` were
        trimmed away: the consumer must then catch up from the store.
        """
        position = after_id
        while not stop():
            entries = self.read(position, block_ms=block_ms, count=count)
            if entries and on_gap is not None and self.check_gap(position):
                log.warning("event stream trimmed past position", stream=self.key, after=position)
                on_gap(position)
            for entry_id, event in entries:
                position = entry_id
                if event is not None:
                    yield entry_id, event

    def last_id(self) -> str:
        """The id of the newest entry ever added ("0-0" if none): follow from here for new ones."""
        with redis_errors(self.redis, f"reading {self.key}"):
            try:
                info: Any = self.redis.xinfo_stream(self.key)
            except redis.ResponseError:  # no such key
                return "0-0"
        return text(info["last-generated-id"])

    def announced_head(self, scan: int = 0) -> int | None:
        """The newest version a ``delta-available`` event was sent for, None if none is
        known: the run's announced-head key, and with ``scan`` also the newest
        ``delta-available`` among the last ``scan`` entries (events sent before the key
        existed)."""
        with redis_errors(self.redis, f"reading {self.announced_key}"):
            raw: Any = self.redis.get(self.announced_key)
            entries: Any = self.redis.xrevrange(self.key, count=scan) if scan > 0 else []
        found = [int(raw)] if raw is not None and text(raw).isdigit() else []
        for entry_id, fields in entries:
            event = self._decode(text(entry_id), fields)
            if isinstance(event, DeltaAvailable):
                found.append(event.version)
        return max(found, default=None)

    def first_id(self) -> str | None:
        """The id of the oldest entry still in the stream, or None if it is empty."""
        with redis_errors(self.redis, f"reading {self.key}"):
            head: Any = self.redis.xrange(self.key, count=1)
        return text(head[0][0]) if head else None

    def length(self) -> int:
        with redis_errors(self.redis, f"reading {self.key}"):
            return int(self.redis.xlen(self.key))

    def check_gap(self, after_id: str) -> bool:
        """True if entries newer than ``after_id`` may have been trimmed away.

        Conservative: once the stream has lost entries at all, a position older than
        the first remaining entry counts as a gap, even when the only entries removed
        were at or before it (a spurious sync with the store is harmless). Whether
        entries were lost comes from ``entries-added`` on Redis >= 7, else from this
        stream's own count of publishes. ``max-deleted-entry-id`` alone is not enough:
        Redis 7.0 moves it on XDEL but not when XTRIM or XADD's MAXLEN trims.
        """
        position = parse_id(after_id)
        with (
            redis_errors(self.redis, f"reading {self.key}"),
            self.redis.pipeline(transaction=False) as pipe,
        ):
            pipe.xinfo_stream(self.key)
            pipe.get(self.added_key)
            info, counted = pipe.execute(raise_on_error=False)
        if isinstance(info, redis.ResponseError):  # no stream: nothing to compare with
            return False
        if isinstance(info, Exception):
            raise info
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None and parse_id(deleted) > position:
            return True
        added = info.get("entries-added", counted)
        if added is None or int(added) <= int(info["length"]):
            return False  # nothing ever removed
        first = info.get("first-entry")
        if not first:
            return parse_id(info["last-generated-id"]) > position
        return parse_id(first[0]) > position

    def _block_ms(self, block_ms: int) -> int:
        timeout = self.redis.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is None:
            return max(block_ms, 1)
        return max(1, min(block_ms, int(timeout * 1000) - _BLOCK_MARGIN_MS))

    def _decode(self, entry_id: str, raw_fields: Mapping[Any, Any]) -> Event | None:
        try:
            payload = raw_fields.get(ENTRY_FIELD.encode(), raw_fields.get(ENTRY_FIELD))
            if payload is None:
                raise EventError(f"entry has no {ENTRY_FIELD!r} field")
            event = parse_event(payload)
            if event.run != self.run:
                raise EventError(f"event of run {event.run} in the stream of {self.run}")
            return event
        except (EventError, RecursionError, MemoryError, ValueError, TypeError) as exc:
            # A hostile entry must never stop a reader: it stays in the stream.
            error = str(exc)[:200] if isinstance(exc, EventError) else type(exc).__name__
            log.warning("skipping malformed event", stream=self.key, id=entry_id, error=error)
            return None


# --------------------------------------------------------------------------- runs


def list_runs(client: redis.Redis) -> list[str]:
    """Names of the runs that have published events, sorted."""
    with redis_errors(client, f"reading {RUNS_KEY}"):
        members = client.smembers(RUNS_KEY)
    names = sorted(text(m) for m in members)
    return [name for name in names if RUN_NAME_PATTERN.fullmatch(name)]


def wait_for(
    stream: EventStream,
    predicate: Callable[[Event], bool],
    *,
    after_id: str = "0-0",
    timeout_s: float = 60.0,
    block_ms: int = 500,
) -> tuple[str, Event] | None:
    """The first event after ``after_id`` that satisfies ``predicate``, or None on timeout."""
    deadline = _time.monotonic() + timeout_s
    for entry_id, event in stream.follow(
        after_id, block_ms=block_ms, stop=lambda: _time.monotonic() > deadline
    ):
        if predicate(event):
            return entry_id, event
    return None
