"""Operator commands: compact, tail, status, verify, repair, retry, keygen, resign, redis,
warm."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.coord.events import EVENT_TYPES, DeltaPart
from pipeline.errors import ChainError, DeltasyncError

if TYPE_CHECKING:
    from pipeline.publish.repair import RunCheck
    from workers.runtime import Runtime

RUN = click.option("--run", required=True, help="Run name.")
# What the event stream carries (part hints travel apart: tail --hints).
STREAM_TYPES = sorted(t for t in EVENT_TYPES if t != DeltaPart.TYPE)
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
    help="With --wait: give up after this many seconds.",
)
@click.pass_context
def compact(
    ctx: click.Context, run: str, version: int | None, wait: bool, timeout_s: float
) -> None:
    """Ask a compaction worker to turn the chain up to VERSION into an anchor.

    \b
    Example:
      deltasync compact --run grpo-7 --wait
    """
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    from pipeline.errors import ServiceUnavailableError
    from pipeline.versions import binding as run_binding
    from pipeline.versions import chain
    from pipeline.versions.runs import require_run
    from workers import queues
    from workers.jobs.diff import request_compaction
    from workers.ops import listening_workers
    from workers.runtime import from_context

    runtime = from_context(ctx)
    require_run(runtime.store, runtime.redis, run)
    index = chain.list_versions(runtime.store, run)
    if index.head is None:
        raise ChainError(f"run {run!r} has no published version in {runtime.settings.store_url}")
    target = index.head if version is None else version
    chain.resolve(runtime.store, run, target)  # an unknown version fails here, not in the worker
    listening = listening_workers(runtime, queues.COMPACT_QUEUE)
    if wait and not listening:
        listening = _await_worker(runtime, queues.COMPACT_QUEUE, COMPACT_WORKER_GRACE_S)
    if wait and not listening:
        raise ServiceUnavailableError(
            f"no compaction worker listens on {queues.COMPACT_QUEUE} (start `deltasync worker "
            "compact`, then run this again); nothing was queued"
        )
    run_binding.restore(runtime.redis, run, runtime.store)  # Redis may have lost it
    job_id = request_compaction(runtime, run, target, "manual", requested_by="cli")
    click.echo(f"compaction of {run} version {target} queued as job {job_id}")
    if not listening:
        click.echo(
            f"no compaction worker listens on {queues.COMPACT_QUEUE}: the job waits for "
            "`deltasync worker compact`",
            err=True,
        )
    if not wait:
        return
    gone = DeltasyncError(
        f"compaction job {job_id} is no longer in redis (restarted without persistence, or "
        f"the job was deleted): `deltasync status --run {run}` shows whether anchor {target} "
        f"was published; `deltasync compact --run {run} --version {target}` queues it again"
    )
    try:
        job = Job.fetch(job_id, connection=runtime.redis, serializer=JSONSerializer)
    except NoSuchJobError:
        raise gone from None
    started = time.monotonic()
    workers_seen, next_check = started, started + WORKER_CHECK_S  # a worker listened then
    from rich.console import Console

    with Console(stderr=True).status("waiting for a compaction worker") as spinner:
        while True:
            try:
                status = job.get_status(refresh=True)
            except InvalidJobOperation:  # its record is gone: it cannot finish any more
                raise gone from None
            if status == JobStatus.FINISHED:
                break
            if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                raise DeltasyncError(f"compaction job {job_id} {status.value}: {_last_line(job)}")
            if time.monotonic() - started > timeout_s:
                raise DeltasyncError(
                    f"compaction job {job_id} still {status.value} after "
                    f"{timeout_s:.0f}s (is `deltasync worker compact` running?)"
                )
            now = time.monotonic()
            if now >= next_check:  # the workers stopped or died meanwhile: say so
                next_check = now + WORKER_CHECK_S
                if listening_workers(runtime, queues.COMPACT_QUEUE):
                    workers_seen = now
                elif now - workers_seen > COMPACT_WORKER_GRACE_S:
                    raise ServiceUnavailableError(
                        f"compaction job {job_id} still {status.value}, and no compaction "
                        f"worker has listened on {queues.COMPACT_QUEUE} for "
                        f"{COMPACT_WORKER_GRACE_S:.0f}s: start `deltasync worker compact`, "
                        "then run this again"
                    )
            spinner.update(
                f"compaction job {job_id}: {status.value} ({time.monotonic() - started:.0f}s)"
            )
            time.sleep(0.5)
    result = job.return_value()
    click.echo(json.dumps(result, indent=2) if isinstance(result, dict) else str(result))


# compact --wait gives a compaction worker that is just starting this long to listen,
# and while it waits for its job looks this often whether one still does.
COMPACT_WORKER_GRACE_S = 20.0
WORKER_CHECK_S = 5.0


def _await_worker(runtime: Runtime, queue_name: str, grace_s: float) -> list[str]:
    """The workers listening on ``queue_name`` once one does, or [] after ``grace_s``."""
    from rich.console import Console

    from workers.ops import listening_workers

    deadline = time.monotonic() + grace_s
    with Console(stderr=True).status(f"no worker listens on {queue_name} yet"):
        while time.monotonic() < deadline:
            time.sleep(0.5)
            listening = listening_workers(runtime, queue_name)
            if listening:
                return listening
    return []


def _last_line(job: object) -> str:
    info = getattr(job, "exc_info", None) or ""
    lines = [line for line in str(info).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error recorded"


@click.command("tail")
@RUN_TO_READ
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they arrive.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of readable lines.")
@click.option(
    "--type",
    "types",
    multiple=True,
    type=click.Choice(STREAM_TYPES),
    help="Only events of this type (repeatable).",
)
@click.option("--since", default="0-0", help="Stream id to start after.")
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
    the live part hints instead.

    \b
    Examples:
      deltasync tail --run grpo-7 --follow
      deltasync tail --run grpo-7 --type step-failed --json
    """
    from pipeline.versions.runs import require_run
    from workers.ops import only_run, tail_events, tail_hints
    from workers.runtime import from_context

    runtime = from_context(ctx)
    run = run or only_run(runtime)
    require_run(runtime.store, runtime.redis, run)
    if hints:
        tail_hints(runtime, run, as_json=as_json)
        return
    tail_events(runtime, run, follow=follow, as_json=as_json, types=set(types), since=since)


