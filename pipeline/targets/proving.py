"""Proving a delta before any write, then writing it: every touched tensor's result
is decoded and hashed against the manifest while the held weights are only read.

:func:`prove_and_write` is the one path every target takes (the torch target, each
vLLM worker's shadow; whole tensors or a sharded run's pieces): it picks the proof
(decode only, the one-pass full hash, the incremental hash, the pieced proof), then
writes all proven tensors or none. A target supplies only its held weights
(:class:`pipeline.targets.base.HeldWeights`). For CPU tensors in the common
encodings one chunked pass over each held tensor gives the patch, the old contents
(for undo) and the hash after it. :func:`prove_object` does the same for one object
before its manifest is known (early start), and :func:`early_results` picks the
results a manifest confirms.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TypeVar

import torch

from pipeline import cpus
from pipeline.codec import DeltaObject, HashedPatch, TensorPatch
from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.hashes.content_hashes import XXH3, XXH3_ALGORITHM, HashAlgorithm
from pipeline.format.manifest import Piece, TensorEntry, dtype_from_name, dtype_name
from pipeline.format.matching import spec_of
from pipeline.format.regions import Region
from pipeline.targets.base import (
    EarlyProof,
    EarlyResult,
    HeldWeights,
    ProvenDigest,
    TensorSpec,
    VerifyMode,
)
from pipeline.targets.patching import (
    apply_verified,
    changed_entries,
    changed_records,
    check_patch,
    decode_entries,
    guarded,
    hash_mismatch,
    hash_patched,
    int_view,
    parse_objects,
    record_place,
    saved_old_values,
)
from pipeline.targets.walking import ProvenPatches, Walk, Written, apply_walks

_R = TypeVar("_R")


# Decoded patches (positions, new and old contents: about 12 bytes per changed bf16
# element) a version may hold in host memory; above it, proven tensors are written by
# walking their deltas instead (pipeline/targets/walking.py), at about 1.2 bytes.
DEFAULT_PATCH_MEMORY_BYTES = 1 << 30


def patch_bytes(changed: int, dtype: torch.dtype) -> int:
    """Host memory of a decoded patch kept until its write: int64 positions, new and
    old contents per changed element."""
    return changed * (8 + 2 * dtype.itemsize)


def patches_bytes(entries: Sequence[TensorEntry]) -> int:
    """Host memory the decoded patches of a delta's ``entries`` would take until written."""
    return sum(patch_bytes(e.changed, dtype_from_name(e.dtype)) for e in entries)


