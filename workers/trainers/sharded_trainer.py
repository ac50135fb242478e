"""The trainer side of a sharded run: every rank emits only what it holds.

    from workers.trainers.sharded_trainer import ShardedEmitter
    emitter = ShardedEmitter(run="grpo-7")     # rank, world: torch.distributed or env
    ...
    optimizer.step()
    emitter.emit_shards(step, model)           # on every rank, no collective

Each rank stages its pieces in ``<staging>/<run>/step-<N>/rank-<R>/`` (a checkpoint of
1-D tensors plus ``pieces.json``, see ``pipeline.format.checkpoints.shards``) and registers the
folder in Redis (``pipeline.coord.shards``); the rank whose registration completes the
step sends it, exactly as ``Emitter`` sends a step, with the diff job's ``sharded``
argument set. Nothing is gathered: no collective is called at all.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from pipeline.config import Settings
from pipeline.coord import keys
from pipeline.coord.shards import RankFolder, register_rank
from pipeline.errors import ConfigError, MismatchError
from pipeline.format.checkpoints.checkpoint_names import (
    FORM_METADATA_KEY,
    TensorForm,
    checkpoint_renaming,
    is_transformers_model,
)
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.checkpoints.shards import (
    MAX_WORLD,
    RankLayout,
    RankPiece,
    layout_digest,
    write_layout,
)
from pipeline.format.regions import Region
from pipeline.format.tensors import BY_TORCH
from pipeline.logs import get_logger
from pipeline.testing import faults
from workers.queues import DiffArgs
from workers.trainers.trainer import Emitted, RunEmitter, named_specs, named_tensors, send_step

log = get_logger(__name__)

CHECKPOINT_NAME = "model.safetensors"
_STEP_FOLDER = re.compile(r"step-([0-9]{10})")


@dataclass(frozen=True)
class ShardPiece:
    """What this rank holds of a tensor of ``full_shape`` as a plain tensor: rows
    ``[start_row, start_row + tensor.shape[0])`` (a dim-0 slice), or with ``offset``
    the box of ``tensor.shape`` at ``offset`` (one index per dimension: a tensor-parallel
    slice of any dimension, as a DTensor's local chunk)."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    start_row: int = 0
    offset: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RankEmitted:
    """What one rank did for a step: staged ``folder``; ``sent`` when it completed it."""

    run: str
    step: int
    rank: int
    folder: str
    layout: str  # layout_digest of what it staged
    sent: Emitted | None  # set on the one rank whose registration completed the step

    @property
    def completed(self) -> bool:
        return self.sent is not None


Held = torch.Tensor | ShardPiece
Weights = Mapping[str, Held] | torch.nn.Module


@dataclass(frozen=True)
class _Local:
    name: str
    flat: torch.Tensor  # 1-D view (or copy) of what this rank holds, not cast yet
    shape: tuple[int, ...]
    region: Region | None  # where it lies in the full tensor; None: it is empty


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw[:40]!r} is not an integer") from None