@click.command("status")
@RUN_TO_READ
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_context
def status(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """Head, anchors, chain, queues, workers (dead ones named), failed jobs, steps set
    aside, replicas and their lag, failing nodes.

    \b
    Examples:
      deltasync status --run grpo-7
      deltasync status --run grpo-7 --json
    """
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

    \b
    Example:
      deltasync verify --run grpo-7 --version 120 --against /ckpt/step-120
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


@click.command("retry")
@RUN
@click.option(
    "--step",
    type=click.IntRange(min=0),
    required=True,
    help="The set-aside step (`deltasync status` lists them with their reasons).",
)
@click.pass_context
def retry(ctx: click.Context, run: str, step: int) -> None:
    """Queue a step that was set aside again, with the checkpoint it was emitted with
    (fix the cause first: the file, the worker's settings). Emitting the step again
    with a new checkpoint works too.

    \b
    Example:
      deltasync retry --run grpo-7 --step 120
    """
    from workers.runtime import from_context
    from workers.trainers.trainer import retry_step

    emitted = retry_step(from_context(ctx), run, step)
    click.echo(
        f"step {step} of run {run} queued again (job {emitted.job_id}); "
        f"`deltasync status --run {run}` shows it publish"
    )


@click.command("repair")
@RUN
@click.option(
    "--from",
    "checkpoint",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="A checkpoint (safetensors file or sharded folder) of a version at or above the "
    "damage, checked against that version's manifest. Default: the diff worker's state "
    "cache on this machine (DELTASYNC_CACHE), when it proves such a version.",
)
@click.option("--check", "check_only", is_flag=True, help="Name the damage; change nothing.")
@click.pass_context
def repair(ctx: click.Context, run: str, checkpoint: Path | None, check_only: bool) -> None:
    """Check every object of a run (sizes, sha256, signatures), name the damage, and
    make the run reachable again: publish an anchor at or above the damaged version
    from a proven source, then remove the damaged versions. Nodes then bootstrap past
    them; a damaged version is never served.

    \b
    Examples:
      deltasync repair --run grpo-7 --check
      deltasync repair --run grpo-7
      deltasync repair --run grpo-7 --from /ckpt/step-120
    """
    from pipeline.publish.caches.state_cache import StateCache
    from pipeline.publish.repair import check_run, repair
    from pipeline.publish.version import PublishOptions
    from pipeline.versions.runs import require_run
    from workers.jobs.compaction import announce_anchor
    from workers.runtime import from_context

    runtime = from_context(ctx)
    settings = runtime.settings
    require_run(runtime.store, runtime.redis, run)
    if check_only:
        found = check_run(runtime.store, run)
        _show_check(found)
        if not found.healthy:
            raise SystemExit(1)
        return
    with _no_compaction(runtime, run):
        result = repair(
            runtime.store,
            run,
            checkpoint=checkpoint,
            cache=StateCache(settings.cache_dir, run),
            options=PublishOptions.from_settings(settings),
            on_anchor=lambda anchor: announce_anchor(runtime, anchor, "repair"),
        )
    _show_check(result.check)
    if result.anchor is not None:
        click.echo(f"published anchor {result.anchor.version} from {result.source}")
    if result.removed:
        click.echo(f"removed the damaged {', '.join(result.removed)}")
    if result.check.healthy:
        click.echo("nothing to repair")
    else:
        click.echo(f"run {run} is reachable again (head {result.check.index.head})")
        _after_repair(runtime, run)


def _after_repair(runtime: Runtime, run: str) -> None:
    """What the damage blocked goes on: steps set aside meanwhile (newer than the head;
    a damaged head fails every step built on it) are sent again, and the policy may ask
    for a compaction at once instead of after a failed one's backoff."""
    from pipeline.coord import keys
    from pipeline.coord.problems import clear_compaction_failure
    from pipeline.publish.dead_letters import list_dead
    from pipeline.versions import chain
    from workers.trainers.trainer import retry_step

    clear_compaction_failure(runtime.redis, run)
    runtime.redis.delete(keys.compaction_pending_key(run))
    head = chain.list_versions(runtime.store, run).head
    for dead in list_dead(runtime.redis, run):
        if head is not None and dead.step <= head:
            continue
        try:
            retry_step(runtime, run, dead.step)
        except DeltasyncError as exc:
            click.echo(f"step {dead.step} stays set aside: {exc}")
            continue
        click.echo(f"step {dead.step}, set aside meanwhile, sent again")


REPAIR_LOCK_WAIT_S = 120.0  # a compaction running meanwhile: wait this long for it


def _no_compaction(runtime: Any, run: str) -> Any:
    """The run's compaction lock: no compaction or garbage collection of it meanwhile."""
    from pipeline import config
    from pipeline.coord.replicas import run_lock

    return run_lock(
        runtime.redis,
        run,
        "compact",
        timeout_s=config.LOCK_LEASE_S,
        wait_s=REPAIR_LOCK_WAIT_S,
        renew_every_s=config.LOCK_RENEW_S,
    )


def _show_check(found: RunCheck) -> None:
    click.echo(found.describe())
    for damage in found.damage:
        click.echo(f"  damaged: {damage.describe()}")


@click.command("keygen")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for signing.key (workers) and verify.pub (rollout nodes).",
)
def keygen(out: Path) -> None:
    """Make an Ed25519 key pair for signed versions.

    \b
    Example:
      deltasync keygen --out keys/
    """
    from pipeline.format.signing import generate_keypair

    private, public = generate_keypair(out)
    click.echo(f"private key (DELTASYNC_SIGNING_KEY): {private}")
    click.echo(f"public key (DELTASYNC_VERIFY_KEY): {public}")


