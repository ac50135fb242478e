"""Proving a delta before any write: every touched tensor's result is decoded and
hashed against the manifest while the held weights are only read.

``decode_and_prove`` is what targets call before they take their write lock; for
CPU tensors in the common encodings one chunked pass over each held tensor gives
the patch, the old contents (for undo) and the hash after it. ``prove_object``
does the same for one object before its manifest is known (early start), and
``early_patches`` picks the results a manifest confirms.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from pipeline import cpus
from pipeline.codec import DeltaObject, HashedPatch, TensorPatch
from pipeline.errors import CorruptObjectError, MismatchError
from pipeline.format.hashes.content_hashes import XXH3, HashAlgorithm
from pipeline.format.manifest import Manifest, TensorEntry, dtype_from_name, dtype_name
from pipeline.targets.base import EarlyProof, EarlyResult, ProvenDigest, TensorSpec
from pipeline.targets.patching import (
    changed_entries,
    check_objects,
    check_patch,
    decode_entry,
    guarded,
    hash_mismatch,
    hash_patched,
    int_view,
    parse_objects,
    saved_old_values,
)
from pipeline.targets.walking import Walk

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


@dataclass(frozen=True)
class ProvenPatches:
    """Patches whose results were checked against the manifest's hashes before any
    write, with the held contents at their positions (for undo); and, without
    ``keep_patches``, the proven tensors that keep no patch (``walks``)."""

    patches: list[TensorPatch]
    hashes: dict[str, str]  # new content hash per touched tensor
    old_values: dict[str, torch.Tensor]
    walks: list[Walk] = field(default_factory=list)


def decode_and_prove(
    manifest: Manifest,
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    early: Mapping[str, EarlyResult] | None = None,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """``decode_manifest``, ``hash_patched`` and ``saved_old_values`` in one go, with
    the same checks and errors, writing nothing. For CPU tensors in the common
    encodings one chunked pass over each held tensor does all three (the codec's
    ``decode_hashed``) instead of three passes, two of them scattered."""
    if manifest.kind != "delta":
        raise MismatchError(
            f"{manifest.run} v{manifest.version} is an {manifest.kind}, not a delta"
        )
    check_objects(manifest, objects)
    return prove_entries(manifest.tensors, objects, base, specs, early, keep_patches=keep_patches)


def prove_entries(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    early: Mapping[str, EarlyResult] | None = None,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """:func:`decode_and_prove` for callers that checked the objects themselves:
    ``entries`` are all of a delta manifest's tensor entries. Tensors are proven
    on ``PROVE_THREADS`` threads (the compiled walk, copies and hashes release the
    GIL); the first tensor at fault, in manifest order, is the one reported.
    ``early`` holds results already computed for some tensors (see
    :func:`early_patches`); they are checked like the others, not recomputed.

    Without ``keep_patches``, tensors proven in one pass (CPU, the common encodings)
    keep only their hash and come back as ``walks``: memory then stays at one
    tensor's patch per thread instead of growing with every change of the version."""
    early = early or {}
    changes = list(changed_entries(entries, objects, base, specs))

    def prove(
        entry: TensorEntry, delta: DeltaObject, held: torch.Tensor, spec: TensorSpec
    ) -> tuple[TensorPatch | Walk, str, torch.Tensor | None]:
        return _prove_one(entry, delta, held, spec, base, early, keep_patches)

    results = _prove_all(prove, changes)
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


def _prove_all(prove: Callable[..., _R], changes: list[Change]) -> list[_R]:
    """``prove(*change)`` for every change, on PROVE_THREADS threads where there are
    several (the walk, gathers and hash updates release the GIL), the tensors with
    the most changes first: an embedding or a head left for last would keep one
    thread busy while the others idle. Results come in the order given, so the first
    tensor at fault in manifest order is the one raised; none still reads the
    weights when this returns or raises."""
    return _on_provers(lambda change: prove(*change), changes, lambda c: c[0].changed)


_W = TypeVar("_W")


def _on_provers(prove: Callable[[_W], _R], work: list[_W], weight: Callable[[_W], int]) -> list[_R]:
    """``prove(w)`` for every ``w`` of ``work``, the heaviest first (see
    :func:`_prove_all`); results in the order given."""
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
    hashed = found
    if hashed is None:
        hashed = guarded(delta.decode_hashed, entry, held)
    if hashed is not None and held.device.type != "cpu":
        hashed = _to_device(hashed, held.device)
    if hashed is None:
        patch = decode_entry(delta, entry, held)
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
    ``early`` results (from :func:`prove_object_incremental`) are checked, not redone.

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
    walked = guarded(delta.gathered, entry, held)
    if walked is not None:
        # One walk of the streams over the held tensor, read at the changed positions
        # only: positions, new and old contents; then the hash update from them.
        at, new, old = walked
        digest = algorithm.updated(held_hash(entry.name), at, old, new, held.element_size())
        patch = TensorPatch(entry.name, held.dtype, tuple(held.shape), at, new)
        return HashedPatch(patch, old, digest)
    flat = int_view(held.detach()).reshape(-1)
    found = guarded(delta.differences, entry, held)
    if found is not None:
        # Positions and differences from the streams alone, then one pass over the
        # changed positions: old contents gathered, new ones formed, hash updated.
        try:
            digest, where, old, new = algorithm.gathered(held_hash(entry.name), flat, *found)
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"tensor {entry.name}: {exc}") from None
        patch = TensorPatch(entry.name, held.dtype, tuple(held.shape), where, new)
        return HashedPatch(patch, old, digest)
    # Level 3's chunked positions depend on the base: decoded against it.
    patch = decode_entry(delta, entry, held)
    positions = patch.positions.to(flat.device)
    if positions.numel() and (int(positions[0]) < 0 or int(positions[-1]) >= flat.numel()):
        raise CorruptObjectError(f"tensor {entry.name}: decoded position out of range")
    old = flat.index_select(0, positions)
    new = patch.values.to(flat.device)
    digest = algorithm.updated(held_hash(entry.name), positions, old, new, held.element_size())
    moved = replace(patch, positions=positions, values=new)
    return HashedPatch(moved, old, digest)


