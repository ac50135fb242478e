"""Typed events: the schema, JSON form and validation of what travels on a run's
event stream (pipeline/coord/stream.py carries them over Redis).

Events are valid by construction; ``parse_event`` turns untrusted JSON into one
or raises EventError.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Mapping
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
)

from pipeline.errors import ConfigError, EventError
from pipeline.format.bounded import MAX_JSON_DEPTH, json_depth, load_json

EVENT_SCHEMA = 1
MAX_EVENT_BYTES = 64 * 1024
RUN_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name, else ConfigError."""
    if not isinstance(run, str) or not RUN_NAME_PATTERN.fullmatch(run):
        raise ConfigError(f"invalid run name {run!r}: use [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return run


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


_OBJECT_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class DeltaPart(_Event):
    """Object ``key`` of delta ``version`` (against ``parent``) is uploaded, before the
    version's manifest: a hint that lets replicas start decoding early. Sent on the
    run's hint channel (pipeline/coord/hints.py), not on its event stream."""

    TYPE: ClassVar[str] = "delta-part"

    parent: int
    key: str
    size: int
    sha256: str

    def _check(self, what: str) -> None:
        self._non_negative(what, "parent", "size")
        if self.parent >= self.version:
            raise EventError(f"{what} of run {self.run}: parent is not before version")
        if not _OBJECT_KEY.fullmatch(self.key):
            raise EventError(f"{what} of run {self.run}: invalid object key {_short(self.key)}")
        if not _SHA256.fullmatch(self.sha256):
            raise EventError(f"{what} of run {self.run}: sha256 is not 64 hex digits")


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
    early_parts: int | None = None  # objects fetched from part hints before the manifest

    def _check(self, what: str) -> None:
        if not self.node:
            raise EventError(f"{what} of run {self.run}: empty node")
        self._non_negative(what, "fetch_s", "apply_s", "pause_s", "early_parts")


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


@dataclass(frozen=True, kw_only=True)
class StepFailed(_Event):
    """Step ``version`` cannot be published and was set aside (pipeline/publish/dead_letters.py)."""

    TYPE: ClassVar[str] = "step-failed"

    reason: str
    checkpoint: str


@dataclass(frozen=True, kw_only=True)
class JobRefused(_Event):
    """A worker refused job ``job_id`` of ``queue``: it names ``function``, not one of
    deltasync's jobs (or carries what deltasync never sets). Nothing of it ran. Sent
    to every run's stream, with version 0: it belongs to no run or version."""

    TYPE: ClassVar[str] = "job-refused"

    job_id: str
    queue: str
    function: str
    reason: str


Event = (
    StepCompleted
    | DeltaAvailable
    | AnchorAvailable
    | CompactionRequested
    | DeltaApplied
    | ReplicaError
    | DeltaPart
    | StepFailed
    | JobRefused
)
EVENT_TYPES: dict[str, type[_Event]] = {cls.TYPE: cls for cls in get_args(Event)}


# --------------------------------------------------------------------------- parsing


def parse_event(data: Mapping[str, Any] | str | bytes) -> Event:
    """Validate a decoded JSON object (or its text) as an event; EventError if it is not one.

    Unknown extra fields are ignored, so newer writers can add fields.
    """
    if isinstance(data, str | bytes):
        data = load_json(data, max_bytes=MAX_EVENT_BYTES, what="event", error=EventError)
    elif json_depth(data) > MAX_JSON_DEPTH:
        raise EventError(f"event: nested deeper than {MAX_JSON_DEPTH} levels")
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
