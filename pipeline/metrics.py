"""Prometheus metrics of deltasync's processes: what diff and compaction workers publish,
what rollout nodes apply, and how long each took.

The metrics live in prometheus_client's default registry, so a process that serves
that registry for its own metrics shows them beside its own. Defining them touches
nothing else; ``workers/metrics_http.py`` serves them.

Latencies run from the step's ``step-completed`` (the trainer's clock) to when this
process saw the version available or applied (its own clock).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# From a few ms (a small delta on one host) to minutes (a big anchor over the network).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

VERSIONS_PUBLISHED = Counter(
    "deltasync_versions_published",
    "Versions this process published to the store (kind: delta or anchor).",
    ["run", "kind"],
)
VERSIONS_APPLIED = Counter(
    "deltasync_versions_applied",
    "Versions this rollout node applied (kind: delta, or anchor for a bootstrap).",
    ["run", "kind"],
)
BYTES_UP = Counter(
    "deltasync_bytes_up",
    "Bytes of objects this process wrote to the store.",
    ["run", "kind"],
)
BYTES_DOWN = Counter(
    "deltasync_bytes_down",
    "Bytes of objects this rollout node applied from the store.",
    ["run", "kind"],
)
DELTA_AVAILABLE_SECONDS = Histogram(
    "deltasync_step_to_available_seconds",
    "From step-completed to the version's delta-available, as its diff worker saw it.",
    ["run"],
    buckets=LATENCY_BUCKETS,
)
APPLIED_SECONDS = Histogram(
    "deltasync_step_to_applied_seconds",
    "From step-completed (the version's first event) to applied on this rollout node.",
    ["run"],
    buckets=LATENCY_BUCKETS,
)
PAUSE_SECONDS = Histogram(
    "deltasync_pause_seconds",
    "Time the target's weights were being written (the model unavailable) per version.",
    ["run", "kind"],
    buckets=PAUSE_BUCKETS,
)
REPLICA_LAG = Gauge(
    "deltasync_replica_lag_versions",
    "The store's head minus the version this rollout node holds, at its last sync.",
    ["run", "node"],
)
REPLICA_VERSION = Gauge(
    "deltasync_replica_version",
    "The version this rollout node holds.",
    ["run", "node"],
)
REFUSALS = Counter(
    "deltasync_refusals",
    "Steps or versions refused, by reason (the error's type): a diff job's bad input, a "
    "rollout node's failed check.",
    ["run", "role", "reason"],
)
SCRUB_MISMATCHES = Counter(
    "deltasync_scrub_mismatches",
    "Held tensors a background scrub found changed behind deltasync's back (role: diff "
    "for a diff worker's state cache, rollout for a node's target).",
    ["run", "role"],
)


def published(run: str, kind: str, nbytes: int, since_step_s: float | None) -> None:
    """A diff or compaction worker published a version of ``nbytes`` store bytes."""
    VERSIONS_PUBLISHED.labels(run, kind).inc()
    BYTES_UP.labels(run, kind).inc(max(0, nbytes))
    if since_step_s is not None and kind == "delta":
        DELTA_AVAILABLE_SECONDS.labels(run).observe(max(0.0, since_step_s))


def applied(run: str, kind: str, nbytes: int, pause_s: float, since_step_s: float | None) -> None:
    """A rollout node applied a version (a bootstrap applies an anchor)."""
    VERSIONS_APPLIED.labels(run, kind).inc()
    BYTES_DOWN.labels(run, kind).inc(max(0, nbytes))
    PAUSE_SECONDS.labels(run, kind).observe(max(0.0, pause_s))
    if since_step_s is not None:
        APPLIED_SECONDS.labels(run).observe(max(0.0, since_step_s))


def replica_at(run: str, node: str, head: int | None, held: int | None) -> None:
    """A rollout node's position after a sync."""
    if held is not None:
        REPLICA_VERSION.labels(run, node).set(held)
        if head is not None:
            REPLICA_LAG.labels(run, node).set(max(0, head - held))


def refused(run: str, role: str, reason: BaseException | str) -> None:
    """A step (role ``diff``) or a version (role ``rollout``) was refused; ``reason`` is
    the error (its type names the reason) or a word."""
    name = reason if isinstance(reason, str) else type(reason).__name__
    REFUSALS.labels(run, role, name).inc()


def scrub_mismatch(run: str, role: str) -> None:
    """A scrub found a held tensor that no longer matches its hash."""
    SCRUB_MISMATCHES.labels(run, role).inc()
