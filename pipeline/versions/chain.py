"""The version chain of a run: list, resolve (both in :mod:`pipeline.versions.index`,
re-exported here) and reconstruct versions.

Everything here works from the store alone (the store is the truth). A
version V is rebuilt from the newest anchor at or below it plus the deltas
after that anchor, found by following parent links down from V. The rebuild
goes part by part (the run's fixed tensor->object partition), so memory is
bounded by one part, and every tensor's content hash is checked against V's
manifest before it is handed out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TypeVar

import structlog
import torch

from pipeline.codec import apply_patch, read_delta
from pipeline.codec.anchor import anchor_tensors
from pipeline.errors import ChainError, ConfigError, CorruptObjectError
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint, write_sharded
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.manifest import Manifest, Piece, TensorEntry, dtype_from_name, dtype_name
from pipeline.format.regions import Region
from pipeline.logs import Throttle
from pipeline.store.base import ObjectStore
from pipeline.versions.index import (
    ChainPlan,
    VersionIndex,
    deltas_after,
    fetch_object,
    follow_parents,
    list_versions,
    load_manifest,
    resolve,
    version_folders,
    with_manifest,
)

# Re-exported: callers that rebuild versions list and resolve them from here too.
__all__ = [
    "ChainPlan",
    "VersionIndex",
    "assemble",
    "deltas_after",
    "fetch_object",
    "follow_parents",
    "list_versions",
    "load_manifest",
    "reconstruct",
    "reconstruct_parts",
    "reconstruct_tensors",
    "resolve",
    "version_folders",
    "with_manifest",
]

log = structlog.get_logger(__name__)

Part = tuple[str, list[tuple[str, torch.Tensor]]]


def _check_same_tensors(plan: ChainPlan) -> None:
    """Every manifest of the chain must describe the same tensors (names, dtypes, shapes)."""
    target = {t.name: (t.dtype, t.shape) for t in plan.target.tensors}
    for m in plan.manifests:
        if m.content_hash != plan.target.content_hash:  # the first anchor fixes it
            raise ChainError(
                f"run {plan.run}: {m.kind} {m.version} hashes tensors with {m.content_hash}, "
                f"version {plan.version} with {plan.target.content_hash}"
            )
        mine = {t.name: (t.dtype, t.shape) for t in m.tensors}
        if mine != target:
            diff = sorted(set(mine.items()) ^ set(target.items()))
            raise ChainError(
                f"run {plan.run}: {m.kind} {m.version} and version {plan.version} "
                f"disagree about tensor {diff[0][0]!r}"
            )


def _load_anchor_tensors(
    store: ObjectStore, anchor: Manifest, names: list[str], entries: dict[str, TensorEntry]
) -> dict[str, torch.Tensor]:
    wanted = set(names)
    tensors: dict[str, torch.Tensor] = {}
    shapes = {t.name: (t.dtype, t.shape) for t in anchor.tensors}
    for okey in dict.fromkeys(entries[n].object for n in names):
        data = fetch_object(store, anchor, anchor.object_entry(okey))
        for name, tensor in anchor_tensors(data, anchor.object_key(okey), shapes):
            if name in wanted:
                tensors[name] = tensor
        del data
    for name in names:
        t = tensors.get(name)
        e = entries[name]
        if t is None:
            raise CorruptObjectError(f"object {anchor.object_key(e.object)} lacks tensor {name!r}")
        if dtype_name(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            raise CorruptObjectError(
                f"object {anchor.object_key(e.object)}: tensor {name!r} is "
                f"{t.dtype} {tuple(t.shape)}, its manifest says {e.dtype} {e.shape}"
            )
    return tensors


def _apply_delta(
    store: ObjectStore, delta: Manifest, names: list[str], tensors: dict[str, torch.Tensor]
) -> None:
    entries = {t.name: t for t in delta.tensors}
    # An unchanged tensor needs nothing from this delta; its hash is checked at the end.
    by_object: dict[str, list[str]] = {}
    for n in names:
        if entries[n].changed:
            by_object.setdefault(entries[n].object, []).append(n)
    for okey, members in by_object.items():
        key = delta.object_key(okey)
        obj = read_delta(fetch_object(store, delta, delta.object_entry(okey)), object_name=key)
        for n in members:
            apply_patch(tensors[n], obj.decode(n, tensors[n]))


def reconstruct_parts(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    plan: ChainPlan | None = None,
    verify_hashes: bool = True,
    only: Collection[str] | None = None,
) -> Iterator[Part]:
    """Version ``version`` part by part: (object key, [(name, tensor)]) in the target's
    partition and tensor order. Each part's hashes are checked before it is yielded. A
    long rebuild logs its progress (``logs.PROGRESS_EVERY_S``). In a pieced version
    (a sharded run) a part's tensors are its 1-D pieces (``Manifest.layout`` says which
    elements), each checked against its piece hash. ``only``: these part keys alone."""
    plan = plan or resolve(store, run, version)
    _check_same_tensors(plan)
    target = plan.target
    if _check_same_pieces(plan):
        yield from _reconstruct_pieced(store, plan, verify_hashes, only)
        return
    target_entries = {t.name: t for t in target.tensors}
    algorithm = content_hashes.of(target)
    anchor_entries = {t.name: t for t in plan.anchor.tensors}
    parts = [p for p in target.parts() if only is None or p[0] in only]
    progress = Throttle()
    for done, (part_key, names) in enumerate(parts):
        _progress(progress, run, version, done, len(parts))
        tensors = _load_anchor_tensors(store, plan.anchor, names, anchor_entries)
        for delta in plan.deltas:
            _apply_delta(store, delta, names, tensors)
        if verify_hashes:
            for n in names:
                if algorithm.full(tensors[n]) != target_entries[n].hash:
                    raise CorruptObjectError(
                        f"run {run} version {version}: tensor {n!r} does not match its "
                        "manifest hash after reconstruction"
                    )
        yield part_key, [(n, tensors.pop(n)) for n in names]


def _progress(progress: Throttle, run: str, version: int, done: int, parts: int) -> None:
    if progress.due():
        log.info(
            "rebuild progress",
            run=run,
            version=version,
            parts_done=done,
            parts=parts,
            seconds=round(progress.elapsed, 1),
        )


Placed = list[tuple[str, Region]]  # (tensor name, where its piece lies) held by one object


def _placement(manifest: Manifest) -> list[tuple[str, Placed]]:
    return [(key, [(e.name, e.region(p)) for e, p in held]) for key, held in manifest.layout()]


def _check_same_pieces(plan: ChainPlan) -> bool:
    """Whether the chain is pieced (a sharded run); then every manifest of it keeps
    the target's partition (same objects holding the same flat ranges): ChainError
    otherwise, as for a chain mixing pieced and whole versions."""
    pieced = [m.is_pieced for m in plan.manifests]
    if not any(pieced):
        return False
    want = _placement(plan.target)
    for m in plan.manifests:
        if not m.is_pieced or _placement(m) != want:
            raise ChainError(
                f"run {plan.run}: {m.kind} {m.version} does not keep the pieces of "
                f"version {plan.version} (objects and flat ranges)"
            )
    return True


def _reconstruct_pieced(
    store: ObjectStore, plan: ChainPlan, verify_hashes: bool, only: Collection[str] | None
) -> Iterator[Part]:
    target = plan.target
    algorithm = content_hashes.of(target)
    layouts = [dict(m.layout()) for m in plan.deltas]
    parts = [p for p in target.layout() if only is None or p[0] in only]
    progress = Throttle()
    for done, (part_key, held) in enumerate(parts):
        _progress(progress, plan.run, plan.version, done, len(parts))
        pieces = _load_anchor_pieces(store, plan.anchor, part_key, held)
        for delta, layout in zip(plan.deltas, layouts, strict=True):
            changed = [e.name for e, p in layout[part_key] if p.changed]
            if not changed:
                continue
            key = delta.object_key(part_key)
            data = fetch_object(store, delta, delta.object_entry(part_key))
            obj = read_delta(data, object_name=key)
            for name in changed:
                apply_patch(pieces[name], obj.decode(name, pieces[name]))
            del data, obj
        if verify_hashes:
            for entry, piece in held:
                if algorithm.piece(pieces[entry.name], entry.region(piece)) != piece.hash:
                    raise CorruptObjectError(
                        f"run {plan.run} version {plan.version}: {piece.describe()} of tensor "
                        f"{entry.name!r} in {part_key} do not match their piece hash after "
                        "reconstruction"
                    )
        yield part_key, [(e.name, pieces.pop(e.name)) for e, _ in held]


def _load_anchor_pieces(
    store: ObjectStore, anchor: Manifest, part_key: str, held: list[tuple[TensorEntry, Piece]]
) -> dict[str, torch.Tensor]:
    """The 1-D pieces one anchor object holds, checked against the manifest's ranges."""
    source = anchor.object_key(part_key)
    shapes = {e.name: (e.dtype, (p.numel,)) for e, p in held}
    data = fetch_object(store, anchor, anchor.object_entry(part_key))
    pieces = dict(anchor_tensors(data, source, shapes))
    for entry, _ in held:
        if entry.name not in pieces:
            raise CorruptObjectError(f"object {source} lacks its piece of tensor {entry.name!r}")
    return pieces


