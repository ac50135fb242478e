"""Repair: check every object of a run, name the damage, and make the run reachable
again from a proven source.

``check_run`` loads every manifest (its signature checked where the store is trusted
with a key) and fetches every object it names (size, sha256). A version is damaged
when its manifest or one of its objects is. The head is reachable when the walk from
it down the parent links meets a sound anchor through sound deltas; ``broken_at`` is
the first damaged version that walk meets (the highest one the head depends on).

``repair`` then publishes an anchor at a version at or above ``broken_at``, from a
source proven against that version's manifest: a checkpoint the operator gives, or the
diff worker's state cache. Either is checked tensor by tensor against the manifest's
hashes by the anchor writer itself (``publish_anchor`` with ``expected``), so nothing
unproven is ever published. Only then are the damaged versions taken out of the
store (manifest first, then their objects), so no node, compaction or rebuild reads
them again: a node holding an older version finds no delta chain to the head and
bootstraps from the new anchor, a new node starts from it.

Compaction uses the same logic (``skip_to_proven``) when its chain is damaged: it
anchors the cache's later, proven version instead of failing. Callers hold the run's
compaction lock (no anchor written or collected meanwhile).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from pipeline.errors import (
    ChainError,
    ConfigError,
    DeltasyncError,
    MismatchError,
    ObjectNotFoundError,
    StoreError,
)
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.digests import state_hash
from pipeline.format.manifest import Kind, Manifest, manifest_key
from pipeline.publish.caches.state_cache import StateCache, flock
from pipeline.publish.version import DEFAULT_OPTIONS, PublishOptions, publish_anchor
from pipeline.store.base import ObjectStore
from pipeline.store.trust import signer_store
from pipeline.versions import retention
from pipeline.versions.index import VersionIndex, fetch_object, list_versions, load_manifest

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Damage:
    kind: Kind
    version: int
    what: str  # one line: the manifest's or an object's fault

    def describe(self) -> str:
        return f"{self.kind} {self.version}: {self.what}"


@dataclass
class RunCheck:
    """What ``check_run`` found."""

    run: str
    index: VersionIndex
    manifests: dict[tuple[Kind, int], Manifest] = field(default_factory=dict)  # readable ones
    damage: list[Damage] = field(default_factory=list)
    objects: int = 0  # objects fetched and checked
    broken_at: int | None = None  # the first damaged version the head depends on

    @property
    def damaged(self) -> set[tuple[Kind, int]]:
        return {(d.kind, d.version) for d in self.damage}

    @property
    def healthy(self) -> bool:
        return not self.damage and self.broken_at is None

    def describe(self) -> str:
        """One line: what was checked and the damage, if any."""
        head = f"run {self.run}: {len(self.index.versions)} versions, {self.objects} objects"
        if self.healthy:
            return f"{head} checked, no damage (head {self.index.head} reachable)"
        shown = "; ".join(d.describe() for d in self.damage[:3])
        more = f" and {len(self.damage) - 3} more" if len(self.damage) > 3 else ""
        reach = (
            f"the head {self.index.head} is unreachable from v{self.broken_at} down"
            if self.broken_at is not None
            else f"the head {self.index.head} is still reachable"
        )
        return f"{head} checked: {len(self.damage)} damaged ({shown}{more}); {reach}"


@dataclass(frozen=True)
class RepairResult:
    check: RunCheck
    anchor: Manifest | None  # the anchor published, if one was needed
    source: str  # where its tensors came from ("" without an anchor)
    removed: tuple[str, ...]  # damaged versions taken out, "kind version"

    def describe(self) -> str:
        parts = [self.check.describe()]
        if self.anchor is not None:
            parts.append(f"published anchor {self.anchor.version} from {self.source}")
        if self.removed:
            parts.append(f"removed damaged {', '.join(self.removed)}")
        if self.anchor is None and not self.removed:
            parts.append("nothing to repair")
        return "; ".join(parts)


def check_run(store: ObjectStore, run: str, *, index: VersionIndex | None = None) -> RunCheck:
    """Load every manifest of ``run`` and check every object it names."""
    index = index or list_versions(store, run)
    check = RunCheck(run, index)
    for kind, versions in (("anchor", index.anchors), ("delta", index.deltas)):
        for version in versions:
            key: tuple[Kind, int] = (kind, version)  # type: ignore[assignment]
            try:
                manifest = load_manifest(store, run, key[0], version)
            except ObjectNotFoundError:
                continue  # gone since the listing
            except DeltasyncError as exc:
                _unless_transient(exc)
                check.damage.append(Damage(key[0], version, f"manifest: {_line(exc)}"))
                continue
            check.manifests[key] = manifest
            for entry in manifest.objects:
                check.objects += 1
                try:
                    fetch_object(store, manifest, entry)
                except DeltasyncError as exc:
                    _unless_transient(exc)
                    check.damage.append(Damage(key[0], version, _line(exc)))
                    break  # one named fault per version is enough to set it aside
    check.broken_at = _broken_at(check)
    return check


def _unless_transient(exc: DeltasyncError) -> None:
    """A store that fails to answer says nothing about the bytes: never call that damage."""
    if isinstance(exc, StoreError):
        raise exc


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _sound(check: RunCheck, kind: Kind, version: int) -> bool:
    return (kind, version) in check.manifests and (kind, version) not in check.damaged


def _broken_at(check: RunCheck) -> int | None:
    """Walk from the head down the parent links as a rebuild will once the damaged
    manifests are gone: a sound anchor ends it (reachable, None); a sound delta leads to
    its parent; anything else is where the head's chain breaks."""
    version = check.index.head
    while version is not None:
        if _sound(check, "anchor", version):
            return None
        if not _sound(check, "delta", version):
            return version
        version = check.manifests[("delta", version)].parent
    return None


