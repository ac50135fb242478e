"""Decode and check a whole delta before any weight is written; apply it all or nothing.

Shared by every target, through ``pipeline.targets.proving.prove_and_write``. The flow:

1. ``check_objects(manifest, objects)``: every object the manifest names is present
   and matches its size and sha256 (CorruptObjectError otherwise).
2. ``decode_entries(entries, objects, base, specs)``: parse every delta object and
   decode EVERY changed tensor against the target's held copy (``base(name)``),
   checking names, dtypes, shapes and changed counts against the manifest and the
   target's specs. Nothing is written; a MismatchError / CorruptObjectError names
   the tensor at fault.
3. ``hash_patched(patches, tensor, expected)``: build each touched tensor's new
   content chunk by chunk in host memory (a few MiB of scratch, whatever the tensor's
   size or device) and check its hash against the manifest, still before any
   write, so a target can keep hashing out of the time its weights are locked.
   ``pipeline.targets.proving.prove_entries`` does 2 and 3 (and gathers the old
   contents) in one pass per tensor.
4. ``apply_verified(patches, tensor, expected)``: write the patches into the held
   tensors in place, optionally hash the result, and roll every written element
   back if any hash differs from the manifest. Only the old contents at the
   changed positions are kept for the rollback, never a second copy of the weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from pipeline import cpus
from pipeline.codec import DeltaObject, TensorPatch, apply_patch, read_delta
from pipeline.codec.compiled import kernels
from pipeline.errors import CorruptObjectError, DeltasyncError, MismatchError, TargetError
from pipeline.format.hashes.hashing import content_hash, patched_tensor_hash, sha256_bytes
from pipeline.format.manifest import Manifest, Piece, TensorEntry, dtype_name
from pipeline.format.matching import check_entry
from pipeline.targets import confirmed
from pipeline.targets.base import TensorSpec
from pipeline.testing import faults

_T = TypeVar("_T")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same width (bit-exact comparisons)."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    return tensor.view(_INT_VIEW[tensor.element_size()])


def check_objects(manifest: Manifest, objects: Mapping[str, bytes]) -> None:
    """Every object the manifest names is present with the right size and sha256."""
    for entry in manifest.objects:
        data = objects.get(entry.key)
        where = f"object {entry.key} of {manifest.run} v{manifest.version}"
        if data is None:
            raise CorruptObjectError(f"{where} was not supplied")
        if len(data) != entry.size:
            raise CorruptObjectError(f"{where}: {len(data)} bytes, manifest says {entry.size}")
        if sha256_bytes(data) != entry.sha256:
            raise CorruptObjectError(f"{where}: sha256 mismatch")


def parse_objects(objects: Mapping[str, bytes], keys: Iterable[str]) -> dict[str, DeltaObject]:
    parsed: dict[str, DeltaObject] = {}
    for key in sorted(set(keys)):
        data = objects.get(key)
        if data is None:
            raise CorruptObjectError(f"delta object {key} was not supplied")
        try:
            parsed[key] = read_delta(data, object_name=key)
        except DeltasyncError:
            raise
        except Exception as exc:  # a damaged container may trip any parser error
            raise CorruptObjectError(f"delta object {key}: {exc}") from exc
    return parsed


def decode_entries(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
) -> list[TensorPatch]:
    """Decode every changed tensor of a delta against the held weights; write nothing.

    ``entries`` are the manifest's tensor entries (all of them: unchanged ones are
    checked against ``specs`` too). ``base(name)`` returns the held tensor in
    checkpoint layout (its exact current contents). Raises MismatchError for a
    name, dtype, shape or count that disagrees, CorruptObjectError for an object
    that cannot be read or decoded.
    """
    patches: list[TensorPatch] = []
    for entry, delta, held, spec in changed_entries(entries, objects, base, specs):
        patch = guarded(delta.decode, entry, held)
        check_patch(patch, entry, spec)
        patches.append(patch)
    return patches


def guarded(
    decode: Callable[[str, torch.Tensor], _T], entry: TensorEntry, held: torch.Tensor
) -> _T:
    """``decode(entry.name, held)``, with any error that is not deltasync's own (a
    damaged object may trip any parser) reported as a CorruptObjectError naming the
    tensor."""
    try:
        return decode(entry.name, held)
    except DeltasyncError:
        raise
    except ImportError as exc:  # the installation's fault, not the object's
        raise TargetError(f"the codec cannot be loaded ({exc}); reinstall deltasync") from exc
    except Exception as exc:
        raise CorruptObjectError(f"tensor {entry.name} in object {entry.object}: {exc}") from exc


def changed_records(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    specs: Mapping[str, TensorSpec],
) -> tuple[dict[str, DeltaObject], list[tuple[TensorEntry, list[Piece]]]]:
    """The parsed objects of a delta and every changed tensor with its changed pieces
    (one of it all for a tensor stored whole), after checking every entry against
    ``specs`` and every record against its piece: each object changes only what the
    manifest lists, each changed piece's record is there with its dtype, shape and
    count. A MismatchError / CorruptObjectError names the tensor at fault."""
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise MismatchError("manifest lists a tensor twice")
    for entry in entries:
        check_entry(entry, specs, of="the delta", holder="the target")
    changed = [(e, [p for p in e.stored if p.changed]) for e in entries if e.changed > 0]
    parsed = parse_objects(objects, (p.object for _, ps in changed for p in ps))
    listed = {(p.object, e.name) for e, ps in changed for p in ps}
    for key, delta in parsed.items():
        for stored in delta.tensors:
            if stored.changed > 0 and (key, stored.name) not in listed:
                raise MismatchError(
                    f"tensor {stored.name} is changed in object {key} but not in the manifest"
                )
    for entry, pieces in changed:
        spec = specs[entry.name]
        want = spec.shape
        for piece in pieces:
            where = record_place(entry, piece)
            try:
                info = parsed[piece.object].info(entry.name)  # by name: a scan was O(n^2)
            except MismatchError:
                raise MismatchError(f"{where}: not in the object") from None
            if entry.pieces:
                want = (piece.numel,)
            if info.dtype != spec.dtype or tuple(info.shape) != want:
                raise MismatchError(
                    f"{where}: the object holds {dtype_name(info.dtype)}{list(info.shape)}, "
                    f"expected {dtype_name(spec.dtype)}{list(want)}"
                    + (" (a piece at the wrong place?)" if entry.pieces else "")
                )
            if info.changed != piece.changed:
                raise MismatchError(
                    f"{where}: the object changes {info.changed} elements, "
                    f"manifest says {piece.changed}"
                )
    return parsed, changed


def record_place(entry: TensorEntry, piece: Piece) -> str:
    """Where a record lies, for messages: its tensor, piece (if stored in pieces) and object."""
    if entry.pieces:
        return f"tensor {entry.name}: {piece.describe()} in object {piece.object}"
    return f"tensor {entry.name} in object {piece.object}"


def changed_entries(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
) -> Iterator[tuple[TensorEntry, DeltaObject, torch.Tensor, TensorSpec]]:
    """(entry, its parsed object, held tensor, spec) of every changed tensor of a delta
    stored whole, after the checks of :func:`changed_records`."""
    parsed, changed = changed_records(entries, objects, specs)
    for entry, _ in changed:
        spec = specs[entry.name]
        held = base(entry.name)
        if held.dtype != spec.dtype or tuple(held.shape) != spec.shape:
            raise MismatchError(f"tensor {entry.name}: held copy has the wrong dtype or shape")
        yield entry, parsed[entry.object], held, spec


def _ends(positions: torch.Tensor) -> tuple[int, int]:
    """The first and last of non-empty positions; numpy reads a CPU tensor's elements
    several times faster than torch indexing."""
    at = positions.numpy() if positions.is_cpu else positions
    return int(at[0]), int(at[-1])


def check_patch(patch: TensorPatch, entry: TensorEntry, spec: TensorSpec) -> None:
    count = patch.positions.numel()
    if count != entry.changed or patch.values.numel() != count:
        raise CorruptObjectError(
            f"tensor {entry.name}: decoded {count} positions and "
            f"{patch.values.numel()} values, manifest says {entry.changed}"
        )
    if patch.positions.dtype != torch.int64 or patch.positions.dim() != 1:
        raise CorruptObjectError(f"tensor {entry.name}: decoded positions are not flat int64")
    # Positions are sorted ascending: the ends bound them all.
    if count:
        first, last = _ends(patch.positions)
        if first < 0 or last >= math.prod(spec.shape):
            raise CorruptObjectError(f"tensor {entry.name}: decoded position out of range")


def _hash_patched(held: torch.Tensor, patch: TensorPatch) -> str:
    """xxh3-128 of ``held`` with ``patch`` applied, without a patched full copy: the
    changes are written into chunks in host memory (a CPU tensor's own chunks copied
    into a scratch buffer; another device's copied out to the host)."""
    flat = int_view(held.detach()).reshape(-1)
    where = patch.positions.cpu().numpy()
    values = patch.values.cpu().view(flat.dtype).numpy()

    def put(chunk: np.ndarray, start: int, lo: int, hi: int) -> None:
        if hi > lo:
            chunk[where[lo:hi] - start] = values[lo:hi]

    return patched_tensor_hash(flat, where, put)


def hash_patched(
    patches: Sequence[TensorPatch],
    tensor: Callable[[str], torch.Tensor],
    expected: Mapping[str, str],
) -> dict[str, str]:
    """Content hash of every touched tensor as it will be after its patch, computed
    without writing the held tensor (chunk by chunk in host memory; a GPU tensor's
    chunks are copied out while the previous one is hashed). MismatchError names the
    first tensor whose result differs from ``expected``. The held tensors must not
    change between this call and the write, or the hashes prove nothing."""
    return {p.name: _checked(p.name, _hash_patched(tensor(p.name), p), expected) for p in patches}


def _checked(name: str, digest: str, expected: Mapping[str, str]) -> str:
    """``digest``, if it is the ``expected`` hash of tensor ``name``."""
    if digest != expected.get(name):
        raise hash_mismatch(name, digest, expected.get(name))
    return digest


def hash_mismatch(name: str, digest: str, want: str | None) -> MismatchError:
    return MismatchError(
        f"tensor {name}: content hash after patching is {digest}, "
        f"manifest says {want} (wrong base version?)"
    )


@dataclass(frozen=True)
class _Undo:
    name: str
    positions: torch.Tensor
    old: torch.Tensor


@dataclass
class AppliedPatches:
    """Patches written into held tensors, with what is needed to take them back."""

    patches: list[TensorPatch]
    hashes: dict[str, str]  # new content hashes of the touched tensors (if verified)
    _tensor: Callable[[str], torch.Tensor]
    _undo: list[_Undo]

    def rollback(self) -> None:
        """Restore the old contents at every written position (idempotent)."""
        for item in reversed(self._undo):
            flat = int_view(self._tensor(item.name)).view(-1)
            flat.index_copy_(0, item.positions, item.old.to(flat.device))
        self._undo = []


def saved_old_values(
    patches: Sequence[TensorPatch], tensor: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The held contents at every patched position (for undo), gathered before the
    write so that a caller can keep the gather out of the time its weights are locked.
    Valid only while the held tensors do not change."""
    old: dict[str, torch.Tensor] = {}
    for patch in patches:
        flat = int_view(tensor(patch.name)).view(-1)
        old[patch.name] = flat.index_select(0, patch.positions.to(flat.device))
    return old


# Scattered writes into cold weights are bound by the cache misses one core keeps in
# flight; a second core writing other tensors shortens the locked write (~1.7x here).
_PARALLEL_WRITE_MIN = 1 << 16  # changed elements


@functools.cache
def _second_writer() -> ThreadPoolExecutor:
    """The one thread that writes half of a large CPU delta next to the caller's."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-write")


def split_for_two_writers(
    items: Sequence[_T], size: Callable[[_T], int], on_cpu: bool
) -> tuple[list[_T], list[_T]]:
    """(items for this thread, items for a second one): halves by ``size`` (changed
    elements), or everything here when the write is small, on a GPU or on one CPU."""
    total = sum(size(item) for item in items)
    if total < _PARALLEL_WRITE_MIN or not on_cpu or cpus.available() < 2:
        return list(items), []
    mine: list[_T] = []
    other: list[_T] = []
    load = [0, 0]
    for item in sorted(items, key=lambda i: -size(i)):
        side = 0 if load[0] <= load[1] else 1
        (mine, other)[side].append(item)
        load[side] += size(item)
    return mine, other


def write_on_two_threads(
    items: Sequence[_T],
    size: Callable[[_T], int],
    on_cpu: bool,
    write: Callable[[Sequence[_T], bool], None],
) -> None:
    """``write(items, faulty)`` for all ``items``, half of them (by ``size``) on the
    second writer thread when :func:`split_for_two_writers` says so; only this
    thread's call is ``faulty`` (carries the crash point). Both halves have finished
    when it returns or raises (the second half's error if it had one, else this
    one's), so a caller's rollback never races a write."""
    mine, other = split_for_two_writers(items, size, on_cpu)
    helper = _second_writer().submit(write, other, False) if other else None
    try:
        write(mine, True)
    finally:
        if helper is not None:
            helper.result()


# Confirmed writes go WRITE_BATCH patches to a compiled call (the Python around one
# small patch costs more than its write). The crash point is passed once per patch,
# after its batch: a crash there leaves the batches before it written.
WRITE_BATCH = 16


def _write(
    patches: Sequence[TensorPatch],
    tensor: Callable[[str], torch.Tensor],
    faulty: bool,
    confirm: bool = False,
) -> None:
    """Write ``patches``; with ``confirm`` (CPU tensors, see :mod:`confirmed`), each
    one's written positions are read back in the same compiled pass."""
    if confirm:
        for start in range(0, len(patches), WRITE_BATCH):
            batch = patches[start : start + WRITE_BATCH]
            confirmed.write_confirmed_all([(tensor(p.name), p) for p in batch])
            for _ in batch if faulty else ():
                faults.point("target.mid_write")
        return
    for patch in patches:
        apply_patch(tensor(patch.name), patch)
        if faulty:
            faults.point("target.mid_write")


def rehash_written(
    names: Sequence[str],
    tensor: Callable[[str], torch.Tensor],
    expected: Mapping[str, str],
    full: Callable[[torch.Tensor], str] = content_hash,
) -> dict[str, str]:
    """Content hashes (``full``) of the written tensors ``names``; MismatchError naming
    the first that differs from ``expected``."""
    return {name: _checked(name, full(tensor(name)), expected) for name in names}


def check_written(patches: Sequence[TensorPatch], tensor: Callable[[str], torch.Tensor]) -> None:
    """Read back the written positions: each holds its patch's new contents
    (MismatchError naming the first tensor that does not). O(changed)."""
    for patch in patches:
        flat = int_view(tensor(patch.name)).view(-1)
        if flat.device.type == "cpu" and patch.positions.device.type == "cpu":
            # one compiled pass, nothing allocated (numpy's gather and compare took
            # 3-4x longer at 2M positions in a 1.2 GB state)
            where, values = patch.positions.numpy(), patch.values.view(flat.dtype).numpy()
            same = kernels.get().first_difference(flat.numpy(), where, values) < 0
        else:
            got = flat.index_select(0, patch.positions.to(flat.device))
            same = torch.equal(got, patch.values.to(got.device).view(got.dtype))
        if not same:
            raise MismatchError(
                f"tensor {patch.name}: read back after the write, the changed positions do "
                "not hold the new contents"
            )


def apply_verified(
    patches: Sequence[TensorPatch],
    tensor: Callable[[str], torch.Tensor],
    expected: Mapping[str, str] | None,
    old_values: Mapping[str, torch.Tensor] | None = None,
    *,
    full: Callable[[torch.Tensor], str] = content_hash,
    read_back: bool = False,
) -> AppliedPatches:
    """Apply all patches in place; with ``expected`` hashes, check each touched tensor
    and roll every patch back if one differs (MismatchError naming it).

    ``tensor(name)`` returns the held tensor to write (contiguous, checkpoint
    layout). The result can still be rolled back (a later step failed) and carries
    the new content hashes of the touched tensors (empty when ``expected`` is None).
    ``old_values`` (from :func:`saved_old_values`) saves gathering them here.
    ``full`` is the content hash (the manifest's); ``read_back`` checks the written
    positions (:func:`check_written`) before any rehash.
    """
    applied = AppliedPatches(list(patches), {}, tensor, [])
    try:
        for patch in patches:
            held = tensor(patch.name)
            positions = patch.positions.to(held.device)
            old = old_values.get(patch.name) if old_values is not None else None
            if old is None:
                old = int_view(held).view(-1).index_select(0, positions)
            applied._undo.append(_Undo(patch.name, positions, old))
        on_cpu = all(
            p.positions.device.type == "cpu" and tensor(p.name).device.type == "cpu"
            for p in patches
        )
        # The read-back fused into the write where it proves the same (see confirmed.py).
        confirm = (
            read_back
            and on_cpu
            and confirmed.available()
            and confirmed.disjoint([tensor(p.name) for p in patches])
        )
        write_on_two_threads(
            patches,
            lambda p: p.positions.numel(),
            on_cpu,
            lambda part, faulty: _write(part, tensor, faulty, confirm),
        )
        if read_back and not confirm:
            check_written(patches, tensor)
        if expected is not None:
            applied.hashes.update(rehash_written([p.name for p in patches], tensor, expected, full))
        return applied
    except BaseException:
        applied.rollback()
        raise
