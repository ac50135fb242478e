"""Typed events and the Redis stream they travel on.

One stream per run, ``deltasync:run:<run>:events``; each entry holds one JSON
object in its ``event`` field. Events are hints: the store is the truth, so a
reader logs and skips anything malformed, and a consumer that finds the stream
trimmed past its position falls back to the store (``EventStream.check_gap``).
"""

from __future__ import annotations

import json
import math
import re
import time as _time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import UTC, datetime
from typing import (
    Any,
    ClassVar,
    Literal,
    Self,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

import redis
import structlog

from pipeline.errors import ConfigError, EventError
from pipeline.redis_server import redis_errors

log = structlog.get_logger(__name__)

EVENT_SCHEMA = 1
MAX_EVENT_BYTES = 64 * 1024
DEFAULT_MAXLEN = 10_000
RUNS_KEY = "deltasync:runs"
ENTRY_FIELD = "event"
RUN_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_STREAM_ID = re.compile(r"(\d+)-(\d+)")
# Blocking reads stop this long before the client's socket timeout would fire.
_BLOCK_MARGIN_MS = 1000


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name, else ConfigError."""
    if not isinstance(run, str) or not RUN_NAME_PATTERN.fullmatch(run):
        raise ConfigError(f"invalid run name {run!r}: use [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return run


def stream_key(run: str) -> str:
    return f"deltasync:run:{check_run_name(run)}:events"


def now_iso() -> str:
    """The current UTC time, ISO 8601 with microseconds and a ``Z``."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_time(value: str) -> datetime:
    """An event time as an aware UTC datetime; EventError if it is not ISO 8601 with a zone."""
    try:
        parsed = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise EventError(f"time {_short(value)} is not ISO 8601") from None
    if parsed.tzinfo is None:
        raise EventError(f"time {_short(value)} has no time zone")
    return parsed.astimezone(UTC)


# --------------------------------------------------------------------------- event types


@dataclass(frozen=True, kw_only=True)
class _Event:
    """Fields every event has. Instances are valid by construction (EventError if not)."""

    TYPE: ClassVar[str] = ""

    run: str
    version: int
    time: str = field(default_factory=now_iso)

    @classmethod
    def now(cls, **values: Any) -> Self:
        """An event stamped with the current time."""
        return cls(time=now_iso(), **values)

    @property
    def type(self) -> str:
        return self.TYPE

    @property
    def at(self) -> datetime:
        return parse_time(self.time)

    def __post_init__(self) -> None:
        what = f"{self.TYPE} event"
        hints = _hints(type(self))
        for spec in fields(self):
            value = _typed(getattr(self, spec.name), hints[spec.name], what, spec.name)
            object.__setattr__(self, spec.name, value)  # ints given for floats become floats
        if not RUN_NAME_PATTERN.fullmatch(self.run):
            raise EventError(f"{what}: invalid run name {_short(self.run)}")
        if self.version < 0:
            raise EventError(f"{what} of run {self.run}: negative version {self.version}")
        parse_time(self.time)
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, str) and _CONTROL.search(value):
                raise EventError(f"{what} of run {self.run}: control character in {spec.name}")
            if isinstance(value, float) and not math.isfinite(value):
                raise EventError(f"{what} of run {self.run}: {spec.name} is not finite")
        self._check(what)

    def _check(self, what: str) -> None:
        """Type-specific rules; ``what`` names the event in messages."""

    def _non_negative(self, what: str, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise EventError(f"{what} of run {self.run}: {name} is negative ({value})")

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.TYPE, "schema": EVENT_SCHEMA}
        for spec in fields(self):
            doc[spec.name] = getattr(self, spec.name)
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True, kw_only=True)
class StepCompleted(_Event):
    """The trainer finished step ``version``; its full weights are at ``checkpoint``."""

    TYPE: ClassVar[str] = "step-completed"

    checkpoint: str  # path or URL of a safetensors file or folder
    owned: bool  # deltasync wrote it to staging and may delete it once published
    level: int | None = None  # codec level; None = the worker's setting

    def _check(self, what: str) -> None:
        if not self.checkpoint:
            raise EventError(f"{what} of run {self.run}: empty checkpoint")


@dataclass(frozen=True, kw_only=True)
class DeltaAvailable(_Event):
    """Version ``version`` is published; ``manifest`` is its manifest's store key."""

    TYPE: ClassVar[str] = "delta-available"

    kind: Literal["delta", "anchor"]
    parent: int | None
    anchor: int
    bytes: int
    changed: int
    total: int
    manifest: str

    def _check(self, what: str) -> None:
        self._non_negative(what, "parent", "anchor", "bytes", "changed", "total")
        if self.changed > self.total:
            raise EventError(f"{what} of run {self.run}: changed > total")
        if not self.manifest:
            raise EventError(f"{what} of run {self.run}: empty manifest key")


@dataclass(frozen=True, kw_only=True)
class AnchorAvailable(_Event):
    """A full anchor of ``version`` is published."""

    TYPE: ClassVar[str] = "anchor-available"

    bytes: int
    manifest: str
    reason: str

    def _check(self, what: str) -> None:
        self._non_negative(what, "bytes")
        if not self.manifest:
            raise EventError(f"{what} of run {self.run}: empty manifest key")


@dataclass(frozen=True, kw_only=True)
class CompactionRequested(_Event):
    """Someone (the policy, an operator) asked for an anchor at ``version``."""

    TYPE: ClassVar[str] = "compaction-requested"

    reason: str
    requested_by: str