@click.command("resign")
@RUN
@click.pass_context
def resign(ctx: click.Context, run: str) -> None:
    """Re-sign a run stored by an earlier release with DELTASYNC_SIGNING_KEY: manifests
    signed inside the document (which nodes with the verify key now refuse) move to the
    signed envelope, and run.json is signed. A manifest whose old signature is not
    valid for the key is left as it is, and named.

    \b
    Example:
      DELTASYNC_SIGNING_KEY=keys/signing.key deltasync resign --run grpo-7
    """
    from pipeline.publish.resign import resign_run
    from workers.runtime import from_context

    runtime = from_context(ctx)
    key = runtime.settings.signing_key()
    if key is None:
        raise click.UsageError("resign needs the signing key: set DELTASYNC_SIGNING_KEY")
    with _no_compaction(runtime, run):
        result = resign_run(runtime.store, run, key)
    click.echo(result.describe())
    for refused in result.refused:
        click.echo(f"  left unsigned: {refused}")


@click.command("warm")
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Every codec level, content hash and float width (what the images hold), "
    "not only the configured level and hash on bf16.",
)
@click.pass_context
def warm(ctx: click.Context, everything: bool) -> None:
    """Compile the codec's kernels into the kernel cache now (5-30 s once per machine
    and kernel version), so that the first version is published and applied at full
    speed. Nodes and diff workers also do it as they start (DELTASYNC_WARM).

    \b
    Examples:
      deltasync warm
      deltasync warm --all
    """
    from pipeline import kernel_cache
    from workers import warm as warming
    from workers.runtime import from_context

    settings = from_context(ctx).settings
    if everything:
        took = warming.warm_all()
    else:
        took = warming.warm((settings.level,), content_hash=settings.content_hash)
    place = kernel_cache.folder()
    where = str(place) if place is not None else "numba's own cache"
    click.echo(f"kernels ready in {took:.1f} s ({where})")