def _default_rank_world() -> tuple[int | None, int | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return _int_env("RANK"), _int_env("WORLD_SIZE")


def _default_launch(settings: Settings) -> str:
    """The launch token of this start: the setting, else one drawn by rank 0 and
    broadcast (the one collective, at construction), else none."""
    if settings.launch is not None:
        return settings.launch
    if dist.is_available() and dist.is_initialized():
        token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(token, src=0)
        return str(token[0])
    log.warning(
        "no launch token (DELTASYNC_LAUNCH, or torch.distributed): a step emitted again "
        "after a restart may complete with an earlier start's folders"
    )
    return ""


def _tensors_of(weights: Weights) -> tuple[Mapping[str, Held], TensorForm]:
    if not isinstance(weights, torch.nn.Module):
        return weights, "given"
    state = weights.state_dict()
    if not is_transformers_model(weights):
        return state, "state_dict"
    renaming = checkpoint_renaming(weights, list(state))
    if renaming is None:
        log.warning("checkpoint conversion derives tensors: names published as given")
        return state, "given"
    return {new: state[old] for new, old in renaming.items()}, "checkpoint"


def _region(full: tuple[int, ...], offset: Sequence[int], size: Sequence[int]) -> Region | None:
    """Where a local piece of ``size`` at ``offset`` lies in a tensor of ``full`` (None:
    it is empty). A box for tensors of two or more dimensions, so that a tensor's pieces
    are all boxes whatever dimension the ranks split: one rule on every rank."""
    if 0 in size:
        return None
    if not full:
        return Region.flat(1, 0, 1)
    return Region(full, tuple(offset), tuple(size))


def _root(mesh: DeviceMesh) -> DeviceMesh:
    root = getattr(mesh, "_get_root_mesh", None)
    found = root() if callable(root) else None
    return found if isinstance(found, DeviceMesh) else mesh


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def parallel_dims(tensors: Mapping[str, object]) -> set[str]:
    """The named mesh dimensions some DTensor of this rank is placed on: dimensions
    over which ranks hold the same tensors (data or tensor parallel). A dimension of
    the world's mesh that none uses (pipeline stages) separates different tensors."""
    return {
        n for t in tensors.values() if isinstance(t, DTensor) for n in _dim_names(t.device_mesh)
    }


def _dtensor_piece(
    name: str, t: DTensor, parallel: set[str]
) -> tuple[torch.Tensor, Region | None] | None:
    """This rank's local chunk of ``t`` and where it lies (Shard or Replicate on any
    dimension of a mesh of any rank, with torch's own chunking); None when this rank
    does not stage ``t``: a replica other than coordinate 0 of a Replicate dimension,
    or of a ``parallel`` dimension of the world's mesh that ``t``'s sub-mesh leaves
    out (under FSDP2 x TP a tensor not split by TP lives on the dp sub-mesh of every
    tp coordinate: the same pieces, staged once)."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    root = _root(mesh)
    if root is not mesh and _dim_names(root) and _dim_names(mesh):
        at = root.get_coordinate()
        for dim, dim_name in enumerate(_dim_names(root)):
            left_out = dim_name not in _dim_names(mesh) and dim_name in parallel
            if left_out and at is not None and at[dim] != 0:
                return None
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            if coordinate[dim] != 0:
                return None
        elif not (placement.is_shard() or isinstance(placement, _StridedShard)):
            raise ConfigError(
                f"tensor {name!r}: placement {placement!r} is not supported (Shard or "
                "Replicate: a Partial tensor must be reduced before it is emitted)"
            )
    local = t.to_local()
    full = tuple(t.shape)
    size, offset = compute_local_shape_and_global_offset(full, mesh, placements)
    if tuple(local.shape) != tuple(size):
        raise MismatchError(
            f"tensor {name!r}: rank's local chunk has shape {tuple(local.shape)}, expected "
            f"{tuple(size)} for {placements} of {full} at coordinate {coordinate}"
        )
    return local, _region(full, offset, size)


def _plain_piece(name: str, value: ShardPiece) -> tuple[torch.Tensor, Region | None]:
    local, full = value.tensor, tuple(value.full_shape)
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
        raise ConfigError(f"tensor {name!r}: a ShardPiece holds a plain tensor")
    if value.offset is not None:
        offset = tuple(value.offset)
        if len(offset) != len(full) or local.dim() != len(full):
            raise MismatchError(
                f"tensor {name!r}: a piece of shape {tuple(local.shape)} at {list(offset)} "
                f"is no box of {full}"
            )
    else:
        first_row = value.start_row
        if isinstance(first_row, bool) or not isinstance(first_row, int):
            raise ConfigError(f"tensor {name!r}: start_row must be an integer")
        if not full or local.dim() != len(full) or tuple(local.shape[1:]) != full[1:]:
            raise MismatchError(
                f"tensor {name!r}: piece of shape {tuple(local.shape)} is no row slice of {full}"
            )
        offset = (first_row, *([0] * (len(full) - 1)))
    if any(isinstance(o, bool) or not isinstance(o, int) for o in offset):
        raise ConfigError(f"tensor {name!r}: a ShardPiece's offset must be integers")
    try:
        return local, _region(full, offset, tuple(local.shape))
    except MismatchError as exc:
        raise MismatchError(f"tensor {name!r}: {exc}") from None


def _local_piece(name: str, value: object, parallel: set[str]) -> _Local | None:
    if isinstance(value, DTensor):
        held = _dtensor_piece(name, value, parallel)
        if held is None:
            return None
        local, region = held
        full = tuple(value.shape)
    elif isinstance(value, ShardPiece):
        local, region = _plain_piece(name, value)
        full = tuple(value.full_shape)
    elif isinstance(value, torch.Tensor):
        local, full = value, tuple(value.shape)
        region = _region(full, [0] * len(full), full)
    else:
        raise ConfigError(f"tensor {name!r} is a {type(value).__name__}, not a tensor")
    return _Local(name, local.detach().reshape(-1), full, region)


def _cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _confined(path: Path, root: Path) -> bool:
    """True for a real folder inside ``root`` (after resolving), not a link out of it."""
    return not path.is_symlink() and path.is_dir() and path.resolve().is_relative_to(root)


class ShardedEmitter(RunEmitter):
    """Emits a sharded run's steps; one per rank, each ``emit_shards`` on every rank.

    ``rank``/``world`` default to torch.distributed's (when initialised), else the
    ``RANK``/``WORLD_SIZE`` environment; ``host`` to ``DELTASYNC_DIFF_HOST``, else the
    machine's host name: the diff workers started with that host take this rank's
    parts, so the ranks of one machine and its diff workers must name the same host.
    ``launch``: see :meth:`emit_shards`; the plain (no process group) ranks of one start
    pass the same one, or set ``DELTASYNC_LAUNCH``."""

    def __init__(
        self,
        run: str,
        *,
        rank: int | None = None,
        world: int | None = None,
        host: str | None = None,
        launch: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        super().__init__(run, settings=settings)
        default_rank, default_world = _default_rank_world()
        rank = default_rank if rank is None else rank
        world = default_world if world is None else world
        if rank is None or world is None:
            raise ConfigError(
                "rank and world size unknown: initialise torch.distributed, set RANK and "
                "WORLD_SIZE, or pass rank= and world="
            )
        for what, value in (("rank", rank), ("world", world)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{what} must be an integer, got {value!r}")
        if not 1 <= world <= MAX_WORLD or not 0 <= rank < world:
            raise ConfigError(f"rank {rank} of world {world} is out of range")
        self.rank = rank
        self.world = world
        self.host = keys.check_node_name(host or self.settings.diff_host or socket.gethostname())
        self.launch = _default_launch(self.settings) if launch is None else launch
        self._last_step: int | None = None

    def run_folder(self) -> Path:
        return self.settings.staging_dir / self.run

    def step_path(self, step: int) -> Path:
        return self.run_folder() / f"step-{step:010d}"

    def rank_path(self, step: int) -> Path:
        return self.step_path(step) / f"rank-{self.rank:05d}"

    def emit_shards(
        self,
        step: int,
        weights: Weights,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        max_shard_bytes: int | None = None,
    ) -> RankEmitted:
        """Stage what this rank holds of ``weights`` (cast to ``dtype``), register it, and
        send the step if this rank is the last of the world to register.

        ``weights``: an ``nn.Module`` (its state dict; FSDP2 ``fully_shard`` keeps the
        original names; a transformers model gets its checkpoint names when that is a
        renaming only) or a mapping name -> tensor, each either a DTensor (FSDP2,
        tensor parallel, or both on a 2-D mesh: Shard of any dimension, or Replicate,
        staged by mesh coordinate 0 only), a ``ShardPiece`` (a row slice or a box of
        the full tensor), or a plain tensor (held whole by this rank: give it on one
        rank only). Partial placements: ConfigError naming the tensor. Together the
        ranks must cover each tensor once (a step whose pieces do not is not
        publishable).

        No collective is called, so no rank waits for another. A rank that raises (or
        dies) before it registers leaves the step incomplete: nothing is sent for it,
        the other ranks return normally, and the next step completes on its own. Its
        staged folders of steps that never completed are removed once a later step
        completed. A step emitted again after a restart completes only with the
        folders of this start's ranks (``launch``: ``DELTASYNC_LAUNCH``, else drawn by
        rank 0 and broadcast once when the emitter is made; all ranks must make theirs
        at the same point, as for any collective)."""
        self._check_newer(step)
        tensors, form = _tensors_of(weights)
        parallel = parallel_dims(tensors)
        found = [
            p for name, v in tensors.items() if (p := _local_piece(name, v, parallel)) is not None
        ]
        held = [p for p in found if p.region is not None]  # zero-size pieces are not staged
        pieces = []
        for p in held:
            staged = _cast_dtype(p.flat, dtype)
            if staged not in BY_TORCH:
                raise MismatchError(f"tensor {p.name!r} has dtype {staged} deltasync cannot hold")
            name = BY_TORCH[staged].name
            assert p.region is not None
            pieces.append(RankPiece.at(p.name, name, p.shape, p.region))
        layout = RankLayout(self.run, step, self.rank, self.world, self.host, tuple(pieces))
        folder = self._stage(layout, held, dtype, form, max_shard_bytes)
        digest = layout_digest(layout)
        entry = RankFolder(self.host, str(folder), self.world, digest, self.launch)
        faults.point("emit.before_register")
        completed = register_rank(self.runtime.redis, self.run, step, self.rank, entry)
        sent = None
        if completed:
            path = str(self.step_path(step).resolve())
            args = DiffArgs(self.run, step, path, owned=True, sharded=True, launch=self.launch)
            sent = send_step(self.runtime, args)
        log.info("rank staged", run=self.run, step=step, rank=self.rank, completed=completed)
        self._remove_incomplete(step, completed)
        self._last_step = step
        return RankEmitted(self.run, step, self.rank, str(folder), digest, sent)

    def _stage(
        self,
        layout: RankLayout,
        held: list[_Local],
        dtype: torch.dtype | None,
        form: TensorForm,
        max_shard_bytes: int | None,
    ) -> Path:
        """Write the rank folder: into a temporary sibling, renamed into place."""
        target = self.rank_path(layout.step)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")

        def flats() -> Iterator[tuple[str, torch.Tensor]]:
            return named_tensors({p.name: p.flat for p in held}, dtype)

        metadata: dict[str, str] = {FORM_METADATA_KEY: form}
        try:
            if held and max_shard_bytes is not None:
                write_checkpoint(tmp, flats(), max_shard_bytes=max_shard_bytes, metadata=metadata)
            else:
                tmp.mkdir()
                if held:  # a rank holding nothing stages its layout only
                    specs = named_specs({p.name: p.flat for p in held}, dtype)
                    write_checkpoint(tmp / CHECKPOINT_NAME, flats(), metadata=metadata, specs=specs)
            write_layout(tmp, layout)
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
            if target.exists() or target.is_symlink():  # the same step staged again
                os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target.resolve()

    def _remove_incomplete(self, step: int, completed: bool) -> None:
        """Remove this rank's folders of earlier steps that never completed, once a later
        step did: every rank registered that step after returning from the earlier
        one, so the earlier one can no longer complete. Only ever
        ``<staging>/<run>/step-*/rank-<R>`` of this run and rank, resolved inside it."""
        root = self.run_folder().resolve()
        if not root.is_dir():
            return
        mine = f"rank-{self.rank:05d}"
        earlier = sorted(
            (int(match[1]), child)
            for child in root.iterdir()
            if (match := _STEP_FOLDER.fullmatch(child.name)) and int(match[1]) < step
        )
        if not earlier:
            return
        r = self.runtime.redis
        # A later step's marker tells it completed: those of the folders still here,
        # of the step this emitter did last, and of this one.
        seen = {s for s, _ in earlier} | {step}
        if self._last_step is not None:
            seen.add(self._last_step)
        candidates = sorted(seen)
        with r.pipeline(transaction=False) as pipe:
            for s in candidates:
                pipe.exists(keys.emitted_key(self.run, s))
            marked = dict(zip(candidates, pipe.execute(), strict=True))
        done = [s for s, m in marked.items() if m]
        if completed:
            done.append(step)
        if not done:
            return
        latest = max(done)
        for s, child in earlier:
            if s >= latest or marked.get(s):
                continue
            folder = child / mine
            if not _confined(child, root) or not _confined(folder, root):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            log.info("incomplete step removed", run=self.run, step=s, rank=self.rank)
            with contextlib.suppress(OSError):
                child.rmdir()  # only once no other rank of this host is left in it