def assemble(manifest: Manifest, parts: Iterable[Part]) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors of a pieced ``manifest`` from its ``parts`` (as
    :func:`reconstruct_parts` yields them), each handed out once its last piece is in:
    memory is the tensors being assembled, in whatever order their pieces complete."""
    layout = dict(manifest.layout())
    missing = {e.name: len(e.pieces) for e in manifest.tensors}
    building: dict[str, torch.Tensor] = {}
    for key, tensors in parts:
        for (entry, piece), (name, t) in zip(layout[key], tensors, strict=True):
            whole = building.get(name)
            if whole is None:
                whole = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
                building[name] = whole
            # Bytes, not values: NaN payloads and -0.0 stay as they are.
            entry.region(piece).put(mixsum.int_flat(whole), mixsum.int_flat(t))
            missing[name] -= 1
            if missing[name] == 0:
                yield name, building.pop(name)
    if building:
        raise ChainError(f"tensor {next(iter(building))!r} of {manifest.key} was left incomplete")


def reconstruct_tensors(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    plan: ChainPlan | None = None,
    verify_hashes: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Version ``version`` tensor by tensor (held one part at a time), hashes verified.
    A pieced version's tensors are assembled whole from their pieces (:func:`assemble`)."""
    plan = plan or resolve(store, run, version)
    parts = reconstruct_parts(store, run, version, plan=plan, verify_hashes=verify_hashes)
    if plan.target.is_pieced:
        yield from assemble(plan.target, parts)
        return
    for _, tensors in parts:
        yield from tensors


