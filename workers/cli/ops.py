"""Operator commands: compact, tail, status, verify, keygen, redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from pipeline.errors import ChainError, DeltasyncError

RUN = click.option("--run", required=True, help="Run name.")
# For commands that only look: the run can be left out when Redis knows of one only.
RUN_TO_READ = click.option(
    "--run", default=None, help="Run name (default: the only run with events in Redis)."
)


@click.command("compact")
@RUN
@click.option("--version", type=int, default=None, help="Version to anchor (default: the head).")
@click.option("--wait", is_flag=True, help="Wait for the job, showing progress and the result.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="With --wait: give up after this many seconds.",
)
@click.pass_context
def compact(
    ctx: click.Context, run: str, version: int | None, wait: bool, timeout_s: float
) -> None:
    """Ask a compaction worker to turn the chain up to VERSION into an anchor."""
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    from pipeline.versions import chain
    from workers.jobs.diff import request_compaction
    from workers.runtime import from_context

    runtime = from_context(ctx)
    index = chain.list_versions(runtime.store, run)
    if index.head is None:
        raise ChainError(f"run {run!r} has no published version in {runtime.settings.store_url}")
    target = index.head if version is None else version
    chain.resolve(runtime.store, run, target)  # an unknown version fails here, not in the worker
    job_id = request_compaction(runtime, run, target, "manual", requested_by="cli")
    click.echo(f"compaction of {run} version {target} queued as job {job_id}")
    if not wait:
        return
    job = Job.fetch(job_id, connection=runtime.redis, serializer=JSONSerializer)
    started = time.monotonic()
    from rich.console import Console

    with Console(stderr=True).status("waiting for a compaction worker") as spinner:
        while True:
            status = job.get_status(refresh=True)
            if status == JobStatus.FINISHED:
                break
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                raise DeltasyncError(f"compaction job {job_id} {status.value}: {_last_line(job)}")
            if time.monotonic() - started > timeout_s:
                raise DeltasyncError(
                    f"compaction job {job_id} still {status.value} after "
                    f"{timeout_s:.0f}s (is `deltasync worker compact` running?)"
                )
            spinner.update(
                f"compaction job {job_id}: {status.value} ({time.monotonic() - started:.0f}s)"
            )
            time.sleep(0.5)
    result = job.return_value()
    click.echo(json.dumps(result, indent=2) if isinstance(result, dict) else str(result))


def _last_line(job: object) -> str:
    info = getattr(job, "exc_info", None) or ""
    lines = [line for line in str(info).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error recorded"


@click.command("tail")
@RUN_TO_READ
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they arrive.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of readable lines.")
@click.option("--type", "types", multiple=True, help="Only events of this type (repeatable).")
@click.option("--since", default="0-0", show_default=True, help="Stream id to start after.")
@click.option(
    "--hints",
    is_flag=True,
    help="Instead of the stream: print delta-part hints (each part as it is stored, before "
    "its manifest) live, until interrupted. Hints are not kept: only new ones show.",
)
@click.pass_context
def tail(
    ctx: click.Context,
    run: str | None,
    follow: bool,
    as_json: bool,
    types: tuple[str, ...],
    since: str,
    hints: bool,
) -> None:
    """Print a run's event stream, oldest first; --follow to keep going, --hints for
    the live part hints instead."""
    from workers.ops import only_run, tail_events, tail_hints
    from workers.runtime import from_context

    runtime = from_context(ctx)
    run = run or only_run(runtime)
    if hints:
        tail_hints(runtime, run, as_json=as_json)
        return
    tail_events(runtime, run, follow=follow, as_json=as_json, types=set(types), since=since)


@click.command("status")
@RUN_TO_READ
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_context
def status(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """Head, anchors, chain, queues, failed jobs, replicas and their lag."""
    from workers.ops import collect_status, only_run, render_status
    from workers.runtime import from_context

    runtime = from_context(ctx)
    report = collect_status(runtime, run or only_run(runtime))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        render_status(report)


@click.command("verify")
@RUN
@click.option("--version", type=int, default=None, help="Version to check (default: the head).")
@click.option(
    "--against",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="Checkpoint (safetensors file or sharded folder) to compare bit for bit.",
)
@click.pass_context
def verify(ctx: click.Context, run: str, version: int | None, against: Path) -> None:
    """Rebuild a version from the store and compare it bit for bit with a checkpoint.

    Also checks every object's size and sha256 on the way; names the damage.
    """
    from pipeline.versions import chain
    from pipeline.versions.verify import verify as verify_version
    from workers.runtime import from_context

    runtime = from_context(ctx)
    if version is None:
        head = chain.list_versions(runtime.store, run).head
        if head is None:
            raise ChainError(f"run {run!r} has no published version")
        version = head
    report = verify_version(runtime.store, run, version, against)
    click.echo(report.describe())
    if not report.ok:
        raise SystemExit(1)


@click.command("keygen")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for signing.key (workers) and verify.pub (rollout nodes).",
)
def keygen(out: Path) -> None:
    """Make an Ed25519 key pair for signed versions."""
    from pipeline.format.signing import generate_keypair

    private, public = generate_keypair(out)
    click.echo(f"private key (DELTASYNC_SIGNING_KEY): {private}")
    click.echo(f"public key (DELTASYNC_VERIFY_KEY): {public}")


@click.group("redis")
def redis_group() -> None:
    """The embedded Redis server of the data folder."""


@redis_group.command("url")
@click.pass_context
def redis_url(ctx: click.Context) -> None:
    """Print the URL of the Redis in use (starting the embedded one if needed)."""
    from workers.runtime import from_context

    click.echo(from_context(ctx).redis_url_redacted)


@redis_group.command("stop")
@click.pass_context
def redis_stop(ctx: click.Context) -> None:
    """Stop the embedded Redis server of the data folder."""
    from workers.redis_launcher import stop_redis
    from workers.runtime import from_context

    stopped = stop_redis(from_context(ctx).settings.data_dir)
    click.echo("stopped" if stopped else "no embedded Redis running")


COMMANDS: list[click.Command] = [compact, tail, status, verify, keygen, redis_group]
