"""The version chain of a run: list, resolve, reconstruct, verify, plan GC.

Everything here works from the store alone (the store is the truth). A
version V is rebuilt from the newest anchor at or below it plus the deltas
after that anchor, found by following parent links down from V. The rebuild
goes part by part (the run's fixed tensor->object partition), so memory is
bounded by one part, and every tensor's content hash is checked against V's
manifest before it is handed out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pipeline import faults
from pipeline.checkpoint import CheckpointReader
from pipeline.checkpoint_write import write_checkpoint, write_sharded
from pipeline.codec import apply_patch, read_delta
from pipeline.codec.anchor import anchor_tensors
from pipeline.errors import (
    ChainError,
    CorruptObjectError,
    DeltasyncError,
    ObjectNotFoundError,
    StoreError,
)
from pipeline.hashing import content_hash, sha256_bytes
from pipeline.manifest import (
    KIND_FOLDERS,
    Kind,
    Manifest,
    ObjectEntry,
    TensorEntry,
    check_run,
    dtype_name,
    manifest_key,
    parse_manifest,
    version_prefix,
)
from pipeline.signing import verify_signature
from pipeline.store.base import ObjectStore

log = structlog.get_logger(__name__)

_MANIFEST_IN_FOLDER = re.compile(r"^(\d{10})/manifest\.json$")
_VERSION_FOLDER = re.compile(r"^(\d{10})/")

PublicKey = Ed25519PublicKey | bytes
Part = tuple[str, list[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class VersionIndex:
    """The versions of a run that exist (have a manifest), ascending."""

    run: str
    deltas: tuple[int, ...]
    anchors: tuple[int, ...]

    @property
    def head(self) -> int | None:
        return max((*self.deltas, *self.anchors), default=None)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.deltas) | set(self.anchors)))

    def anchor_at_or_below(self, version: int) -> int | None:
        return max((a for a in self.anchors if a <= version), default=None)


def _scan(store: ObjectStore, run: str, kind: Kind) -> dict[int, list[str]]:
    """Every key under ``<run>/<kind folder>/``, grouped by version folder."""
    prefix = f"{check_run(run)}/{KIND_FOLDERS[kind]}/"
    folders: dict[int, list[str]] = {}
    for key in store.list(prefix):
        m = _VERSION_FOLDER.match(key[len(prefix) :]) if key.startswith(prefix) else None
        if m is not None:
            folders.setdefault(int(m.group(1)), []).append(key)
    return folders


def _with_manifest(folders: dict[int, list[str]]) -> tuple[int, ...]:
    return tuple(
        sorted(
            v
            for v, keys in folders.items()
            if any(k.endswith(f"/{v:010d}/manifest.json") for k in keys)
        )
    )


def list_versions(store: ObjectStore, run: str) -> VersionIndex:
    return VersionIndex(
        run=run,
        deltas=_with_manifest(_scan(store, run, "delta")),
        anchors=_with_manifest(_scan(store, run, "anchor")),
    )


@dataclass(frozen=True)
class ChainPlan:
    """How to build ``version``: ``anchor`` then ``deltas`` in order (oldest first)."""

    run: str
    version: int
    anchor: Manifest
    deltas: tuple[Manifest, ...]

    @property
    def target(self) -> Manifest:
        """The manifest of ``version`` itself (its hashes are what a rebuild must match)."""
        return self.deltas[-1] if self.deltas else self.anchor

    @property
    def manifests(self) -> tuple[Manifest, ...]:
        return (self.anchor, *self.deltas)


def load_manifest(
    store: ObjectStore,
    run: str,
    kind: Kind,
    version: int,
    *,
    public_key: PublicKey | None = None,
) -> Manifest:
    """Fetch and validate one manifest (and its signature when a key is given)."""
    key = manifest_key(run, kind, version)
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"manifest {key} does not exist in {store.url}") from None
    manifest = parse_manifest(
        data, expected_run=run, expected_version=version, expected_kind=kind, source=key
    )
    if public_key is not None:
        verify_signature(manifest, public_key)
    return manifest


def resolve(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    index: VersionIndex | None = None,
    public_key: PublicKey | None = None,
) -> ChainPlan:
    """The newest anchor at or below ``version`` and the deltas after it, by parent links."""
    index = index or list_versions(store, run)
    anchors = set(index.anchors)
    deltas = set(index.deltas)
    if version in anchors:
        anchor = load_manifest(store, run, "anchor", version, public_key=public_key)
        return ChainPlan(run, version, anchor, ())
    if version not in deltas:
        raise ChainError(f"run {run} has no version {version} (head is {index.head})")
    chain: list[Manifest] = []
    current = version
    while True:
        try:
            m = load_manifest(store, run, "delta", current, public_key=public_key)
        except ObjectNotFoundError:
            raise ChainError(
                f"run {run}: version {version} needs delta {current}, which is missing"
            ) from None
        chain.append(m)
        parent = m.parent
        assert parent is not None  # parse_manifest guarantees deltas have parents
        if parent in anchors:
            try:
                anchor = load_manifest(store, run, "anchor", parent, public_key=public_key)
            except ObjectNotFoundError:
                raise ChainError(
                    f"run {run}: version {version} needs anchor {parent}, which is missing"
                ) from None
            break
        if parent not in deltas:
            raise ChainError(
                f"run {run}: version {version} needs version {parent} (parent of {current}), "
                "which is missing"
            )
        current = parent
    chain.reverse()
    plan = ChainPlan(run, version, anchor, tuple(chain))
    _check_links(plan)
    return plan


def _check_links(plan: ChainPlan) -> None:
    """Each delta must continue exactly the state its predecessor holds."""
    previous = plan.anchor
    for m in plan.deltas:
        if m.parent_state_hash is not None and m.parent_state_hash != previous.state_hash:
            raise ChainError(
                f"run {plan.run}: delta {m.version} was made against a different state of "
                f"version {previous.version}"
            )
        previous = m


def fetch_object(store: ObjectStore, manifest: Manifest, entry: ObjectEntry) -> bytes:
    """An object's bytes, checked against the manifest's size and sha256."""
    key = manifest.object_key(entry.key)
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        raise CorruptObjectError(f"object {key} is missing from {store.url}") from None
    if len(data) != entry.size:
        raise CorruptObjectError(
            f"object {key} is {len(data)} bytes, its manifest says {entry.size}"
        )
    if sha256_bytes(data) != entry.sha256:
        raise CorruptObjectError(f"object {key} does not match its sha256")
    return data


def _check_same_tensors(plan: ChainPlan) -> None:
    """Every manifest of the chain must describe the same tensors (names, dtypes, shapes)."""
    target = {t.name: (t.dtype, t.shape) for t in plan.target.tensors}
    for m in plan.manifests:
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
    for okey in dict.fromkeys(entries[n].object for n in names):
        data = fetch_object(store, anchor, anchor.object_entry(okey))
        for name, tensor in anchor_tensors(data, anchor.object_key(okey)):
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
) -> Iterator[Part]:
    """Version ``version`` part by part: (object key, [(name, tensor)]) in the target's
    partition and tensor order. Each part's hashes are checked before it is yielded."""
    plan = plan or resolve(store, run, version)
    _check_same_tensors(plan)
    target = plan.target
    target_entries = {t.name: t for t in target.tensors}
    anchor_entries = {t.name: t for t in plan.anchor.tensors}
    for part_key, names in target.parts():
        tensors = _load_anchor_tensors(store, plan.anchor, names, anchor_entries)
        for delta in plan.deltas:
            _apply_delta(store, delta, names, tensors)
        if verify_hashes:
            for n in names:
                if content_hash(tensors[n]) != target_entries[n].hash:
                    raise CorruptObjectError(
                        f"run {run} version {version}: tensor {n!r} does not match its "
                        "manifest hash after reconstruction"
                    )
        yield part_key, [(n, tensors.pop(n)) for n in names]