def _path(check: RunCheck) -> list[Manifest]:
    """The readable manifests of the versions from the head down to ``broken_at``
    (included when its manifest can be read): where a new anchor may stand."""
    out: list[Manifest] = []
    version = check.index.head
    while version is not None:
        manifest = check.manifests.get(("delta", version)) or check.manifests.get(
            ("anchor", version)
        )
        if manifest is None:
            break
        out.append(manifest)
        if version == check.broken_at:
            break
        version = manifest.parent
    return out


@dataclass(frozen=True)
class Source:
    """Tensors proven (as they are written) against ``manifest``, and where they are."""

    manifest: Manifest
    name: str
    open: Callable[[], contextlib.AbstractContextManager[CheckpointReader]]


def from_checkpoint(check: RunCheck, checkpoint: str | os.PathLike[str]) -> Source:
    """The version at or above ``broken_at`` whose state ``checkpoint`` holds, by its
    tensor hashes; MismatchError when it holds none of them."""
    candidates = _path(check)
    if not candidates:
        raise ChainError(f"run {check.run}: no version at or above the damage can be read")
    path = Path(checkpoint)
    algorithm = content_hashes.of(candidates[0])
    digests: dict[str, str] = {}
    with CheckpointReader(path) as reader:
        for name in reader.names():
            digests[name] = algorithm.full(reader.get(name))
            reader.close()  # one tensor mapped at a time
    for manifest in candidates:  # newest first: the highest version it proves
        names = [t.name for t in manifest.tensors]
        if all(n in digests for n in names) and (
            state_hash((n, digests[n]) for n in names) == manifest.state_hash
        ):
            return Source(manifest, f"checkpoint {path}", functools.partial(CheckpointReader, path))
    low = candidates[-1].version
    raise MismatchError(
        f"checkpoint {path} holds none of versions {low} to {check.index.head} of run "
        f"{check.run} (its tensor hashes match no manifest there)"
    )


def from_cache(check: RunCheck, cache: StateCache) -> Source | None:
    """The diff worker's cache when it holds a version at or above ``broken_at`` whose
    manifest names its state (its tensors are proven as the anchor is written)."""
    with flock(cache.root / cache.LOCK, exclusive=False):
        held = cache.version
        for manifest in _path(check):
            if manifest.version == held and cache.is_valid_for(manifest):
                return Source(
                    manifest,
                    f"the diff worker's state cache of v{held} ({cache.root})",
                    functools.partial(_cache_reader, cache, manifest),
                )
    return None