class PatchAllowance:
    """Patches early proofs may keep between two writes, up to ``limit()`` bytes (the
    target's ``DELTASYNC_PATCH_MEMORY_MB``): past it a proof keeps only its hashes and
    the apply walks those tensors. ``admit`` is the proofs' ``keep_patches``."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._kept = 0
        self._lock = threading.Lock()

    def admit(self, nbytes: int) -> bool:
        with self._lock:
            if self._kept + nbytes > self._limit():
                return False
            self._kept += nbytes
            return True

    def reset(self) -> None:
        """A write began: what earlier proofs kept is dropped with them."""
        with self._lock:
            self._kept = 0


def check_base(
    weights: HeldWeights,
    entries: Sequence[TensorEntry],
    parent_state_hash: str | None,
    held_state: Callable[[], str],
    where: str,
) -> None:
    """Catch a delta for another base before decoding it: the held weights' state hash
    (``held_state()``) must be the delta's parent state hash where it names one, and
    every tensor the delta leaves unchanged must hold its manifest hash (a tensor not
    held as its entry says is left to the decode, which names it)."""
    if parent_state_hash:
        held = held_state()
        if held != parent_state_hash:
            raise MismatchError(
                f"{where}: the held weights (state hash {held}) are not the delta's base "
                f"(state hash {parent_state_hash})"
            )
    specs = weights.specs()
    touched = {weights.canonical(e.name) for e in entries if e.changed > 0}
    for entry in entries:
        if specs.get(entry.name) != spec_of(entry) or weights.canonical(entry.name) in touched:
            continue
        if weights.held_hash(entry.name) != entry.hash:
            raise MismatchError(
                f"{where}: tensor {entry.name!r} is unchanged by the delta but its held "
                "content does not match the manifest (wrong base)"
            )


def prove_and_write(
    weights: HeldWeights,
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    verify: VerifyMode,
    algorithm: HashAlgorithm,
    early: Mapping[str, EarlyResult],
    patch_memory_bytes: int,
) -> Written:
    """Prove a delta's changed tensors against the held ``weights`` and write them all,
    or none. ``entries`` are all of the delta manifest's tensor entries, ``objects``
    its delta objects (sizes and sha256 checked by the caller), ``algorithm`` the
    manifest's content hash, ``early`` the early results that hold for it (see
    :func:`early_results`). Unless ``verify`` is "none", each tensor's hash after its
    patch is proven before any write; "all" also rehashes the written tensors after
    the write (a mismatch takes it back). A delta whose patches would take more than
    ``patch_memory_bytes`` keeps none for the tensors the compiled walk reads: they
    are proven, then decoded again straight into the weights (without a proof,
    nothing is walked). Any failure leaves the weights as they were."""
    keep = verify == "none" or patches_bytes(entries) <= patch_memory_bytes
    specs = weights.specs()
    proven: ProvenPatches
    if any(e.pieces for e in entries):
        # A sharded run: each piece decoded against its flat slice into a whole-tensor
        # patch, proven whole (held hash plus every piece's change); no early proofs.
        early = {}
        held_hash = None if verify == "none" else weights.held_hash
        proven = prove_pieced(
            entries,
            objects,
            weights.tensor,
            specs,
            held_hash,
            algorithm,
            keep_patches=keep,
        )
    elif verify == "none":
        early = {}
        patches = decode_entries(entries, objects, weights.tensor, specs)
        proven = ProvenPatches(patches, {}, saved_old_values(patches, weights.tensor))
    elif algorithm.incremental:
        # O(changed): held hashes plus the changes; old contents read at the changed
        # positions only.
        proven = prove_incremental(
            entries,
            objects,
            weights.tensor,
            specs,
            weights.held_hash,
            algorithm,
            early,
            keep_patches=keep,
        )
    else:
        # Each tensor decoded and hashed in one pass against its held copy.
        proven = prove_entries(entries, objects, weights.tensor, specs, early, keep_patches=keep)
    # A tied weight carried under both names decodes twice: written once.
    patches_by: dict[str, TensorPatch] = {}
    walks_by: dict[str, list[Walk]] = {}  # a sharded run's tensor: one walk per piece
    for patch in proven.patches:
        patches_by.setdefault(weights.canonical(patch.name), patch)
    for walk in proven.walks:
        canonical = weights.canonical(walk.name)
        if canonical in patches_by:
            continue
        mine = walks_by.setdefault(canonical, [])
        if not mine or mine[0].name == walk.name:
            mine.append(walk)
    patches = list(patches_by.values())
    walks = {each[0].name: each for each in walks_by.values()}
    recheck = {e.name: e.hash for e in entries} if verify == "all" else None
    # The written positions are read back where the hash is not recomputed in full.
    confirm = algorithm.incremental and verify != "none"
    with weights.writing([*(p.name for p in patches), *walks]):
        applied = apply_verified(
            patches,
            weights.tensor,
            recheck,
            proven.old_values,
            full=algorithm.full,
            read_back=confirm,
        )
        try:
            walked = apply_walks(
                [w for each in walks.values() for w in each],
                weights.tensor,
                recheck,
                full=algorithm.full,
                confirm=confirm,
            )
        except BaseException:
            applied.rollback()
            raise
    return Written(applied, walked, walks, proven.hashes, len(early))


def prove_entries(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    early: Mapping[str, EarlyResult] | None = None,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """Decode every changed tensor of a delta and prove its hash after the patch (the
    checks and errors of ``decode_entries`` and ``hash_patched``), with the held
    contents at its positions; nothing is written. ``entries`` are all of a delta
    manifest's tensor entries (the caller checked its objects). Tensors are proven
    on ``PROVE_THREADS`` threads (the compiled walk, copies and hashes release the
    GIL); the first tensor at fault, in manifest order, is the one reported.
    ``early`` holds results already computed for some tensors (see
    :func:`early_results`); they are checked like the others, not recomputed.

    Without ``keep_patches``, tensors proven in one pass (CPU, the common encodings)
    keep only their hash and come back as ``walks``: memory then stays at one
    tensor's patch per thread instead of growing with every change of the version."""
    early = early or {}
    changes = list(changed_entries(entries, objects, base, specs))
    results = _on_provers(
        lambda c: _prove_one(*c, base, early, keep_patches), changes, lambda c: c[0].changed
    )
    proven = ProvenPatches([], {}, {})
    for done, digest, old in results:
        proven.hashes[done.name] = digest
        if isinstance(done, Walk):
            proven.walks.append(done)
            continue
        proven.patches.append(done)
        if old is not None:
            proven.old_values[done.name] = old
    return proven


