"""The trainer side: call after an optimizer step.

    from workers.trainers.trainer import Emitter
    emitter = Emitter(run="grpo-7")            # settings from DELTASYNC_* env
    ...
    optimizer.step()
    emitter.emit_state(step, model)            # writes bf16 weights to staging, emits

``emit_state`` writes the weights to the staging folder atomically, then in one
Redis transaction appends ``step-completed`` to the run's stream and enqueues
the diff job, so that neither happens without the other.

Redis is given ``DELTASYNC_REDIS_TIMEOUT`` seconds (two attempts): when it cannot be
reached, the call fails with one line (``StepNotSentError`` when nothing reached it:
the staged copy is removed and the step can be emitted again). A step that was set
aside (``deltasync status``) is sent again when emitted again, with its new checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch

from pipeline import config
from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.connection import service_error
from pipeline.coord.events import StepCompleted, check_run_name
from pipeline.coord.stream import EventStream
from pipeline.errors import (
    ChainError,
    ConfigError,
    ServiceUnavailableError,
    StepNotSentError,
)
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_names import (
    FORM_METADATA_KEY,
    TensorForm,
    checkpoint_state,
)
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.logs import get_logger
from pipeline.publish.dead_letters import list_dead
from pipeline.publish.staged import lost_staged_steps, staged_path
from pipeline.versions import binding as run_binding
from pipeline.versions import chain
from workers import queues
from workers.runtime import Runtime

log = get_logger(__name__)


@dataclass(frozen=True)
class Emitted:
    run: str
    step: int
    checkpoint: str
    event_id: str | None  # None when the step was a duplicate and nothing was sent
    job_id: str


def named_specs(
    weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What :func:`named_tensors` will yield (name, dtype, shape), known before any
    copy: the staging file's header is written first and the data once."""
    return [
        (name, dtype if dtype is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
        for name, t in weights.items()
    ]


def named_tensors(
    weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in weights.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.cpu().contiguous()
        # Tied weights share storage; safetensors wants each name as its own copy.
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        yield name, t


class RunEmitter:
    """What every emitter of a run has: its settings (``DELTASYNC_*`` env by default),
    services, and the check that a step is newer than the run's head."""

    def __init__(self, run: str, *, settings: Settings | None = None) -> None:
        self.run = check_run_name(run)
        # A training loop must not hang on Redis: short timeouts, one retry.
        self.runtime = Runtime(settings or Settings.from_env(), fail_fast=True)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    def head(self) -> int | None:
        """The run's newest published version (None: nothing published yet)."""
        return chain.list_versions(self.runtime.store, self.run).head

    def _check_newer(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an integer >= 0, got {step!r}")
        head = self.head()
        if head is not None and step <= head:
            raise ChainError(f"step {step} of run {self.run!r} is not newer than head {head}")


class Emitter(RunEmitter):
    """Publishes a run's steps: one per optimizer step (or every k steps)."""

    def staging_path(self, step: int) -> Path:
        return staged_path(self.settings.staging_dir, self.run, step)

    def emit_state(
        self,
        step: int,
        weights: Mapping[str, torch.Tensor] | torch.nn.Module,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        max_shard_bytes: int | None = None,
    ) -> Emitted:
        """Write ``weights`` (cast to ``dtype``) to staging, then emit the step.

        A transformers model is published in its checkpoint format, the names and
        layout ``save_pretrained`` writes (experts one tensor each, even where the
        model keeps them fused in memory); a mapping is published as given. The
        manifest records which (``tensor_form``, see
        ``pipeline.format.checkpoints.checkpoint_names``)."""
        self._check_newer(step)
        reachable(self.runtime, f"emitting step {step} of run {self.run}")  # before staging
        form: TensorForm = "given"
        if isinstance(weights, torch.nn.Module):
            weights, form = checkpoint_state(weights)
        path = self.staging_path(step)
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checkpoint(
            path,
            named_tensors(weights, dtype),
            max_shard_bytes=max_shard_bytes,
            metadata={FORM_METADATA_KEY: form},
            specs=None if max_shard_bytes is not None else named_specs(weights, dtype),
        )
        try:
            return self._send(step, path, owned=True)
        except StepNotSentError:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            raise

    def emit_checkpoint(self, step: int, checkpoint: str | Path) -> Emitted:
        """Emit a checkpoint the user wrote; deltasync never modifies or removes it."""
        self._check_newer(step)
        path = Path(checkpoint).resolve()
        CheckpointReader(path)  # a missing or half-written checkpoint fails here, one line
        return self._send(step, path, owned=False)

    def _send(self, step: int, path: Path, *, owned: bool) -> Emitted:
        self.resend_lost(step)
        return send_step(self.runtime, queues.DiffArgs(self.run, step, str(path), owned))

    def resend_lost(self, before: int) -> list[int]:
        """Send again, oldest first, the steps below ``before`` that are staged here but
        that Redis no longer knows (it lost its data: restarted without persistence,
        flushed), so that they publish before the next step instead of vanishing.
        Returns them."""
        runtime = self.runtime
        staging = self.settings.staging_dir
        lost = lost_staged_steps(runtime.redis, runtime.store, staging, self.run, below=before)
        for step in lost:
            path = self.staging_path(step)
            log.warning("step found again in staging, sent again", run=self.run, step=step)
            send_step(self.runtime, queues.DiffArgs(self.run, step, str(path), owned=True))
        return lost


def reachable(runtime: Runtime, doing: str) -> None:
    """StepNotSentError (one line) unless Redis answers a PING."""
    try:
        runtime.redis.ping()
    except redis.RedisError as exc:
        error = service_error(exc, runtime.redis_url_redacted, doing)
        raise StepNotSentError(f"{error}; nothing was sent, emit it again") from None


def send_step(runtime: Runtime, args: queues.DiffArgs) -> Emitted:
    """Send one step: in one transaction the diff job (``args``), ``step-completed``,
    the emitted marker and the pending-steps entry. Not sent again when the marker says
    it was (best effort: the diff job itself publishes each version once), unless the
    step was set aside: then it is sent again, and leaves the dead letters.

    A Redis failure is one line: StepNotSentError when nothing was sent, else
    ServiceUnavailableError (the transaction may have gone through: emitting the step
    again is safe, it is sent at most once)."""
    run, step, checkpoint = args.run, args.step, args.checkpoint
    doing = f"emitting step {step} of run {run}"
    r = runtime.redis
    # Redis may have lost the run's store binding: restored from this store first, so
    # that a worker on another store refuses the step rather than taking the run over.
    try:
        run_binding.restore(r, run, runtime.store)
    except ServiceUnavailableError as exc:
        raise StepNotSentError(f"{exc}; nothing was sent, emit it again") from None
    try:
        marker = keys.emitted_key(run, step)
        set_aside = bool(r.hexists(keys.dead_steps_key(run), str(step)))
        if r.exists(marker) and not set_aside:
            log.warning("step already emitted, not sent again", run=run, step=step)
            return Emitted(run, step, checkpoint, None, queues.diff_job_id(run, step))
        if set_aside:
            queues.forget_failed_diff(r, run, step)
    except redis.RedisError as exc:
        error = service_error(exc, runtime.redis_url_redacted, doing)
        raise StepNotSentError(f"{error}; nothing was sent, emit it again") from None
    try:
        results, at = _send_transaction(r, args, marker)
    except redis.RedisError as exc:
        error = service_error(exc, runtime.redis_url_redacted, doing)
        raise ServiceUnavailableError(
            f"{error}; the step may have been sent: emit it again (sent at most once)"
        ) from None
    job_id = queues.diff_job_id(run, step)
    event_id = results[at]
    event_id = event_id.decode() if isinstance(event_id, bytes) else str(event_id)
    log.info("step emitted", run=run, step=step, checkpoint=checkpoint, job_id=job_id)
    return Emitted(run, step, checkpoint, event_id, job_id)


def _send_transaction(r: redis.Redis, args: queues.DiffArgs, marker: str) -> tuple[list[Any], int]:
    """The step's job, event, marker and pending entry in one MULTI/EXEC; (replies, index
    of the event id among them)."""
    run, step = args.run, args.step
    event = StepCompleted.now(
        run=run, version=step, checkpoint=args.checkpoint, owned=args.owned, level=None
    )
    with r.pipeline(transaction=True) as pipe:
        # rq opens the transaction itself, so the job goes first.
        queues.enqueue_diff(r, args, pipeline=pipe)
        at = len(pipe.command_stack)
        EventStream(r, run).publish(event, pipeline=pipe)
        pipe.set(marker, 1, ex=config.EMITTED_TTL_S)
        # Lets whichever diff job runs first publish the steps in order.
        pipe.hset(keys.pending_steps_key(run), str(step), json.dumps(args.wire()))
        pipe.hdel(keys.dead_steps_key(run), str(step))  # sent again after it was set aside
        return list(pipe.execute()), at


def retry_step(runtime: Runtime, run: str, step: int) -> Emitted:
    """Send a step that was set aside again, with the arguments it was set aside with
    (its cause fixed meanwhile), or a staged step Redis lost (``lost_staged_steps``).
    ConfigError when it is neither or its checkpoint is gone; ChainError when the run
    has moved past it."""
    check_run_name(run)
    dead = {d.step: d for d in list_dead(runtime.redis, run)}
    found = dead.get(step)
    staging = runtime.settings.staging_dir
    if found is None and step in lost_staged_steps(runtime.redis, runtime.store, staging, run):
        # Staged, then lost with Redis's data (`deltasync status` lists it).
        staged = staged_path(staging, run, step)
        return send_step(runtime, queues.DiffArgs(run, step, str(staged), owned=True))
    if found is None:
        listed = ", ".join(str(s) for s in sorted(dead)) or "none"
        raise ConfigError(f"step {step} of run {run} is not set aside (set aside: {listed})")
    head = chain.list_versions(runtime.store, run).head
    if head is not None and step <= head:
        raise ChainError(
            f"step {step} of run {run} can no longer publish: the head is {head} "
            "(versions only move forward); emit a newer step"
        )
    recorded = found.args or {"checkpoint": found.checkpoint}
    if not isinstance(recorded.get("checkpoint"), str):
        raise ConfigError(f"step {step} of run {run} was set aside without a checkpoint path")
    args = queues.DiffArgs.parse(run, step, recorded)
    if not args.sharded and not Path(args.checkpoint).exists():
        raise ConfigError(
            f"step {step} of run {run}: its checkpoint {args.checkpoint[:200]} is gone; "
            "emit the step again with a checkpoint"
        )
    return send_step(runtime, args)