def reconstruct_tensors(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    plan: ChainPlan | None = None,
    verify_hashes: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Version ``version`` tensor by tensor (held one part at a time), hashes verified."""
    for _, tensors in reconstruct_parts(
        store, run, version, plan=plan, verify_hashes=verify_hashes
    ):
        yield from tensors


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
    parts = reconstruct_parts(store, run, version, plan=plan)
    if by_part:
        write_sharded(out_path, parts, metadata=metadata, overwrite=overwrite)
    else:
        tensors = (t for _, ts in parts for t in ts)
        write_checkpoint(
            out_path,
            tensors,
            max_shard_bytes=max_shard_bytes,
            metadata=metadata,
            overwrite=overwrite,
        )
    log.info("version reconstructed", run=run, version=version, out=str(out_path))
    return plan.target


# ---------------------------------------------------------------- verify


@dataclass(frozen=True)
class TensorDifference:
    name: str
    reason: str  # "content", "dtype", "shape", "missing", "extra", "manifest-hash"
    differing: int = 0  # elements that differ (content only)


@dataclass
class VerifyReport:
    run: str
    version: int
    tensors: int = 0  # tensors compared
    objects: int = 0  # objects whose size and sha256 were checked
    bad_objects: list[str] = field(default_factory=list)
    differences: list[TensorDifference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_objects and not self.differences

    def describe(self) -> str:
        head = f"run {self.run} version {self.version}"
        if self.bad_objects:
            return f"{head}: {len(self.bad_objects)} bad object(s): {self.bad_objects[0]}"
        if not self.differences:
            return f"{head}: bit-identical ({self.tensors} tensors, {self.objects} objects checked)"
        shown = ", ".join(
            f"{d.name} ({d.reason}" + (f", {d.differing} elements)" if d.differing else ")")
            for d in self.differences[:3]
        )
        more = f" and {len(self.differences) - 3} more" if len(self.differences) > 3 else ""
        return f"{head}: {len(self.differences)} tensor(s) differ: {shown}{more}"


_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same width (compare these, never floats)."""
    return tensor.contiguous().view(_BIT_VIEWS[tensor.element_size()])


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bit_view(a) != bit_view(b)).sum().item())