# Proving is one pass over each touched tensor, about half of it compiled walking and
# half memory copy and hashing; tensors are independent, so a node with idle cores
# proves several at once (2 threads on 2 idle cores: 1.7x faster). Half the cores, as
# for encoding: two replicas of 2 threads each on 2 cores were 1.3x slower than 1.
PROVE_THREADS = max(1, min(4, cpus.available() // 2))
_prove_pool: ThreadPoolExecutor | None = None


def _provers() -> ThreadPoolExecutor:
    global _prove_pool
    if _prove_pool is None:
        _prove_pool = ThreadPoolExecutor(PROVE_THREADS, thread_name_prefix="deltasync-prove")
    return _prove_pool


Change = tuple[TensorEntry, DeltaObject, torch.Tensor, TensorSpec]


_W = TypeVar("_W")


def _on_provers(prove: Callable[[_W], _R], work: list[_W], weight: Callable[[_W], int]) -> list[_R]:
    """``prove(w)`` for every ``w`` of ``work``, on PROVE_THREADS threads where there
    are several (the walk, gathers and hash updates release the GIL), the heaviest
    first: an embedding or a head left for last would keep one thread busy while the
    others idle. Results come in the order given, so the first tensor at fault in
    manifest order is the one raised; none still reads the weights when this returns
    or raises."""
    if PROVE_THREADS <= 1 or len(work) <= 1:
        return [prove(w) for w in work]
    pool = _provers()
    order = sorted(range(len(work)), key=lambda i: -weight(work[i]))
    futures = {i: pool.submit(prove, work[i]) for i in order}
    try:
        return [futures[i].result() for i in range(len(work))]
    except BaseException:
        for future in futures.values():
            future.cancel()
        wait(futures.values())
        raise


def _prove_one(
    entry: TensorEntry,
    delta: DeltaObject,
    held: torch.Tensor,
    spec: TensorSpec,
    base: Callable[[str], torch.Tensor],
    early: Mapping[str, EarlyResult],
    keep_patch: bool = True,
) -> tuple[TensorPatch | Walk, str, torch.Tensor | None]:
    """(patch, content hash after it, held contents at its positions) of one tensor,
    checked against its manifest entry, or (walk, hash, None) where the patch is not
    kept; nothing is written."""
    found = early.get(entry.name)
    if isinstance(found, ProvenDigest):
        return _early_walk(entry, delta, found), found.digest, None
    hashed = found if found is not None else guarded(delta.decode_hashed, entry, held)
    if hashed is not None and held.device.type != "cpu":
        hashed = _to_device(hashed, held.device)
    if hashed is None:
        patch = guarded(delta.decode, entry, held)
        check_patch(patch, entry, spec)
        digest = hash_patched([patch], base, {entry.name: entry.hash})[entry.name]
        return patch, digest, saved_old_values([patch], base)[entry.name]
    check_patch(hashed.patch, entry, spec)
    _check_digest(entry, hashed.digest)
    if found is None and not keep_patch and held.device.type == "cpu":
        # Proven just now and walkable again in the write: its patch can go.
        return Walk(entry.name, delta, entry.changed), hashed.digest, None
    return hashed.patch, hashed.digest, hashed.old


def _early_walk(entry: TensorEntry, delta: DeltaObject, found: ProvenDigest) -> Walk:
    """The walk of a tensor whose early proof kept only its hash, checked against the
    manifest's entry."""
    if found.changed != entry.changed:
        raise MismatchError(
            f"tensor {entry.name}: early proof changes {found.changed} elements, "
            f"manifest says {entry.changed}"
        )
    _check_digest(entry, found.digest)
    return Walk(entry.name, delta, entry.changed)


def prove_incremental(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    held_hash: Callable[[str], str],
    algorithm: HashAlgorithm,
    early: Mapping[str, EarlyResult] | None = None,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """:func:`prove_entries` for an incremental content hash: each touched tensor's
    hash after its patch is the held hash (``held_hash(name)``, proven when the
    tensor was last hashed in full) plus the changes, with the old contents read at
    the changed positions only. Nothing else of the weights is read; nothing is
    written. The patches live on their tensors' devices, as do the hash updates.
    ``early`` results (from :func:`prove_object`) are checked, not redone.

    Without ``keep_patches``, CPU tensors whose delta the compiled walk reads keep
    only their hash and come back as ``walks`` (written by walking the delta again),
    as for :func:`prove_entries`."""
    found = early or {}

    def one(
        entry: TensorEntry,
        delta: DeltaObject,
        held: torch.Tensor,
        spec: TensorSpec,
        batched: Proven | None = None,
    ) -> TensorPatch | Walk:
        done = found.get(entry.name)
        if isinstance(done, ProvenDigest):
            return _early_walk(entry, delta, done)
        if isinstance(batched, CorruptObjectError):
            raise batched
        hashed = done or batched or _incremental_one(entry, delta, held, held_hash, algorithm)
        check_patch(hashed.patch, entry, spec)
        _check_digest(entry, hashed.digest)
        # The walk's own encodings only: a walked write is undone by walking back. The
        # patch goes here, on the proving thread, so that patches do not pile up.
        if done is None and not keep_patches and delta.walks(entry.name, held):
            return Walk(entry.name, delta, entry.changed)
        olds[entry.name] = hashed.old
        return hashed.patch

    def unit(work: list[Change]) -> list[TensorPatch | Walk]:
        if len(work) == 1 and not _batched(work[0][:3], found):
            return [one(*work[0])]
        proven = _incremental_batch([c[:3] for c in work], held_hash, algorithm)
        return [one(*change, proven.get(change[0].name)) for change in work]

    olds: dict[str, torch.Tensor] = {}  # each thread sets its own tensors' entries
    changes = list(changed_entries(entries, objects, base, specs))
    units = _units(changes, found)
    results: dict[str, TensorPatch | Walk] = {}
    for work, outcome in zip(
        units,
        _on_provers(unit, units, lambda work: sum(c[0].changed for c in work)),
        strict=True,
    ):
        results.update((change[0].name, d) for change, d in zip(work, outcome, strict=True))
    proven = ProvenPatches([], {}, {})
    for entry, _, _, _ in changes:
        proven.hashes[entry.name] = entry.hash  # checked against it above
        done = results[entry.name]
        if isinstance(done, Walk):
            proven.walks.append(done)
        else:
            proven.patches.append(done)
            proven.old_values[entry.name] = olds[entry.name]
    return proven


# Tensors with at most this many changes are proven in batches, one compiled walk and
# one hash update for many (DeltaObject.gathered_many): below it the Python around a
# tensor's walk costs more than the walk (about 0.1 ms a tensor; MoE layers hold
# hundreds of small experts). A batch holds up to BATCH_CHANGES changes (3 MB of
# patches for bf16), so that proving threads share a version's batches and, without
# ``keep_patches``, each batch's patches go before the next is decoded.
SMALL_CHANGES = 1 << 16
BATCH_CHANGES = 1 << 18

Proven = HashedPatch | CorruptObjectError
Held = tuple[TensorEntry, DeltaObject, torch.Tensor]  # an entry, its object, the held tensor
_C = TypeVar("_C", Change, Held)


def _batched(change: Held, early: Mapping[str, EarlyResult]) -> bool:
    """Whether a tensor is proven in a batch: few changes, on CPU, no early result."""
    entry, _, held = change
    return entry.changed <= SMALL_CHANGES and held.is_cpu and entry.name not in early


def _units(changes: Sequence[_C], early: Mapping[str, EarlyResult]) -> list[list[_C]]:
    """``changes`` as units of proving work: batches of small tensors of one object (in
    the order of their first tensor), and each other tensor alone."""
    units: list[list[_C]] = []
    open_batch: dict[int, tuple[list[_C], int]] = {}  # per object: its batch, its changes
    for change in changes:
        entry, delta, held = change[0], change[1], change[2]
        if not _batched((entry, delta, held), early):
            units.append([change])
            continue
        batch, size = open_batch.get(id(delta), (None, 0))
        if batch is None or size + entry.changed > BATCH_CHANGES:
            batch, size = [], 0
            units.append(batch)
        batch.append(change)
        open_batch[id(delta)] = (batch, size + entry.changed)
    return units


def _incremental_batch(
    batch: Sequence[Held], held_hash: Callable[[str], str], algorithm: HashAlgorithm
) -> dict[str, Proven]:
    """What :func:`_incremental_one` gives for each tensor of one batch (all of one
    object), with one walk and one hash update per element width; the error of a
    tensor whose streams are damaged is returned, not raised, so that the caller
    reports faults in its own order. Tensors the walk leaves out are not in it."""
    delta = batch[0][1]
    held = {entry.name: tensor for entry, _, tensor in batch}
    gathered, errors = delta.gathered_many(list(held.items()))
    out: dict[str, Proven] = dict(errors)
    for group in gathered:
        if not group.names:
            continue
        width = held[group.names[0]].element_size()
        digests = algorithm.updated_many(
            [held_hash(name) for name in group.names],
            group.positions,
            group.old,
            group.new,
            group.bounds,
            width,
        )
        for k, name in enumerate(group.names):
            at, new, old = group.tensors(k)
            tensor = held[name]
            patch = TensorPatch(name, tensor.dtype, tuple(tensor.shape), at, new)
            out[name] = HashedPatch(patch, old, digests[k])
    return out


def _incremental_one(
    entry: TensorEntry,
    delta: DeltaObject,
    held: torch.Tensor,
    held_hash: Callable[[str], str],
    algorithm: HashAlgorithm,
) -> HashedPatch:
    """One tensor's patch (on its device), old contents at its positions and hash
    after it: the held hash plus the changes."""
    at, old, new, digest = _changes(
        entry, delta, held, held, None, held_hash(entry.name), algorithm, f"tensor {entry.name}"
    )
    patch = TensorPatch(entry.name, held.dtype, tuple(held.shape), at, new)
    return HashedPatch(patch, old, digest or "")


def _changes(
    entry: TensorEntry,
    delta: DeltaObject,
    held: torch.Tensor,
    part: torch.Tensor,
    region: Region | None,
    digest: str | None,
    algorithm: HashAlgorithm,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str | None]:
    """One record's changes to ``held``, decoded against ``part`` (``held`` itself, or
    the elements of a piece at ``region``): flat positions in ``held``, old and new
    contents there (on its device), and the hash ``digest`` updated by them (None:
    decoded without proving). ``where`` names the record in errors."""
    flat = int_view(held.detach()).view(-1)
    walked = found = None
    if digest is not None:
        walked = guarded(delta.gathered, entry, part)
        if walked is None:
            found = guarded(delta.differences, entry, part)
    if walked is not None:
        # One walk of the streams over the part, read at its changed elements only:
        # positions, new and old contents; then the hash update from them.
        at, new, old = walked
        at = at if region is None else region.positions(at)
    elif found is not None:
        # Positions and differences from the streams alone, then one pass over the
        # changed elements: old contents gathered, new ones formed, hash updated.
        try:
            digest, at, old, new = algorithm.gathered(
                digest or "", int_view(part).view(-1), *found, region
            )
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"{where}: {exc}") from None
        at = at.to(flat.device) if region is None else region.positions(at.to(flat.device))
        return at, old.to(flat.device), new.to(flat.device), digest
    else:
        # Level 3's chunked positions depend on the base: decoded against it.
        patch = guarded(delta.decode, entry, part)
        at = patch.positions.to(flat.device)
        if at.numel() and (int(at[0]) < 0 or int(at[-1]) >= part.numel()):
            raise CorruptObjectError(f"{where}: decoded position out of range")
        at = at if region is None else region.positions(at)
        old = flat.index_select(0, at)
        new = patch.values.to(flat.device)
    if digest is not None:
        digest = algorithm.updated(digest, at, old, new, held.element_size())
    return at, old, new, digest


def prove_pieced(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    held_hash: Callable[[str], str] | None,
    algorithm: HashAlgorithm,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """Whole-tensor patches of a sharded run's delta (see :mod:`pipeline.targets.pieced`),
    proven against the manifest (with ``held_hash``: the hash each held tensor is
    known by; None decodes without proving), with the old contents at their
    positions; nothing is written. The caller checked the objects' sizes and sha256.
    ``base(name)`` is the held tensor (contiguous). A record of the wrong size or
    count, a patch out of range or a hash that does not come out is a one-line
    MismatchError / CorruptObjectError.

    Each piece's record decodes against the held tensor's elements of its region (a
    flat slice, or a box); its positions, placed by the region, are a patch of the
    whole tensor, and the tensor's patch is the union of its pieces' (boxes' sorted
    into flat order). The held hash plus every piece's change (mixsum is additive
    over flat positions) must be the entry's hash. Without ``keep_patches``, a
    proven CPU tensor whose pieces are all flat runs the compiled walk reads keeps
    only its hash: it comes back as one walk per piece (``ProvenPatches.walks``)."""
    if held_hash is not None and not algorithm.incremental:
        raise ConfigError(f"content hash {algorithm.name} cannot prove a tensor stored in pieces")
    parsed, changed = changed_records(entries, objects, specs)
    proven = ProvenPatches([], {}, {})
    for entry, pieces in changed:
        held = base(entry.name)
        if not held.is_contiguous():
            raise MismatchError(f"tensor {entry.name}: held copy is not contiguous")
        bits = int_view(held.detach()).dtype
        digest = held_hash(entry.name) if held_hash is not None else None
        where: list[torch.Tensor] = []
        olds: list[torch.Tensor] = []
        news: list[torch.Tensor] = []
        for piece in pieces:
            region = entry.region(piece)
            part = region.take(held.detach()) if entry.pieces else held
            at, old, new, digest = _changes(
                entry,
                parsed[piece.object],
                held,
                part,
                region,
                digest,
                algorithm,
                record_place(entry, piece),
            )
            where.append(at)
            olds.append(old)
            news.append(new.view(bits))
        at, new_all, old_all = torch.cat(where), torch.cat(news), torch.cat(olds)
        if any(p.is_box for p in pieces):
            # Boxes interleave in flat order: their disjoint positions sorted into one patch.
            order = torch.argsort(at)
            at, new_all, old_all = at[order], new_all[order], old_all[order]
        whole = TensorPatch(entry.name, held.dtype, tuple(held.shape), at, new_all)
        check_patch(whole, entry, specs[entry.name])
        if digest is not None:
            _check_digest(entry, digest)
            proven.hashes[entry.name] = digest
            walks = None if keep_patches else _piece_walks(entry, pieces, parsed, held)
            if walks is not None:  # proven; its patch is not kept
                proven.walks.extend(walks)
                continue
        proven.patches.append(whole)
        proven.old_values[entry.name] = old_all
    return proven


def _piece_walks(
    entry: TensorEntry,
    pieces: Sequence[Piece],
    parsed: Mapping[str, DeltaObject],
    held: torch.Tensor,
) -> list[Walk] | None:
    """One walk per piece of ``entry`` if every piece can be written by walking its
    record into a view of the held tensor (CPU, flat runs, the walk's encodings), else
    None (its patch is kept)."""
    walks = []
    for piece in pieces:
        region = entry.region(piece)
        if not region.is_contiguous:
            return None
        delta = parsed[piece.object]
        span = (region.start, region.stop) if entry.pieces else None
        walk = Walk(entry.name, delta, delta.info(entry.name).changed, span)
        if not delta.walks(entry.name, walk.target(held)):
            return None
        walks.append(walk)
    return walks


def _to_device(hashed: HashedPatch, device: torch.device) -> HashedPatch:
    """A host-decoded proof of a tensor held on ``device``: its patch moves there now,
    before the weights are locked for the write; the old contents stay on the host
    (read only by a rollback)."""
    patch = hashed.patch
    moved = replace(patch, positions=patch.positions.to(device), values=patch.values.to(device))
    return replace(hashed, patch=moved)


def _check_digest(entry: TensorEntry, digest: str) -> None:
    if digest != entry.hash:
        raise hash_mismatch(entry.name, digest, entry.hash)


def prove_object(
    key: str,
    data: bytes,
    sha256: str,
    generation: str,
    base: Callable[[str], torch.Tensor],
    algorithm: HashAlgorithm,
    held_hash: Callable[[str], str] | None = None,
    keep_patches: Callable[[int], bool] = lambda _: True,
) -> EarlyProof:
    """The early proof of object ``key`` (of sha256 ``sha256``, held weights at
    ``generation``): every changed tensor's patch, old contents and hash after it,
    against ``base(name)``; nothing is written. With an incremental ``algorithm`` and
    ``held_hash`` it is the held hash plus the changes (O(changed), see
    :func:`prove_incremental`), else the one-pass xxh3 proof, which leaves tensors the
    compiled walk does not handle to the proof with the manifest. Where
    ``keep_patches(bytes the object's patches would take)`` says no, only hashes are
    kept (:class:`ProvenDigest`: those tensors are walked in the write) for CPU
    tensors the walk reads; the others are left to the proof with the manifest."""
    incremental = algorithm.incremental and held_hash is not None
    if not incremental:
        algorithm = XXH3_ALGORITHM
    delta = parse_objects({key: data}, [key])[key]
    keep = keep_patches(sum(patch_bytes(i.changed, i.dtype) for i in delta.tensors))
    changes: list[Held] = []
    for info in delta.tensors:
        if info.changed == 0:
            continue
        held = base(info.name)
        if tuple(info.shape) != tuple(held.shape):
            continue  # a piece of a sharded run's tensor: proven with the manifest
        if not keep and not (delta.walks(info.name, held) if incremental else held.is_cpu):
            continue  # left to the proof with the manifest
        named = TensorEntry(
            name=info.name,
            dtype=dtype_name(info.dtype),
            shape=tuple(info.shape),
            hash="",  # not known before the manifest: checked against it later
            object=key,
            changed=info.changed,
        )
        changes.append((named, delta, held))
    counts = {named.name: named.changed for named, _, _ in changes}
    hashed: dict[str, HashedPatch | None] = {}
    if incremental:
        assert held_hash is not None
        for work in _units(changes, {}):
            batch = _incremental_batch(work, held_hash, algorithm) if len(work) > 1 else {}
            for named, _, held in work:
                found = batch.get(named.name)
                if isinstance(found, CorruptObjectError):
                    raise found
                if found is None:
                    found = _incremental_one(named, delta, held, held_hash, algorithm)
                hashed[named.name] = found
    else:
        for named, _, held in changes:
            hashed[named.name] = guarded(delta.decode_hashed, named, held)
    out: dict[str, EarlyResult] = {
        name: done if keep else ProvenDigest(done.digest, counts[name])
        for name, done in hashed.items()
        if done is not None
    }
    return EarlyProof(key, sha256, generation, out, algorithm.name)


def early_results(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, str],
    proofs: Sequence[EarlyProof],
    generation: str,
    content_hash: str = XXH3,
) -> dict[str, EarlyResult]:
    """The early results that hold for a delta manifest's tensor ``entries``: made at
    ``generation`` (no write since) with its content hash, from an object whose
    proofs may be used (``objects``: key -> sha256) with the same sha256, for a
    tensor the manifest places in that object."""
    valid = {
        p.key: p
        for p in proofs
        if p.generation == generation
        and objects.get(p.key) == p.sha256
        and p.content_hash == content_hash
    }
    out: dict[str, EarlyResult] = {}
    for entry in entries:
        proof = valid.get(entry.object)
        if proof is not None and entry.name in proof.hashed:
            out[entry.name] = proof.hashed[entry.name]
    return out
