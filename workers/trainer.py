"""The trainer side: call after an optimizer step.

    from workers.trainer import Emitter
    emitter = Emitter(run="grpo-7")            # settings from DELTASYNC_* env
    ...
    optimizer.step()
    emitter.emit_state(step, model)            # writes bf16 weights to staging, emits

``emit_state`` writes the weights to the staging folder atomically, then in one
Redis transaction appends ``step-completed`` to the run's stream and enqueues
the diff job, so that neither happens without the other.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline import config
from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.events import StepCompleted, check_run_name
from pipeline.coord.stream import EventStream
from pipeline.errors import ChainError, ConfigError
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.checkpoint_names import FORM_METADATA_KEY, TensorForm, checkpoint_state
from pipeline.format.checkpoint_write import write_checkpoint
from pipeline.logs import get_logger
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
    items = weights.items()
    seen: set[int] = set()
    for name, tensor in items:
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
        self.runtime = Runtime(settings or Settings.from_env())

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
        return self.settings.staging_dir / self.run / f"step-{step:010d}"

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
        manifest records which (``tensor_form``, see ``pipeline.format.checkpoint_names``)."""
        self._check_newer(step)
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
        return self._send(step, path, owned=True)

    def emit_checkpoint(self, step: int, checkpoint: str | Path) -> Emitted:
        """Emit a checkpoint the user wrote; deltasync never modifies or removes it."""
        self._check_newer(step)
        path = Path(checkpoint).resolve()
        CheckpointReader(path)  # a missing or half-written checkpoint fails here, one line
        return self._send(step, path, owned=False)

    def _send(self, step: int, path: Path, *, owned: bool) -> Emitted:
        kwargs = {"run": self.run, "step": step, "checkpoint": str(path), "owned": owned}
        return send_step(self.runtime, kwargs)


def send_step(runtime: Runtime, kwargs: dict[str, Any]) -> Emitted:
    """Send one step: in one transaction the diff job (``kwargs`` are its arguments: run,
    step, checkpoint, owned and any others), ``step-completed``, the emitted marker and
    the pending-steps entry. Not sent again when the marker says it was (best effort:
    the diff job itself publishes each version once)."""
    run, step, checkpoint = kwargs["run"], kwargs["step"], str(kwargs["checkpoint"])
    r = runtime.redis
    stream = EventStream(r, run)
    event = StepCompleted.now(
        run=run, version=step, checkpoint=checkpoint, owned=bool(kwargs["owned"]), level=None
    )
    marker = keys.emitted_key(run, step)
    if r.exists(marker):
        log.warning("step already emitted, not sent again", run=run, step=step)
        return Emitted(run, step, checkpoint, None, queues.diff_job_id(run, step))
    with r.pipeline(transaction=True) as pipe:
        # rq opens the transaction itself, so the job goes first.
        job_id = queues.enqueue_diff(r, kwargs, pipeline=pipe)
        at = len(pipe.command_stack)
        stream.publish(event, pipeline=pipe)
        pipe.set(marker, 1, ex=config.EMITTED_TTL_S)
        # Lets whichever diff job runs first publish the steps in order.
        pipe.hset(keys.pending_steps_key(run), str(step), json.dumps(kwargs))
        results = pipe.execute()
    event_id = results[at]
    event_id = event_id.decode() if isinstance(event_id, bytes) else str(event_id)
    log.info("step emitted", run=run, step=step, checkpoint=checkpoint, job_id=job_id)
    return Emitted(run, step, checkpoint, event_id, job_id)