@contextlib.contextmanager
def _cache_reader(cache: StateCache, manifest: Manifest) -> Iterator[CheckpointReader]:
    """The cache's files, under its shared lock: no diff job switches it while it is read."""
    with flock(cache.root / cache.LOCK, exclusive=False):
        if not cache.is_valid_for(manifest):
            raise ChainError(f"state cache {cache.root} moved past v{manifest.version}")
        with cache.reader() as reader:
            yield reader


def repair(
    store: ObjectStore,
    run: str,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    cache: StateCache | None = None,
    options: PublishOptions = DEFAULT_OPTIONS,
    check: RunCheck | None = None,
    on_anchor: Callable[[Manifest], None] | None = None,
) -> RepairResult:
    """Make ``run`` reachable again (see the module's text): an anchor from
    ``checkpoint`` (else from ``cache``) when the head's chain is broken, then the
    damaged versions removed. ChainError, naming the damage, when no source proves a
    version at or above it. The anchor is written as ``options`` say (signed with its
    key, which a signed run needs). ``on_anchor`` runs once the anchor is published."""
    store = signer_store(store, options.signing_key)
    check = check or check_run(store, run)
    if check.healthy:
        return RepairResult(check, None, "", ())
    anchor: Manifest | None = None
    source: Source | None = None
    if check.broken_at is not None:
        signed = [m for m in check.manifests.values() if m.signature is not None]
        if signed and options.signing_key is None:
            raise ConfigError(
                f"run {run} is signed: repair needs its signing key (DELTASYNC_SIGNING_KEY) to "
                f"sign the new anchor; nothing changed ({check.describe()})"
            )
        if checkpoint is not None:
            source = from_checkpoint(check, checkpoint)
        elif cache is not None:
            source = from_cache(check, cache)
        if source is None:
            raise ChainError(
                f"{check.describe()}; no proven source: give --from CHECKPOINT holding a "
                f"version from {check.broken_at} to {check.index.head} (checked against "
                "its manifest), or repair where the run's diff worker keeps its state cache"
            )
        anchor = _publish(store, check, source, options)
        if on_anchor is not None:
            on_anchor(anchor)
    removed = _remove(store, check, check.damaged)
    return RepairResult(check, anchor, "" if source is None else source.name, tuple(removed))


def _publish(
    store: ObjectStore,
    check: RunCheck,
    source: Source,
    options: PublishOptions,
) -> Manifest:
    expected = source.manifest
    if expected.is_pieced:
        raise ConfigError(
            f"run {check.run} is stored in pieces (a sharded run): repair cannot rebuild its "
            f"anchors yet; damaged: {check.damage[0].describe()}"
        )
    in_the_way: tuple[Kind, int] = ("anchor", expected.version)  # a damaged anchor there
    _remove(store, check, {in_the_way} & check.damaged)
    with source.open() as tensors:
        anchor = publish_anchor(
            store,
            check.run,
            expected.version,
            tensors,
            options,
            parent=expected.parent,
            reason="repair",
            layout=expected.parts(),
            expected=expected,  # every tensor's hash, then the state hash, before the manifest
            parent_state_hash=expected.parent_state_hash,
        )
    log.warning(
        "run repaired with a new anchor", run=check.run, version=anchor.version, source=source.name
    )
    return anchor


def _remove(store: ObjectStore, check: RunCheck, doomed: set[tuple[Kind, int]]) -> list[str]:
    """Delete damaged versions (manifest first, then their folder's objects)."""
    keys = [manifest_key(check.run, kind, version) for kind, version in sorted(doomed)]
    if keys:
        retention.delete_versions(store, keys, [])
        log.warning("damaged versions removed", run=check.run, versions=sorted(doomed))
    return [f"{kind} {version}" for kind, version in sorted(doomed)]


def skip_to_proven(
    store: ObjectStore,
    run: str,
    cache: StateCache,
    options: PublishOptions = DEFAULT_OPTIONS,
) -> RepairResult | None:
    """Compaction's way past damage: when the head's chain is broken and the diff
    worker's cache proves a version at or above the damage, anchor that version (and
    take the damaged ones out); None when the chain is not broken or no such cache is
    here (the caller's error stands)."""
    check = check_run(signer_store(store, options.signing_key), run)
    if check.broken_at is None or from_cache(check, cache) is None:
        return None
    return repair(
        store,
        run,
        cache=cache,
        options=options,
        check=check,
    )
