"""What `deltasync tail` and `deltasync status` show."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import click
from rq import Queue, Worker
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker_registration import clean_worker_registry

from pipeline.coord import keys
from pipeline.coord.connection import redis_errors, text
from pipeline.coord.events import Event
from pipeline.coord.hints import PartListener
from pipeline.coord.problems import (
    compaction_failure,
    list_cache_damage,
    list_failing,
    list_refused_jobs,
)
from pipeline.coord.replicas import list_replicas
from pipeline.coord.stream import EventStream, list_runs
from pipeline.errors import ConfigError, DeltasyncError
from pipeline.publish.dead_letters import list_dead
from pipeline.publish.staged import lost_staged_steps
from pipeline.store.trust import store_key
from pipeline.versions import index as chain
from pipeline.versions.runs import require_run
from workers import queues
from workers.runtime import Runtime

_SKIP_FIELDS = {"type", "schema", "run", "version", "time"}
ANNOUNCED_SCAN = 200  # newest events searched for delta-available besides the key


def only_run(runtime: Runtime) -> str:
    """The run to show when --run is left out: the only one with events in Redis."""
    runs = list_runs(runtime.redis)
    if len(runs) == 1:
        return runs[0]
    if not runs:
        where = runtime.redis_url_redacted
        raise ConfigError(f"--run is needed: no run has events in redis at {where}")
    shown = ", ".join(runs[:20]) + (f" and {len(runs) - 20} more" if len(runs) > 20 else "")
    raise ConfigError(f"--run is needed: runs with events in redis: {shown}")


def format_event(event_id: str, event: Event) -> str:
    """One readable line: time, type, version, then the type's own fields."""
    fields = {k: v for k, v in asdict(event).items() if k not in _SKIP_FIELDS}
    details = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v is not None)
    return f"{event.time}  {event.type:<20} v{event.version:<8} {details}  [{event_id}]"


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def tail_events(
    runtime: Runtime,
    run: str,
    *,
    follow: bool,
    as_json: bool,
    types: set[str],
    since: str = "0-0",
    stop: threading.Event | None = None,
) -> int:
    """Print events after ``since``; with ``follow``, keep reading from the last id seen."""
    stream = EventStream(runtime.redis, run)
    printed = 0

    def show(event_id: str, event: Event | None) -> None:
        nonlocal printed
        if event is None or (types and event.type not in types):
            return
        _echo(event_id, event, {"id": event_id, **event.to_dict()} if as_json else None)
        printed += 1

    if follow:
        for event_id, event in stream.follow(
            since, block_ms=1000, stop=(stop.is_set if stop is not None else lambda: False)
        ):
            show(event_id, event)
    else:
        last = since
        while True:
            batch = stream.read(after_id=last, count=500)
            if not batch:
                break
            for event_id, maybe in batch:
                show(event_id, maybe)
                last = event_id
    return printed


def _echo(event_id: str, event: Event, document: dict[str, Any] | None) -> None:
    """One event as a line: its JSON ``document`` when given, else readable."""
    click.echo(
        format_event(event_id, event) if document is None else json.dumps(document, sort_keys=True)
    )
    sys.stdout.flush()


def tail_hints(
    runtime: Runtime, run: str, *, as_json: bool, stop: threading.Event | None = None
) -> None:
    """Print delta-part hints of ``run`` as they arrive, until ``stop`` or Ctrl-C."""
    stop = stop or threading.Event()

    client = runtime.redis
    with redis_errors(client, "subscribing to part hints"):
        client.ping()  # an unreachable Redis is a one-line error, not a silent wait
    listener = PartListener(
        client, run, lambda hint: _echo("hint", hint, hint.to_dict() if as_json else None)
    ).start()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()