def verify(
    store: ObjectStore,
    run: str,
    version: int,
    against_checkpoint: str | os.PathLike[str],
) -> VerifyReport:
    """Compare a stored version bitwise with a checkpoint; also check every object."""
    plan = resolve(store, run, version)
    report = VerifyReport(run, version)
    for m in plan.manifests:
        for entry in m.objects:
            try:
                fetch_object(store, m, entry)
            except (CorruptObjectError, StoreError) as e:
                report.bad_objects.append(str(e))
            report.objects += 1
    if report.bad_objects:
        return report
    reader = CheckpointReader(Path(against_checkpoint))
    target = {t.name: t for t in plan.target.tensors}
    for name in target:
        if name not in reader:
            report.differences.append(TensorDifference(name, "missing"))
    for name in reader.names():
        if name not in target:
            report.differences.append(TensorDifference(name, "extra"))
    try:
        for name, tensor in reconstruct_tensors(
            store, run, version, plan=plan, verify_hashes=False
        ):
            report.tensors += 1
            if content_hash(tensor) != target[name].hash:
                report.differences.append(TensorDifference(name, "manifest-hash"))
            if name not in reader:
                continue
            theirs = reader.get(name)
            if theirs.dtype != tensor.dtype:
                report.differences.append(TensorDifference(name, "dtype"))
            elif tuple(theirs.shape) != tuple(tensor.shape):
                report.differences.append(TensorDifference(name, "shape"))
            else:
                n = count_differing(tensor, theirs)
                if n:
                    report.differences.append(TensorDifference(name, "content", n))
            del theirs
            reader.close()  # unmap: a checkpoint larger than RAM stays one tensor resident
    finally:
        reader.close()
    return report


# ---------------------------------------------------------------- garbage collection


def gc_plan(index: VersionIndex, keep_anchors: int, min_live_version: int | None) -> list[str]:
    """Manifest keys of the versions that may be deleted.

    Kept: the newest ``keep_anchors`` anchors (at least one), every delta after the
    newest anchor (the head's chain), and every delta after ``min_live_version`` (the
    oldest version a live replica holds) so that it can still reach the head.
    """
    head = index.head
    if head is None:
        return []
    newest_anchor = index.anchor_at_or_below(head)
    if newest_anchor is None:
        return []  # without an anchor every delta is part of the only chain
    kept_anchors = set(sorted(index.anchors)[-max(1, keep_anchors) :])
    cutoff = newest_anchor if min_live_version is None else min(newest_anchor, min_live_version)
    doomed = [manifest_key(index.run, "anchor", a) for a in index.anchors if a not in kept_anchors]
    doomed += [manifest_key(index.run, "delta", d) for d in index.deltas if d <= cutoff]
    return sorted(doomed)


def orphan_delta_folders(store: ObjectStore, run: str, below: int) -> list[str]:
    """Delta folders under ``below`` (the head) holding objects but no manifest: remains
    of a publish, or of a parallel diff's coordinator, that died. None can be published
    any more (publish refuses steps not newer than the head) and a diff in flight writes
    above the head. A helper of a dead fan-out may still upload into such a folder after
    it is collected; the next collection takes that object too."""
    folders = _scan(store, run, "delta")
    published = set(_with_manifest(folders))
    return [
        version_prefix(run, "delta", v) for v in sorted(folders) if v < below and v not in published
    ]


def orphan_anchor_folders(store: ObjectStore, run: str, below: int) -> list[str]:
    """Anchor folders under ``below`` holding objects but no manifest: remains of a
    compaction or a garbage collection that crashed. Only safe to collect while holding
    the run's compaction lock (no anchor is being written then)."""
    folders = _scan(store, run, "anchor")
    published = set(_with_manifest(folders))
    return [
        version_prefix(run, "anchor", v)
        for v in sorted(folders)
        if v < below and v not in published
    ]


def delete_versions(
    store: ObjectStore, manifest_keys: Iterable[str], folders: Iterable[str]
) -> list[str]:
    """Delete manifests first (so no half-version is ever visible), then the objects of
    their folders and of the orphan ``folders``; returns every deleted key."""
    deleted: list[str] = []
    keys = list(manifest_keys)
    for key in keys:
        store.delete(key)
        deleted.append(key)
    faults.point("gc.after_manifests")
    for prefix in [k.rsplit("/", 1)[0] + "/" for k in keys] + list(folders):
        for key in list(store.list(prefix)):
            try:
                store.delete(key)
            except DeltasyncError as e:
                log.warning("could not delete object", key=key, error=str(e))
                continue
            deleted.append(key)
    return deleted
