"""What a rollout node tells others: ``delta-applied`` and ``replica-error`` events,
heartbeats (the replica registry that status, lag and garbage collection read), and
the node's own history of applied versions.

Reporting never fails a sync: an event or heartbeat that cannot be sent is logged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import structlog

from pipeline import metrics
from pipeline.coord import problems as replica_problems
from pipeline.coord import replicas
from pipeline.coord.events import DeltaApplied, Event, ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.errors import DeltasyncError
from pipeline.format.manifest import Manifest

log = structlog.get_logger(__name__)

HISTORY = 1000  # applied versions remembered in RolloutNode.history


@dataclass(frozen=True)
class Applied:
    """One version the node applied (newest last in ``RolloutNode.history``)."""

    version: int
    kind: str  # "anchor" (a bootstrap load) or "delta"
    fetch_s: float  # download time (overlaps earlier applies when prefetching)
    apply_s: float  # target call: decode, checks, write, verify
    pause_s: float  # time the weights were being written (target unavailable)
    latency_s: float | None  # since the version's first event, when one was seen
    early_parts: int = 0  # objects fetched (and proven, where the target can) from part hints


@dataclass(eq=False)
class Reporter:
    """Events, heartbeats and history of one node of ``run``. ``first_seen(version)``
    is when the version's first event arrived (for latency), if one did; with
    ``early_start`` each ``delta-applied`` says how many objects were fetched early."""

    run: str
    node_id: str
    _: KW_ONLY
    events: EventStream | None
    redis: Any
    heartbeat_interval_s: float
    replica_ttl_s: float
    first_seen: Callable[[int], float | None]
    early_start: bool
    history: deque[Applied] = field(init=False, default_factory=lambda: deque(maxlen=HISTORY))
    _last_heartbeat: float = field(init=False, default=0.0)
    # A failure record of this node may be in Redis (also from an earlier process
    # with this node id): the first successful sync removes it.
    _failing: bool = field(init=False, default=True)

    def applied(
        self,
        manifest: Manifest,
        fetch_s: float,
        apply_s: float,
        pause_s: float,
        early_parts: int = 0,
    ) -> None:
        """Record and announce that ``manifest``'s version is applied."""
        since = self.first_seen(manifest.version)
        latency = None if since is None else max(0.0, time.time() - since)
        self.history.append(
            Applied(
                manifest.version, manifest.kind, fetch_s, apply_s, pause_s, latency, early_parts
            )
        )
        metrics.applied(self.run, manifest.kind, manifest.total_bytes, pause_s, latency)
        self.publish(
            DeltaApplied(
                run=self.run,
                version=manifest.version,
                node=self.node_id,
                fetch_s=fetch_s,
                apply_s=apply_s,
                pause_s=pause_s,
                latency_s=latency,
                state_hash=manifest.state_hash,
                early_parts=early_parts if self.early_start else None,
            )
        )

    def failed(self, held: int | None, exc: DeltasyncError) -> None:
        """Announce a failed sync; the node keeps ``held`` and recovers."""
        metrics.refused(self.run, "rollout", exc)
        error = f"{type(exc).__name__}: {exc}"
        self.publish(
            ReplicaError(
                run=self.run,
                version=held if held is not None else 0,
                node=self.node_id,
                error=error,
                recovering=True,
            )
        )
        # Seen by status even before the node holds a version (no heartbeat yet).
        if self.redis is not None:
            try:
                replica_problems.report_failure(
                    self.redis, self.run, self.node_id, held, error, ttl_s=self.replica_ttl_s
                )
                self._failing = True
            except DeltasyncError as report_exc:
                log.warning("cannot report the failure", error=str(report_exc))

    def synced(self) -> None:
        """A sync succeeded: the node is no longer listed as failing."""
        if not self._failing or self.redis is None:
            return
        try:
            replica_problems.clear_failure(self.redis, self.run, self.node_id)
            self._failing = False
        except DeltasyncError as exc:
            log.warning("cannot clear the failure record", error=str(exc))

    def publish(self, event: Event) -> None:
        if self.events is None:
            return
        try:
            self.events.publish(event)
        except DeltasyncError as exc:
            log.warning("cannot publish event", type=type(event).__name__, error=str(exc))

    def heartbeat(self, applied: int | None, state_hash: str | None) -> None:
        self._last_heartbeat = time.monotonic()
        if self.redis is None or applied is None or state_hash is None:
            return
        try:
            replicas.report(
                self.redis,
                self.run,
                self.node_id,
                applied,
                state_hash,
                ttl_s=self.replica_ttl_s,
                lease_s=max(replicas.DEFAULT_LEASE_S, 3 * self.heartbeat_interval_s),
            )
        except DeltasyncError as exc:
            log.warning("heartbeat failed", error=str(exc))

    def heartbeat_if_due(self, applied: int | None, state_hash: str | None) -> None:
        if time.monotonic() - self._last_heartbeat >= self.heartbeat_interval_s:
            self.heartbeat(applied, state_hash)