def collect_status(runtime: Runtime, run: str) -> dict[str, Any]:
    """Everything `deltasync status` reports, as plain data. UnknownRunError for a run
    with no version and no event (a misspelled name), naming the runs there are."""
    store = runtime.store
    require_run(store, runtime.redis, run)
    index = chain.list_versions(store, run)
    report: dict[str, Any] = {
        "run": run,
        "store": store.url,
        "head": index.head,
        "anchors": sorted(index.anchors),
        "deltas": len(index.deltas),
    }
    if index.head is not None:
        try:
            plan = chain.resolve(store, run, index.head)
            report["chain"] = {
                "anchor": plan.anchor.version,
                "length": len(plan.deltas),
                "delta_bytes": sum(o.size for m in plan.deltas for o in m.objects),
                "anchor_bytes": sum(o.size for o in plan.anchor.objects),
            }
            # "signed" means verified: resolve checked every signature with the key.
            report["signed"] = store_key(store) is not None
            head_manifest = plan.deltas[-1] if plan.deltas else plan.anchor
            report["head_state_hash"] = head_manifest.state_hash
        except DeltasyncError as exc:
            report["chain"] = {"error": str(exc)}
            report["signed"] = False
    r = runtime.redis
    # Versions Redis announced that the store does not show: hidden or deleted behind
    # the run's back (a freeze or a rollback), which lag alone would not tell.
    announced = EventStream(r, run).announced_head(scan=ANNOUNCED_SCAN)
    report["announced_head"] = announced
    report["store_behind"] = (
        f"store behind announcements: v{announced} announced, head "
        f"{'none' if index.head is None else f'v{index.head}'}"
        if announced is not None and (index.head is None or announced > index.head)
        else None
    )
    report["queues"] = {}
    for name in (queues.DIFF_QUEUE, queues.COMPACT_QUEUE):
        q = queues.queue(r, name)
        failed = FailedJobRegistry(queue=q, serializer=JSONSerializer)
        failed_ids = failed.get_job_ids()
        report["queues"][name] = {
            "queued": q.count,
            "running": StartedJobRegistry(queue=q, serializer=JSONSerializer).get_job_ids(),
            "failed": len(failed_ids),
            "failed_jobs": failed_ids[-5:],
            "workers": queue_workers(q, runtime.settings.worker_lease_s),
        }
    # Emitted steps no version holds yet: each waits for a diff job (its own or a later one).
    report["pending_steps"] = sorted(
        int(k) for k in r.hkeys(keys.pending_steps_key(run)) if text(k).isdigit()
    )
    # Staged here, newer than the head, unknown to Redis: lost with its data.
    report["lost_steps"] = lost_staged_steps(r, store, runtime.settings.staging_dir, run)
    now = datetime.now(UTC)
    replicas = []
    for info in list_replicas(r, run):
        lag = None if index.head is None or info.version is None else index.head - info.version
        replicas.append(
            {
                "node": info.node,
                "version": info.version,
                "lag_versions": lag,
                "state_hash": info.state_hash or None,
                "seen_s_ago": round(info.age_s, 1),
                # Silent past its lease: shown (and never counted as serving) until its
                # record expires (DELTASYNC_REPLICA_TTL after the last heartbeat).
                "state": "dead" if info.dead else "live",
                "last_seen": info.time.isoformat(timespec="seconds"),
                "lease_s": info.lease_s,
            }
        )
    report["replicas"] = replicas
    # The last policy compaction failed (and is tried again at retry_at): why, in one line.
    failure = compaction_failure(r, run)
    report["compaction_failing"] = None if failure is None else asdict(failure)
    report["dead_steps"] = [
        {"step": d.step, "reason": d.reason, "checkpoint": d.checkpoint, "time": d.time}
        for d in list_dead(r, run)
    ]
    # Nodes whose last sync failed: listed whether or not they hold a version.
    report["failing"] = [
        {
            "node": f.node,
            "held": f.held,
            "error": f.error,
            "since": f.since.isoformat(),
            "failing_for_s": round(f.failing_for_s, 1),
            "last_failure_s_ago": round(f.last_s_ago, 1),
            "failures": f.failures,
        }
        for f in list_failing(r, run)
    ]
    # State-cache tensors the diff workers' scrubs found damaged (each rebuilt since).
    report["cache_damage"] = [asdict(d) for d in list_cache_damage(r, run)]
    # Jobs the workers refused to run (not deltasync's): every run's operator sees them.
    refused, recent = list_refused_jobs(r)
    report["refused_jobs"] = {"count": refused, "recent": [asdict(job) for job in recent]}
    report["time"] = now.isoformat()
    return report


def queue_workers(q: Queue, default_lease_s: float) -> list[dict[str, Any]]:
    """The rq workers of queue ``q``: what each does and when it last said it was alive.
    One silent past its lease (the one it registered, else ``default_lease_s``) is
    ``dead``, whatever its last state said; rq forgets it a minute later, and it leaves
    the queue's registry then."""
    clean_worker_registry(q)  # names whose worker record expired
    now = datetime.now(UTC)
    out = []
    for worker in Worker.all(queue=q):
        beat = worker.last_heartbeat
        state = worker.get_state()  # a WorkerStatus, or its text once read from Redis
        lease = _lease_of(q.connection, worker.key, default_lease_s)
        age = None if beat is None else (now - beat).total_seconds()
        dead = age is None or age > lease
        out.append(
            {
                "name": worker.name,
                "state": "dead" if dead else str(getattr(state, "value", state)),
                "job": None if dead else worker.get_current_job_id(),
                "heartbeat_s_ago": None if age is None else round(age, 1),
                "last_heartbeat": None if beat is None else beat.isoformat(timespec="seconds"),
                "lease_s": lease,
            }
        )
    return sorted(out, key=lambda w: w["name"])


def _lease_of(connection: Any, key: str, default: float) -> float:
    raw = connection.hget(key, queues.LEASE_FIELD)
    try:
        lease = float(text(raw)) if raw else default
    except ValueError:
        return default
    return lease if lease > 0 else default


def listening_workers(runtime: Runtime, queue_name: str) -> list[str]:
    """Names of the live (not dead) workers listening on ``queue_name``."""
    q = queues.queue(runtime.redis, queue_name)
    return [
        w["name"] for w in queue_workers(q, runtime.settings.worker_lease_s) if w["state"] != "dead"
    ]


