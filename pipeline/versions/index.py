"""The versions of a run in the store, and how each is reached: listing manifests,
loading and checking them, resolving a version into its anchor and deltas, fetching a
checked object. No tensor is touched, so commands that only look (``deltasync status``)
import neither torch nor the codec; :mod:`pipeline.versions.chain` rebuilds versions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pipeline.errors import ChainError, CorruptObjectError, ObjectNotFoundError, SignatureError
from pipeline.format.hashes.digests import sha256_bytes
from pipeline.format.manifest import (
    KIND_FOLDERS,
    MAX_MANIFEST_BYTES,
    Kind,
    Manifest,
    ObjectEntry,
    check_run,
    manifest_key,
)
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.signing import SIGNS_MANIFEST, verify_sealed
from pipeline.store.base import ObjectStore, read_bounded, read_prefix
from pipeline.store.trust import store_key

_VERSION_FOLDER = re.compile(r"^(\d{10})/")

# What a verifying reader reads of a manifest before its signature is checked: the
# header, and all of a small manifest.
FIRST_READ_BYTES = 64 << 10


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


def version_folders(store: ObjectStore, run: str, kind: Kind) -> dict[int, list[str]]:
    """Every key under ``<run>/<kind folder>/``, grouped by version folder."""
    prefix = f"{check_run(run)}/{KIND_FOLDERS[kind]}/"
    folders: dict[int, list[str]] = {}
    for key in store.list(prefix):
        m = _VERSION_FOLDER.match(key[len(prefix) :]) if key.startswith(prefix) else None
        if m is not None:
            folders.setdefault(int(m.group(1)), []).append(key)
    return folders


def with_manifest(folders: dict[int, list[str]]) -> tuple[int, ...]:
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
        deltas=with_manifest(version_folders(store, run, "delta")),
        anchors=with_manifest(version_folders(store, run, "anchor")),
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
) -> Manifest:
    """Fetch and validate one manifest. With a key (the one the store is trusted with,
    :func:`pipeline.store.trust.trusted`: the one way a key reaches it) the order is: the object's
    first bytes, the signature they hold, then only the bytes that signature names, then
    the schema; an unsigned or wrongly signed manifest costs a bounded read whatever its
    size, and nothing unsigned is interpreted."""
    key = manifest_key(run, kind, version)
    trusted_key = store_key(store)
    limit = MAX_MANIFEST_BYTES
    verified = prefix = b""
    try:
        if trusted_key is not None:
            name = f"{kind} {version} of run {run}"
            prefix = read_prefix(store, key, FIRST_READ_BYTES)
            header = verify_sealed(prefix, SIGNS_MANIFEST, trusted_key, name)
            limit, verified = header.total, prefix[: header.length]
        if len(verified) and len(prefix) < FIRST_READ_BYTES:
            data = prefix  # the whole object: a small manifest is read once
        else:
            data = read_bounded(store, key, limit, what="manifest")
    except ObjectNotFoundError:
        raise ObjectNotFoundError(f"manifest {key} does not exist in {store.url}") from None
    if not data.startswith(verified):  # replaced between the two reads
        raise SignatureError(f"manifest {key} changed while it was read")
    return parse_manifest(
        data, expected_run=run, expected_version=version, expected_kind=kind, source=key
    )


def resolve(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    index: VersionIndex | None = None,
) -> ChainPlan:
    """The newest anchor at or below ``version`` and the deltas after it, by parent links."""
    index = index or list_versions(store, run)
    if version in index.anchors:
        anchor = load_manifest(store, run, "anchor", version)
        return ChainPlan(run, version, anchor, ())
    if version not in index.deltas:
        raise ChainError(f"run {run} has no version {version} (head is {index.head})")

    def needed(kind: Kind, at: int) -> Manifest:
        try:
            if kind == "anchor" or at in index.deltas:
                return load_manifest(store, run, kind, at)
        except ObjectNotFoundError:
            pass
        what = "anchor" if kind == "anchor" else "version"
        raise ChainError(f"run {run}: version {version} needs {what} {at}, which is missing")

    deltas, parent = follow_parents(
        version, lambda v: needed("delta", v), index.anchors.__contains__
    )
    assert parent is not None  # parse_manifest guarantees deltas have parents
    plan = ChainPlan(run, version, needed("anchor", parent), tuple(deltas))
    _check_links(plan)
    return plan


def follow_parents(
    top: int, load: Callable[[int], Manifest | None], stop: Callable[[int], bool]
) -> tuple[list[Manifest], int | None]:
    """The walk every chain plan makes: the manifests from ``top`` down their parent links,
    oldest first, and the version the walk ended at: the first that ``stop`` holds for,
    or that ``load`` has no manifest for (None: past a version without a parent)."""
    path: list[Manifest] = []
    version: int | None = top
    while version is not None and not stop(version):
        manifest = load(version)
        if manifest is None:
            break
        path.append(manifest)
        version = manifest.parent
    path.reverse()
    return path, version


def deltas_after(
    held: int, top: int, deltas: Collection[int], load: Callable[[int], Manifest]
) -> list[Manifest] | None:
    """The delta manifests after ``held`` up to ``top`` by parent links (``load`` reads
    one), oldest first; None when the links do not lead back to ``held``."""
    path, end = follow_parents(top, lambda v: load(v) if v in deltas else None, lambda v: v <= held)
    return path if end == held else None


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
        data = read_bounded(store, key, entry.size, what="object")
    except ObjectNotFoundError:
        raise CorruptObjectError(f"object {key} is missing from {store.url}") from None
    if len(data) != entry.size:
        raise CorruptObjectError(
            f"object {key} is {len(data)} bytes, its manifest says {entry.size}"
        )
    if sha256_bytes(data) != entry.sha256:
        raise CorruptObjectError(f"object {key} does not match its sha256")
    return data