def prove_object_incremental(
    key: str,
    data: bytes,
    base: Callable[[str], torch.Tensor],
    held_hash: Callable[[str], str],
    algorithm: HashAlgorithm,
    keep_patches: Callable[[int], bool] = lambda _: True,
) -> dict[str, EarlyResult]:
    """:func:`prove_object` for an incremental content hash (see
    :func:`prove_incremental`): every changed tensor of one object, O(changed). Where
    ``keep_patches(bytes the object's patches would take)`` says no, CPU tensors the
    compiled walk reads keep only their hash (:class:`ProvenDigest`: walked in the
    write); the others are left to the proof with the manifest."""
    delta = parse_objects({key: data}, [key])[key]
    keep = keep_patches(sum(patch_bytes(i.changed, i.dtype) for i in delta.tensors))
    changes: list[Held] = []
    for info in delta.tensors:
        held = base(info.name)
        if info.changed == 0 or _a_piece(info.shape, held):
            continue
        if not keep and not delta.walks(info.name, held):
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
    out: dict[str, EarlyResult] = {}
    for work in _units(changes, {}):
        proven = _incremental_batch(work, held_hash, algorithm) if len(work) > 1 else {}
        for named, _, held in work:
            hashed = proven.get(named.name)
            if isinstance(hashed, CorruptObjectError):
                raise hashed
            if hashed is None:
                hashed = _incremental_one(named, delta, held, held_hash, algorithm)
            out[named.name] = hashed if keep else ProvenDigest(hashed.digest, named.changed)
    return out


def _a_piece(shape: tuple[int, ...], held: torch.Tensor) -> bool:
    """Whether a record is a piece of the held tensor (a sharded run's): it decodes
    against a flat slice the manifest names, so it is proven with the manifest."""
    return tuple(shape) != tuple(held.shape)


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
    base: Callable[[str], torch.Tensor],
    keep_patches: Callable[[int], bool] = lambda _: True,
) -> dict[str, EarlyResult]:
    """The one-pass proof (patch, old contents, hash after it) of every changed
    tensor of one delta object, against ``base(name)``; nothing is written. Tensors
    the compiled walk does not handle are left to the full proof. Where
    ``keep_patches(bytes the object's patches would take)`` says no, only the hashes
    of CPU tensors are kept (:class:`ProvenDigest`: they are walked in the write);
    other devices' tensors are then left to the full proof too."""
    delta = parse_objects({key: data}, [key])[key]
    keep = keep_patches(sum(patch_bytes(i.changed, i.dtype) for i in delta.tensors))
    out: dict[str, EarlyResult] = {}
    for info in delta.tensors:
        if info.changed == 0:
            continue
        held = base(info.name)
        if (not keep and held.device.type != "cpu") or _a_piece(info.shape, held):
            continue
        named = TensorEntry(
            name=info.name,
            dtype=dtype_name(info.dtype),
            shape=tuple(info.shape),
            hash="",  # not known before the manifest: checked against it later
            object=key,
            changed=info.changed,
        )
        hashed = guarded(delta.decode_hashed, named, held)
        if hashed is not None:
            out[info.name] = hashed if keep else ProvenDigest(hashed.digest, info.changed)
    return out


def early_patches(
    manifest: Manifest, proofs: Sequence[EarlyProof], generation: str
) -> dict[str, EarlyResult]:
    """The early results that hold for ``manifest``: made at ``generation`` (no write
    since) with the manifest's content hash, from an object the manifest lists with
    the same sha256, for a tensor the manifest places in that object."""
    objects = {o.key: o.sha256 for o in manifest.objects}
    return early_results(manifest.tensors, objects, proofs, generation, manifest.content_hash)


def early_results(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, str],
    proofs: Sequence[EarlyProof],
    generation: str,
    content_hash: str = XXH3,
) -> dict[str, EarlyResult]:
    """:func:`early_patches` from a manifest's tensor ``entries`` and the sha256 of
    the objects whose proofs may be used (``objects``: key -> sha256)."""
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