@click.group("redis")
def redis_group() -> None:
    """The embedded Redis server of the data folder.

    \b
    Examples:
      deltasync redis url
      deltasync redis stop
    """


@redis_group.command("url")
@click.option("--redact", is_flag=True, help="Print the URL with its password as *** (for logs).")
@click.pass_context
def redis_url(ctx: click.Context, redact: bool) -> None:
    """Print the URL of the Redis in use, password included (usable as
    DELTASYNC_REDIS_URL); starts the embedded one if needed.

    \b
    Example:
      export DELTASYNC_REDIS_URL=$(deltasync redis url)
    """
    from workers.runtime import from_context

    runtime = from_context(ctx)
    click.echo(runtime.redis_url_redacted if redact else runtime.redis_url)


@redis_group.command("stop")
@click.pass_context
def redis_stop(ctx: click.Context) -> None:
    """Stop the embedded Redis server of the data folder, naming the clients still
    connected. Started again (by any command), it listens at the same URL with its
    data, so running workers and nodes reconnect by themselves.

    \b
    Example:
      deltasync redis stop
    """
    from workers.redis_launcher import stop_redis
    from workers.runtime import from_context

    done = stop_redis(from_context(ctx).settings.data_dir)
    if not done:
        click.echo("no embedded Redis running")
        return
    click.echo(f"stopped the embedded Redis at {done.url}")
    if done.clients:
        click.echo(
            f"{len(done.clients)} client(s) still connected, which reconnect once it runs "
            "again (any deltasync command starts it, at the same URL):"
        )
        for client in done.clients:
            click.echo(f"  {client}")
    else:
        click.echo("no other client was connected")


COMMANDS: list[click.Command] = [
    compact,
    resign,
    tail,
    status,
    verify,
    repair,
    retry,
    keygen,
    redis_group,
    warm,
]
