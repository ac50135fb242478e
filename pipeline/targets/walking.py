"""Writing proven tensors by walking their deltas, keeping no patch in memory.

A target that proved a tensor's result against its manifest hash (see
:mod:`pipeline.targets.proving`) can drop the decoded patch and, under its write
lock, decode the delta straight into the held tensor (``DeltaObject.apply_to``).
Undo needs no saved contents either: walking the same delta back subtracts each
difference again (``DeltaObject.undo_apply``). The memory an apply holds is then the
delta objects themselves, about 1.2 bytes per changed element instead of about 12
for decoded positions, new contents and old contents.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pipeline.codec import DeltaObject, TensorPatch
from pipeline.errors import TargetError
from pipeline.format.hashes.hashing import content_hash
from pipeline.targets.patching import (
    AppliedPatches,
    int_view,
    rehash_written,
    write_on_two_threads,
)
from pipeline.testing import faults


@dataclass(frozen=True)
class Walk:
    """A tensor proven against its manifest hash whose patch was not kept; for a
    sharded run's piece, ``span`` is the flat elements ``[start, stop)`` of the tensor
    its record covers (one walk per piece; None: the whole tensor)."""

    name: str
    delta: DeltaObject
    changed: int
    span: tuple[int, int] | None = None

    def target(self, held: torch.Tensor) -> torch.Tensor:
        """What the record decodes into: ``held`` or a view of its span."""
        if self.span is None:
            return held
        start, stop = self.span
        return held.detach().view(-1)[start:stop]

    def positions(self, held: torch.Tensor) -> torch.Tensor:
        """The flat positions in ``held`` this walk writes, from the delta's streams
        alone (``held`` gives the size and is not read)."""
        found = self.delta.differences(self.name, self.target(held))
        if found is None:
            raise TargetError(f"tensor {self.name!r}: its delta gives no positions alone")
        positions = torch.from_numpy(found[0])
        return positions if self.span is None else positions + self.span[0]


def written_patch(name: str, walks: Sequence[Walk], held: torch.Tensor) -> TensorPatch:
    """The patch that ``walks`` wrote into ``held``: their positions, and the contents
    ``held`` now has there. For a writer that must pass on what changed (the vLLM
    worker's push into the engine) without having kept the patch: built one tensor
    at a time, so memory stays at one tensor's positions."""
    positions = torch.cat([walk.positions(held) for walk in walks])
    if len(walks) > 1:  # a sharded run's pieces, in any order
        positions = positions.sort().values
    values = int_view(held.detach()).reshape(-1).index_select(0, positions)
    return TensorPatch(name, held.dtype, tuple(held.shape), positions, values)


@dataclass(frozen=True)
class ProvenPatches:
    """Patches whose results were checked against the manifest's hashes before any
    write, with the held contents at their positions (for undo); and, without
    ``keep_patches``, the proven tensors that keep no patch (``walks``)."""

    patches: list[TensorPatch]
    hashes: dict[str, str]  # new content hash per touched tensor
    old_values: dict[str, torch.Tensor]
    walks: list[Walk] = field(default_factory=list)


@dataclass
class WalkedDeltas:
    """Walks written into held tensors; ``rollback`` walks them back."""

    hashes: dict[str, str]  # new content hashes of the written tensors (if verified)
    _tensor: Callable[[str], torch.Tensor]
    _done: list[Walk] = field(default_factory=list)

    def rollback(self) -> None:
        """Restore every written tensor (idempotent), newest first."""
        while self._done:
            walk = self._done.pop()
            walk.delta.undo_apply(walk.name, walk.target(self._tensor(walk.name)))


def apply_walks(
    walks: Sequence[Walk],
    tensor: Callable[[str], torch.Tensor],
    expected: Mapping[str, str] | None,
    *,
    full: Callable[[torch.Tensor], str] = content_hash,
    confirm: bool = False,
) -> WalkedDeltas:
    """Write every walk into ``tensor(name)``, all or nothing: a failure (a damaged
    stream; with ``expected``, a written tensor whose hash by ``full``, the run's
    content hash, differs; with ``confirm``, a written position that, read back
    within the walk, does not hold its new contents) walks back what was written and
    raises. The read-back is what an incremental content hash needs after a write
    (O(changed), as for patches: see :mod:`pipeline.targets.confirmed`). A large
    write runs on two threads, as patches do (the compiled walk releases the GIL)."""
    written = WalkedDeltas({}, tensor)
    try:
        # Both threads record what they wrote in one list (appends are atomic).
        write_on_two_threads(
            walks,
            lambda w: w.changed,
            True,
            lambda part, faulty: _walk(part, tensor, written._done, faulty, confirm),
        )
        if expected is not None:
            names = [w.name for w in walks]
            written.hashes.update(rehash_written(names, tensor, expected, full))
        return written
    except BaseException:
        written.rollback()
        raise


# Walks of one object with at most this many changes go to one compiled call, up to
# WALK_BATCH of them (the Python around a small tensor's walk costs more than the
# walk). The crash point is passed once per walk, after its batch.
SMALL_WALK = 1 << 16
WALK_BATCH = 64


def _walk(
    walks: Sequence[Walk],
    tensor: Callable[[str], torch.Tensor],
    done: list[Walk],
    faulty: bool,
    confirm: bool,
) -> None:
    for batch in _batches(walks, tensor):
        if len(batch) == 1:
            walk = batch[0]
            # Undoes itself on damage, and on a failed read-back.
            walk.delta.apply_to(walk.name, walk.target(tensor(walk.name)), confirm=confirm)
            done.append(walk)
        else:
            by_name = {walk.name: walk for walk in batch}
            items = [(w.name, w.target(tensor(w.name))) for w in batch]
            written, error = batch[0].delta.apply_many(items, confirm=confirm)
            done.extend(by_name[name] for name in written)
            if error is not None:
                raise error
        for _ in batch if faulty else ():
            faults.point("target.mid_walk")


def _batches(walks: Sequence[Walk], tensor: Callable[[str], torch.Tensor]) -> list[list[Walk]]:
    """``walks`` in order, runs of small walks of one object that the compiled walk
    writes in place (CPU, one tensor each) cut into batches, the others alone."""
    out: list[list[Walk]] = []
    run: list[Walk] = []
    for walk in walks:
        small = (
            walk.changed <= SMALL_WALK
            and walk.span is None
            and walk.delta.walks(walk.name, tensor(walk.name))
        )
        if run and (not small or walk.delta is not run[0].delta or len(run) == WALK_BATCH):
            out.append(run)
            run = []
        if small:
            run.append(walk)
        else:
            out.append([walk])
    if run:
        out.append(run)
    return out


@dataclass
class Written:
    """A proven delta written into held tensors: its patches and its walks (by tensor
    name, one per piece of a sharded run's tensor), the content hashes it proved, and
    how to take it all back."""

    applied: AppliedPatches
    walked: WalkedDeltas
    walks: dict[str, list[Walk]]
    hashes: dict[str, str]  # new content hash per proven tensor (none unverified)
    early_tensors: int = 0  # tensors whose early proofs stood in for decode and hash

    @property
    def patches(self) -> list[TensorPatch]:
        return self.applied.patches

    @property
    def touched(self) -> list[str]:
        """The names the delta was written under, patched then walked."""
        return [*(patch.name for patch in self.patches), *self.walks]

    @property
    def changed(self) -> int:
        """Elements written."""
        patched = sum(int(patch.positions.numel()) for patch in self.patches)
        return patched + sum(w.changed for each in self.walks.values() for w in each)

    def rollback(self) -> None:
        """Put the held tensors back as they were before the write (idempotent)."""
        self.walked.rollback()
        self.applied.rollback()
