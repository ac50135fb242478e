"""A run's history as plain data, from its event stream (and the store for sizes): per
version the changed fraction, the delta's bytes against the full checkpoint and a raw
format, the latency from ``step-completed`` to available and to every replica applied;
per replica its lag behind the head over time. ``deltasync report`` draws it.

The stream keeps the newest events only (it is trimmed), so a long run's report covers
its recent versions. Times are the event times, each from the clock of its sender.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import redis

from pipeline.coord.events import (
    AnchorAvailable,
    DeltaApplied,
    DeltaAvailable,
    Event,
    StepCompleted,
)
from pipeline.coord.stream import EventStream
from pipeline.errors import DeltasyncError
from pipeline.format.manifest import dtype_from_name
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

# Raw format of a sparse delta: an int32 index per changed element beside its value.
RAW_INDEX_BYTES = 4


@dataclass
class VersionRow:
    version: int
    kind: str = "delta"  # as published first (a later anchor of it is marked apart)
    anchored: bool = False  # an anchor of this version was written (compaction)
    changed: int = 0
    total: int = 0
    bytes: int = 0
    step_at: datetime | None = None
    available_at: datetime | None = None
    applied_at: dict[str, datetime] = field(default_factory=dict)  # node -> first applied
    # Nodes already following when the step came (a late joiner's catch-up is not a sync).
    followers: set[str] = field(default_factory=set)

    @property
    def changed_fraction(self) -> float | None:
        return self.changed / self.total if self.total and self.kind == "delta" else None

    @property
    def available_s(self) -> float | None:
        if self.step_at is None or self.available_at is None:
            return None
        return max(0.0, (self.available_at - self.step_at).total_seconds())

    @property
    def synced_s(self) -> float | None:
        """step-completed to the last replica that was following the run applied it."""
        times = [t for n, t in self.applied_at.items() if n in self.followers]
        if self.step_at is None or not times:
            return None
        return max(0.0, (max(times) - self.step_at).total_seconds())


@dataclass
class RunReport:
    run: str
    versions: list[VersionRow]
    full_bytes: int  # the whole checkpoint at its dtypes (from the newest anchor)
    value_bytes: float  # mean bytes per element
    lag: dict[str, list[tuple[datetime, int]]]  # node -> (time, versions behind the head)
    events: int

    def raw_bytes(self, row: VersionRow) -> int:
        return round(row.changed * (RAW_INDEX_BYTES + self.value_bytes))

    @property
    def nodes(self) -> list[str]:
        return sorted(self.lag)


def collect(client: redis.Redis, store: ObjectStore, run: str) -> RunReport:
    """Read the whole stream of ``run`` and the newest anchor's manifest."""
    stream = EventStream(client, run)
    events: list[Event] = []
    after = "0-0"
    while batch := stream.read(after_id=after, count=1000):
        events.extend(e for _, e in batch if e is not None)
        after = batch[-1][0]
    full_bytes, numel = _full_size(store, run)
    return build(run, events, full_bytes, numel)


def build(run: str, events: Iterable[Event], full_bytes: int, numel: int) -> RunReport:
    rows: dict[int, VersionRow] = {}
    lag: dict[str, list[tuple[datetime, int]]] = {}
    held: dict[str, int] = {}
    head: int | None = None
    count = 0

    def row(version: int) -> VersionRow:
        return rows.setdefault(version, VersionRow(version))

    for event in sorted(events, key=lambda e: e.at):
        count += 1
        if isinstance(event, StepCompleted):
            row(event.version).step_at = event.at
        elif isinstance(event, DeltaAvailable):
            r = row(event.version)
            if r.available_at is None:
                r.kind, r.available_at = event.kind, event.at
                r.changed, r.total, r.bytes = event.changed, event.total, event.bytes
            head = event.version if head is None else max(head, event.version)
        elif isinstance(event, AnchorAvailable):
            row(event.version).anchored = True
        elif isinstance(event, DeltaApplied):
            row(event.version).applied_at.setdefault(event.node, event.at)
            held[event.node] = max(held.get(event.node, event.version), event.version)
        else:
            continue
        if head is not None:
            for node, version in held.items():
                lag.setdefault(node, []).append((event.at, max(0, head - version)))
    if numel == 0:
        numel = max((r.total for r in rows.values()), default=0)
    value_bytes = full_bytes / numel if numel else 2.0
    versions = [rows[v] for v in sorted(rows) if rows[v].available_at is not None]
    first_applied: dict[str, datetime] = {}
    for r in versions:
        for node, at in r.applied_at.items():
            first_applied[node] = min(at, first_applied.get(node, at))
    for r in versions:
        r.followers = {
            n
            for n in r.applied_at
            if r is versions[0] or r.step_at is None or first_applied[n] < r.step_at
        }
    return RunReport(run, versions, full_bytes, value_bytes, lag, count)


def _full_size(store: ObjectStore, run: str) -> tuple[int, int]:
    """(bytes, elements) of the run's weights at their dtypes, from its newest anchor."""
    try:
        index = chain.list_versions(store, run)
        if not index.anchors:
            return 0, 0
        manifest = chain.load_manifest(store, run, "anchor", max(index.anchors))
    except DeltasyncError:
        return 0, 0
    nbytes = sum(t.numel * dtype_from_name(t.dtype).itemsize for t in manifest.tensors)
    return nbytes, sum(t.numel for t in manifest.tensors)
