"""Every Redis key, channel and queue name deltasync uses, declared once.

A template names its fields in braces; the functions below build each key from
checked parts, so a run or node name cannot reach into another run's keys. The
strings are part of the deployed format: Redis servers of running runs hold
these keys, so a template never changes, only new ones are added.
``TEMPLATES`` lists them all (``docs/ARCHITECTURE.md``, "Redis keyspace").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.coord.events import RUN_NAME_PATTERN, check_run_name
from pipeline.errors import ConfigError

PREFIX = "deltasync"
NODE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}")

Kind = Literal["string", "hash", "set", "zset", "stream", "channel", "queue"]

# What each field of a template may hold, for matching keys found in a server.
_FIELDS = {
    "run": RUN_NAME_PATTERN.pattern,
    "node": NODE_PATTERN.pattern,
    "name": NODE_PATTERN.pattern,
    "host": NODE_PATTERN.pattern,
    "step": r"\d+",
    "version": r"\d+",
    "parent": r"\d+",
}
_FIELD = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Template:
    """One key (or channel) shape: ``pattern`` with ``{field}`` holes."""

    pattern: str
    kind: Kind
    doc: str

    def format(self, **fields: object) -> str:
        return self.pattern.format(**fields)

    def build(self, *values: str | int) -> str:
        """The key of ``values``, one per field in the pattern's order, each checked
        first (ConfigError), so that no name reaches into another run's keys."""
        names = _FIELD.findall(self.pattern)
        checked = {n: _CHECKS[n](v) for n, v in zip(names, values, strict=True)}
        return self.pattern.format(**checked)

    def regex(self) -> re.Pattern[str]:
        parts = _FIELD.split(self.pattern)
        out = []
        for i, part in enumerate(parts):
            out.append(f"(?:{_FIELDS[part]})" if i % 2 else re.escape(part))
        return re.compile("".join(out))


RUN = f"{PREFIX}:run:{{run}}"

RUNS = Template(f"{PREFIX}:runs", "set", "Names of the runs that have an event stream.")
EVENTS = Template(f"{RUN}:events", "stream", "The run's events (one JSON object per entry).")
EVENTS_ADDED = Template(
    f"{RUN}:events:added", "string", "Entries ever added to the stream (tells trimming apart)."
)
REPLICA = Template(
    f"{RUN}:replica:{{node}}", "hash", "A node's heartbeat: the version it holds; expires."
)
REPLICAS = Template(f"{RUN}:replicas", "set", "Nodes that sent a heartbeat (pruned on read).")
FAILING = Template(
    f"{RUN}:failing:{{node}}", "hash", "A node's failing syncs: last error, since when; expires."
)
FAILING_INDEX = Template(f"{RUN}:failing", "set", "Nodes with a failing record.")
LOCK = Template(
    f"{RUN}:lock:{{name}}", "string", "A run lock (diff, compact, part claims): holder token."
)
STORE_BINDING = Template(f"{RUN}:store", "string", "The store instance the run is bound to.")
PART_HINTS = Template(f"{RUN}:parts", "channel", "Pub/sub: each delta part once uploaded.")
DEAD_STEPS = Template(f"{RUN}:dead-steps", "hash", "Steps set aside: step -> why, checkpoint.")
FANOUT = Template(f"{RUN}:fanout", "string", "The sharded step being diffed part by part (JSON).")
PART_RECORDS = Template(
    f"{RUN}:parts:{{step}}:{{parent}}", "hash", "Encoded parts of a fan-out: part -> record."
)
PENDING_STEPS = Template(
    f"{RUN}:pending-steps", "hash", "Emitted steps not yet published: step -> job arguments."
)
EMITTED = Template(f"{RUN}:emitted:{{step}}", "string", "Marker: the trainer emitted this step.")
ANNOUNCED = Template(
    f"{RUN}:announced:{{version}}", "string", "Marker: delta-available was sent for it."
)
ANNOUNCED_HEAD = Template(
    f"{RUN}:announced-head", "string", "The newest version delta-available was sent for."
)
ANCHORED = Template(
    f"{RUN}:anchored:{{version}}", "string", "Marker: anchor-available was sent for it."
)
COMPACTION_PENDING = Template(
    f"{RUN}:compaction-pending", "string", "A policy compaction is queued or running."
)
COMPACTION_FAILED = Template(
    f"{RUN}:compaction-failed",
    "string",
    "The last failed policy compaction: reason, failures in a row, next try (JSON).",
)
DIFF_WAITING = Template(
    f"{RUN}:diff-waiting", "zset", "Diff jobs waiting for the diff lock, by step."
)
DIFF_WAITING_LEASE = Template(
    f"{RUN}:diff-waiting:{{step}}", "string", "A waiting job's lease (lapses if it died)."
)
PART_HOSTS = Template(
    f"{RUN}:part-hosts:{{step}}", "hash", "Parts of a step routed to trainer hosts: part -> host."
)
SHARDS = Template(
    f"{RUN}:shards:{{step}}",
    "hash",
    "Ranks of a sharded step staged so far: rank -> host, folder, layout, launch.",
)
CACHE_DAMAGE = Template(
    f"{RUN}:cache-damage", "hash", "State-cache tensors a diff worker's scrub found damaged."
)
DIFF_QUEUE = Template(f"{PREFIX}:diff", "queue", "rq queue of diff jobs.")
DIFF_HOST_QUEUE = Template(
    f"{PREFIX}:diff:host:{{host}}", "queue", "rq queue of the part jobs routed to a trainer host."
)
COMPACT_QUEUE = Template(f"{PREFIX}:compact", "queue", "rq queue of compaction jobs.")
REFUSED_JOBS = Template(
    f"{PREFIX}:refused-jobs", "stream", "Jobs the workers refused to run (capped): why, what."
)