@dataclass(frozen=True, kw_only=True)
class DeltaApplied(_Event):
    """Replica ``node`` now holds ``version``."""

    TYPE: ClassVar[str] = "delta-applied"

    node: str
    fetch_s: float
    apply_s: float
    pause_s: float
    latency_s: float | None = None  # from step-completed to applied (clocks may differ)
    state_hash: str | None = None  # the replica's state hash after applying

    def _check(self, what: str) -> None:
        if not self.node:
            raise EventError(f"{what} of run {self.run}: empty node")
        self._non_negative(what, "fetch_s", "apply_s", "pause_s")


@dataclass(frozen=True, kw_only=True)
class ReplicaError(_Event):
    """Replica ``node`` failed at ``version``; ``recovering`` if it is rebuilding from the store."""

    TYPE: ClassVar[str] = "replica-error"

    node: str
    error: str
    recovering: bool

    def _check(self, what: str) -> None:
        if not self.node:
            raise EventError(f"{what} of run {self.run}: empty node")


Event = (
    StepCompleted
    | DeltaAvailable
    | AnchorAvailable
    | CompactionRequested
    | DeltaApplied
    | ReplicaError
)
EVENT_TYPES: dict[str, type[_Event]] = {
    cls.TYPE: cls
    for cls in (
        StepCompleted,
        DeltaAvailable,
        AnchorAvailable,
        CompactionRequested,
        DeltaApplied,
        ReplicaError,
    )
}


# --------------------------------------------------------------------------- parsing


def parse_event(data: Mapping[str, Any] | str | bytes) -> Event:
    """Validate a decoded JSON object (or its text) as an event; EventError if it is not one.

    Unknown extra fields are ignored, so newer writers can add fields.
    """
    if isinstance(data, str | bytes):
        if len(data) > MAX_EVENT_BYTES:
            raise EventError(f"event of {len(data)} bytes exceeds {MAX_EVENT_BYTES}")
        try:
            data = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise EventError(f"event is not JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise EventError(f"event is a JSON {type(data).__name__}, not an object")
    kind = data.get("type")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventError(f"unknown event type {_short(kind)}")
    schema = data.get("schema")
    if schema != EVENT_SCHEMA or isinstance(schema, bool):
        raise EventError(f"{kind} event: unsupported schema {_short(schema)}")
    values: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.name in data:
            values[spec.name] = data[spec.name]
        elif spec.default is MISSING and spec.default_factory is MISSING:
            raise EventError(f"{kind} event: missing field {spec.name}")
    return cls(**values)  # type: ignore[return-value]  # every registered class is in Event


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _typed(value: Any, hint: Any, what: str, name: str) -> Any:
    """``value`` if it has JSON type ``hint`` (ints accepted for floats), else EventError."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _typed(value, inner, what, name)
    if origin is Literal:
        if value in get_args(hint) and isinstance(value, str):
            return value
        raise EventError(f"{what}: {name} must be one of {list(get_args(hint))}")
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = not _not_int(value)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a field type this parser does not know
        raise TypeError(f"unsupported event field type {hint!r}")
    if not ok:
        raise EventError(f"{what}: {name} must be {hint.__name__}, got {_short(value)}")
    return value


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


# --------------------------------------------------------------------------- stream ids


def parse_id(stream_id: str | bytes) -> tuple[int, int]:
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    match = _STREAM_ID.fullmatch(text)
    if match is None:
        raise EventError(f"invalid stream id {text!r}")
    return int(match.group(1)), int(match.group(2))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
        self.added_key = f"{self.key}:added"

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
            self._queue(pipeline, payload)
            return None
        with (
            redis_errors(self.redis, f"publishing to {self.key}"),
            self.redis.pipeline(transaction=True) as pipe,
        ):
            self._queue(pipe, payload)
            results = pipe.execute()
        return _text(results[0])

    def _queue(self, pipe: redis.client.Pipeline, payload: str) -> None:
        pipe.xadd(self.key, {ENTRY_FIELD: payload}, maxlen=self.maxlen, approximate=True)
        pipe.incr(self.added_key)
        pipe.sadd(RUNS_KEY, self.run)

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
                entry_id = _text(raw_id)
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
        return _text(info["last-generated-id"])

    def first_id(self) -> str | None:
        """The id of the oldest entry still in the stream, or None if it is empty."""
        with redis_errors(self.redis, f"reading {self.key}"):
            head: Any = self.redis.xrange(self.key, count=1)
        return _text(head[0][0]) if head else None

    def length(self) -> int:
        with redis_errors(self.redis, f"reading {self.key}"):
            return int(self.redis.xlen(self.key))

    def check_gap(self, after_id: str) -> bool:
        """True if entries newer than ``after_id`` may have been trimmed away.

        Exact on Redis >= 7 (``max-deleted-entry-id``). On older servers it is
        conservative: once the stream has been trimmed at all, a position older
        than the first remaining entry counts as a gap, even when the only
        entries removed were at or before it.
        """
        position = parse_id(after_id)
        with (
            redis_errors(self.redis, f"reading {self.key}"),
            self.redis.pipeline(transaction=False) as pipe,
        ):
            pipe.xinfo_stream(self.key)
            pipe.get(self.added_key)
            info, added = pipe.execute(raise_on_error=False)
        if isinstance(info, redis.ResponseError):  # no stream: nothing to compare with
            return False
        if isinstance(info, Exception):
            raise info
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None:
            return parse_id(deleted) > position
        if added is None or int(added) <= int(info["length"]):
            return False  # never trimmed
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
        except EventError as exc:
            log.warning("skipping malformed event", stream=self.key, id=entry_id, error=str(exc))
            return None


# --------------------------------------------------------------------------- runs


def list_runs(client: redis.Redis) -> list[str]:
    """Names of the runs that have published events, sorted."""
    with redis_errors(client, f"reading {RUNS_KEY}"):
        members = client.smembers(RUNS_KEY)
    names = sorted(_text(m) for m in members)
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