_T = TypeVar("_T")


def across_compaction(store: ObjectStore, run: str, version: int, read: Callable[[], _T]) -> _T:
    """``read()``, which rebuilds ``version`` from its chain; once more when it fails
    because a compaction anchored that chain meanwhile (its garbage collection may
    take the deltas, and the anchor, being read). With the same anchor before and
    after, the damage is real and the error stands."""
    anchor = list_versions(store, run).anchor_at_or_below(version)
    try:
        return read()
    except (ChainError, CorruptObjectError):
        if list_versions(store, run).anchor_at_or_below(version) == anchor:
            raise
        log.info("chain compacted while it was read, again", run=run, version=version)
        return read()


def reconstruct(
    store: ObjectStore,
    run: str,
    version: int,
    out_path: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    by_part: bool = False,
    overwrite: bool = False,
) -> Manifest:
    """Rebuild ``version`` into a checkpoint at ``out_path``, atomically and only if every
    tensor hash matches. ``by_part`` writes one file per store part (named like the
    objects, with an index); else one file, or HF shards of ``max_shard_bytes``."""
    plan = resolve(store, run, version)
    metadata = {"deltasync.run": run, "deltasync.version": str(version)}
    if by_part and plan.target.is_pieced:
        raise ConfigError(
            f"run {run} version {version} is stored in pieces: a file per part would hold "
            "pieces, not tensors; rebuild it whole"
        )
    if by_part:
        parts = reconstruct_parts(store, run, version, plan=plan)
        write_sharded(out_path, parts, metadata=metadata, overwrite=overwrite)
    else:
        tensors = reconstruct_tensors(store, run, version, plan=plan)
        write_checkpoint(
            out_path,
            tensors,
            max_shard_bytes=max_shard_bytes,
            metadata=metadata,
            overwrite=overwrite,
        )
    log.info("version reconstructed", run=run, version=version, out=str(out_path))
    return plan.target