TEMPLATES: tuple[Template, ...] = tuple(
    v for v in dict(globals()).values() if isinstance(v, Template)
)


def check_node_name(node: str) -> str:
    if not isinstance(node, str) or not NODE_PATTERN.fullmatch(node):
        raise ConfigError(f"invalid node name {node!r}: use [A-Za-z0-9][A-Za-z0-9._:@-]{{0,255}}")
    return node


def template_of(key: str) -> Template | None:
    """The template ``key`` was built from; None for a key deltasync does not write."""
    for template in TEMPLATES:
        if template.kind not in ("channel", "queue") and template.regex().fullmatch(key):
            return template
    return None


# --------------------------------------------------------------------------- builders


def _int(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"a key's number must be an integer, got {value!r}")
    return value


def _lock_name(name: str) -> str:
    if not isinstance(name, str) or not NODE_PATTERN.fullmatch(name):
        raise ConfigError(f"invalid lock name {name!r}")
    return name


# How each field's value is checked before it goes into a key.
_CHECKS: dict[str, Callable[[Any], object]] = {
    "run": check_run_name,
    "node": check_node_name,
    "host": check_node_name,
    "name": _lock_name,
    "step": _int,
    "version": _int,
    "parent": _int,
}

# Each builder takes its template's fields in order: run, then node, name, step, ...
runs_key = RUNS.build
stream_key = EVENTS.build
stream_added_key = EVENTS_ADDED.build
replica_key = REPLICA.build
replicas_key = REPLICAS.build
failing_key = FAILING.build
failing_index_key = FAILING_INDEX.build
lock_key = LOCK.build
binding_key = STORE_BINDING.build
part_hints_channel = PART_HINTS.build
dead_steps_key = DEAD_STEPS.build
fanout_key = FANOUT.build
part_records_key = PART_RECORDS.build
pending_steps_key = PENDING_STEPS.build
emitted_key = EMITTED.build
announced_key = ANNOUNCED.build
announced_head_key = ANNOUNCED_HEAD.build
anchored_key = ANCHORED.build
compaction_pending_key = COMPACTION_PENDING.build
compaction_failed_key = COMPACTION_FAILED.build
diff_waiting_key = DIFF_WAITING.build
diff_waiting_lease_key = DIFF_WAITING_LEASE.build
part_hosts_key = PART_HOSTS.build
shards_key = SHARDS.build
cache_damage_key = CACHE_DAMAGE.build
refused_jobs_key = REFUSED_JOBS.build
diff_host_queue = DIFF_HOST_QUEUE.build

DIFF_QUEUE_NAME = DIFF_QUEUE.format()
COMPACT_QUEUE_NAME = COMPACT_QUEUE.format()