def render_status(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()

    def say(line: str) -> None:
        console.print(line, soft_wrap=True)

    console.print(f"[bold]run[/] {report['run']}   [bold]store[/] {report['store']}")
    if report["head"] is None:
        console.print("no published version yet")
    else:
        signed = "signed" if report.get("signed") else "signatures not verified"
        console.print(
            f"[bold]head[/] {report['head']} ({signed})   "
            f"[bold]anchors[/] {report['anchors']}   "
            f"[bold]deltas stored[/] {report['deltas']}"
        )
        c = report.get("chain", {})
        if "error" in c:
            console.print(f"[red]chain broken:[/] {c['error']}")
        else:
            console.print(
                f"[bold]chain[/] anchor {c['anchor']} + {c['length']} deltas, "
                f"{c['delta_bytes']:,} delta bytes vs {c['anchor_bytes']:,} anchor bytes"
            )
    if report.get("store_behind"):
        say(
            f"[red]{report['store_behind']}[/] (versions hidden or deleted from the store; "
            "nodes cannot reach them)"
        )
    queues_table = Table(
        "queue", "queued", "running", "failed", "recent failed jobs", title="queues"
    )
    for name, q in report["queues"].items():
        running = ", ".join(q["running"]) or "-"
        failed = ", ".join(q["failed_jobs"])
        queues_table.add_row(name, str(q["queued"]), running, str(q["failed"]), failed)
    console.print(queues_table)
    for name, q in report["queues"].items():
        for w in q["workers"]:
            worker, ago = f"worker {escape(w['name'])} on {name}", f"{w['heartbeat_s_ago']}s ago"
            job = f" {w['job']}" if w["job"] else ""
            say(
                f"[red]{worker}: dead[/] (no heartbeat since {w['last_heartbeat']}, {ago}; "
                f"lease {w['lease_s']:g}s)"
                if w["state"] == "dead"
                else f"{worker}: {w['state']}{escape(job)}, heartbeat {ago}"
            )
        if not any(w["state"] != "dead" for w in q["workers"]):
            console.print(f"[yellow]no live worker on {name}[/]")
    if report.get("pending_steps"):
        say(f"steps waiting to publish {report['pending_steps']}")
    for step in report.get("lost_steps", []):
        say(
            f"[yellow]step {step} is staged but Redis does not know it[/] (Redis lost its "
            f"data?): `deltasync retry --run {escape(report['run'])} --step {step}` sends it "
            "again, or the trainer's next step does"
        )
    replicas_table = Table(
        *("node", "version", "lag (versions)", "last seen", "state"), title="replicas"
    )
    for rep in report["replicas"]:
        dead = rep.get("state") == "dead"
        replicas_table.add_row(
            rep["node"],
            str(rep["version"]),
            str(rep["lag_versions"]),
            f"{rep['seen_s_ago']}s ago",
            f"[red]dead[/] since {rep['last_seen']}" if dead else "live",
        )
    if not report["replicas"]:
        replicas_table.add_row("-", "-", "-", "no replica reported recently", "-")
    console.print(replicas_table)
    for dead in report.get("dead_steps", []):
        say(
            f"[red]step {dead['step']} set aside:[/] {escape(dead['reason'])} (once its cause "
            f"is fixed: `deltasync retry --run {escape(report['run'])} --step {dead['step']}`)"
        )
    failing = report.get("compaction_failing")
    if failing:
        say(
            f"[red]policy compaction failed[/] ({failing['failures']} in a row since "
            f"{failing['since']}; next try {failing['retry_at']}): {escape(failing['reason'])}"
        )
    render_failing(console, report.get("failing", []))
    for d in report.get("cache_damage", []):
        console.print(
            f"[red]state cache of {escape(d['host'])}:[/] tensor {escape(d['tensor'])!r} of "
            f"v{d['version']} failed its scrub ({escape(d['note'])}; {d['count']} so far, "
            f"last {d['time']}); the next step rebuilds it from the store"
        )
    refused = report.get("refused_jobs") or {}
    if refused.get("count"):
        say(
            f"[red]{refused['count']} job(s) refused[/] (not deltasync's jobs; nothing of "
            "them ran): someone with Redis write access queued them"
        )
    for job in refused.get("recent", []):
        say(
            f"  [red]refused[/] {escape(job['job_id'])} on {escape(job['queue'])} "
            f"{job['time']}: {escape(job['reason'])}"
        )


def render_failing(console: Any, failing: list[dict[str, Any]]) -> None:
    """Nodes whose last sync failed, with the error and since when."""
    if not failing:
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        "node", "holds", "failing since", "failures", "last error", title="[red]failing replicas[/]"
    )
    for f in failing:
        held = "nothing" if f["held"] is None else f"v{f['held']}"
        since = f"{f['since']} ({f['failing_for_s']}s)"
        table.add_row(f["node"], held, since, str(f["failures"]), escape(f["error"]))
    console.print(table)
