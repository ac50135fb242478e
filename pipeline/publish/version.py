"""Publishing versions to a store: the core of the diff and compaction jobs.

Each version is stored as one object per part of the run's partition
(:mod:`pipeline.publish.parts`): ``part-00000.safetensors`` etc. inside the version
folder.

Every publish uploads all objects first and writes the manifest last, and is
idempotent: an existing manifest is returned untouched. Crash points for
fault-injection tests (see :mod:`pipeline.testing.faults`): ``publish.after_read``,
``publish.after_encode``, ``publish.after_upload``, ``publish.before_manifest``,
``publish.after_manifest`` for deltas, and the same names under ``anchor.``
for anchors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import structlog
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline import cpus
from pipeline.codec import CODEC_NAME, CODEC_VERSION, DeltaObject, encode_delta, read_delta
from pipeline.codec.anchor import ZSTD_LEVEL, check_compression, encode_anchor
from pipeline.coord.events import DeltaPart
from pipeline.errors import ChainError, MismatchError
from pipeline.format import content_hashes, mixsum
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.checkpoint_names import published_form
from pipeline.format.content_hashes import HashAlgorithm
from pipeline.format.hashing import sha256_bytes
from pipeline.format.manifest import (
    CodecInfo,
    Kind,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    manifest_key,
    now_iso,
    to_json,
    version_prefix,
)
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.signing import sign
from pipeline.publish.parts import DEFAULT_PART_BYTES, Layout, read_parts
from pipeline.publish.state_cache import check_against
from pipeline.publish.uploads import Clock, PublishTimings, Uploader
from pipeline.store.base import ObjectStore
from pipeline.testing import faults
from pipeline.versions import binding as run_binding
from pipeline.versions import chain

log = structlog.get_logger(__name__)

PrivateKey = Ed25519PrivateKey | bytes

ANCHOR_CODEC = CodecInfo(name="safetensors", version=1, level=0)
# Per anchor compression (pipeline/codec/anchor.py): what the manifest records.
ANCHOR_CODECS = {
    "none": ANCHOR_CODEC,
    "zstd": CodecInfo(name="safetensors-planes-zstd", version=1, level=ZSTD_LEVEL),
}


class StaleBaseError(MismatchError):
    """The diff base does not hold the parent's state (a damaged or outdated cache)."""


def _existing(store: ObjectStore, run: str, kind: Kind, version: int) -> Manifest | None:
    if not store.exists(manifest_key(run, kind, version)):
        return None
    return chain.load_manifest(store, run, kind, version)


def write_manifest(
    store: ObjectStore, manifest: Manifest, signing_key: PrivateKey | None, fault: str
) -> Manifest:
    manifest = replace(
        manifest, instance=run_binding.instance_for_publish(store, manifest.run).instance
    )
    if signing_key is not None:
        manifest = sign(manifest, signing_key)
    data = to_json(manifest)
    # Never publish what readers would refuse (a run whose head cannot be read is stuck).
    parse_manifest(
        data,
        expected_run=manifest.run,
        expected_version=manifest.version,
        expected_kind=manifest.kind,
        source=manifest.key,
    )
    faults.point(f"{fault}.before_manifest")
    store.put(manifest.key, data)
    faults.point(f"{fault}.after_manifest")
    return manifest


Pairs = list[tuple[str, torch.Tensor, torch.Tensor]]

# Threads hashing base and new while the codec encodes: one per four CPUs (the
# encoder takes one per two), so a 2-core machine keeps one.
HASH_THREADS = max(1, min(4, cpus.available() // 4))


def _pair_hashes(
    pairs: Pairs, algorithm: HashAlgorithm = content_hashes.XXH3_ALGORITHM
) -> tuple[dict[str, str], dict[str, str]]:
    """Content hashes of the (base, new) tensors of ``pairs``."""
    return (
        {n: algorithm.full(b) for n, b, _ in pairs},
        {n: algorithm.full(t) for n, _, t in pairs},
    )


def shares_by_bytes(pairs: Pairs, count: int) -> list[Pairs]:
    """``pairs`` split into at most ``count`` non-empty shares of about equal bytes
    (largest first, each to the lightest share)."""
    shares: list[Pairs] = [[] for _ in range(max(1, count))]
    loads = [0] * len(shares)
    for pair in sorted(pairs, key=lambda p: p[2].nbytes, reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(pair)
        loads[lightest] += pair[2].nbytes
    return [share for share in shares if share]


def hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="deltasync-hash")


def submit_hashes(
    pool: ThreadPoolExecutor,
    pairs: Pairs,
    algorithm: HashAlgorithm = content_hashes.XXH3_ALGORITHM,
) -> Callable[[], tuple[dict[str, str], dict[str, str]]]:
    """Hash ``pairs`` on ``HASH_THREADS`` of ``pool``'s threads; the returned call waits
    for all of them."""
    futures = [
        pool.submit(_pair_hashes, share, algorithm)
        for share in shares_by_bytes(pairs, HASH_THREADS)
    ]

    def result() -> tuple[dict[str, str], dict[str, str]]:
        base: dict[str, str] = {}
        new: dict[str, str] = {}
        for future in futures:
            b, n = future.result()
            base.update(b)
            new.update(n)
        return base, new

    return result


def tensor_entry(
    name: str,
    tensor: torch.Tensor,
    obj: str,
    changed: int = 0,
    digest: str | None = None,
    algorithm: HashAlgorithm | None = None,
) -> TensorEntry:
    if digest is None:
        digest = (algorithm or content_hashes.XXH3_ALGORITHM).full(tensor)
    return TensorEntry(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=tuple(tensor.shape),
        hash=digest,
        object=obj,
        changed=changed,
    )


def updated_hashes(
    delta: DeltaObject, pairs: Pairs, held: dict[str, str], algorithm: HashAlgorithm
) -> dict[str, str]:
    """The new content hash of each tensor of ``pairs`` from its base's (``held``) and
    the changes ``delta`` makes to it: O(changed), the old contents read at the changed
    positions only."""
    out: dict[str, str] = {}
    for name, base, _ in pairs:
        if delta.info(name).changed == 0:
            out[name] = held[name]
            continue
        flat = mixsum.int_flat(base)
        found = delta.differences(name, base)  # from the streams, the base not read
        if found is not None:  # the base read at the changed positions, once
            out[name] = algorithm.gathered(held[name], flat, *found)[0]
            continue
        patch = delta.decode(name, base)  # level 2's classed positions need the base
        old = flat.index_select(0, patch.positions.to(flat.device))
        out[name] = algorithm.updated(
            held[name], patch.positions, old, patch.values, base.element_size()
        )
    return out


# ---------------------------------------------------------------- anchors


def _anchor_part(
    run: str,
    version: int,
    key: str,
    part: list[tuple[str, torch.Tensor]],
    want: dict[str, TensorEntry] | None,
    entries: list[TensorEntry],
    objects: list[ObjectEntry],
    uploader: Uploader,
    timings: PublishTimings,
    compression: str,
    algorithm: HashAlgorithm,
) -> None:
    faults.point("anchor.after_read")
    clock = Clock()
    for name, tensor in part:
        entry = tensor_entry(name, tensor, key, algorithm=algorithm)
        if want is not None:
            w = want.get(name)
            if w is None or (w.dtype, w.shape, w.hash) != (entry.dtype, entry.shape, entry.hash):
                raise MismatchError(
                    f"anchor {version} of run {run}: tensor {name!r} does not match the "
                    "version it replaces"
                )
        entries.append(entry)
    data = encode_anchor(part, compression, metadata={"deltasync.run": run})
    objects.append(ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data)))
    timings.encode_s += clock.lap()
    faults.point("anchor.after_encode")
    uploader.submit(version_prefix(run, "anchor", version) + key, data)


def publish_anchor(
    store: ObjectStore,
    run: str,
    version: int,
    tensors: CheckpointReader | Iterable[tuple[str, torch.Tensor]],
    *,
    parent: int | None,
    reason: str,
    signing_key: PrivateKey | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    layout: Layout | None = None,
    expected: Manifest | None = None,
    parent_state_hash: str | None = None,
    timings: PublishTimings | None = None,
    anchor_compression: str = "none",
    content_hash: str | None = None,
) -> Manifest:
    """Publish a full version as safetensors parts: plain (any safetensors reader loads
    them) or, with ``anchor_compression="zstd"``, as lossless zstd byte planes (see
    :mod:`pipeline.codec.anchor`). ``layout`` keeps an existing partition; ``expected``
    is a manifest of the same version whose tensor hashes the anchor must match before
    its manifest is written. ``content_hash`` names the tensor hash algorithm: by
    default ``expected``'s (the run's), or for a run's first anchor
    ``content_hashes.DEFAULT``; it is then the run's for good."""
    check_compression(anchor_compression)
    if content_hash is None:
        content_hash = expected.content_hash if expected is not None else content_hashes.DEFAULT
    algorithm = content_hashes.get(content_hash)
    found = _existing(store, run, "anchor", version)
    if found is not None:
        log.info("anchor exists, nothing to do", run=run, version=version)
        return found
    timings = timings or PublishTimings()
    want = {t.name: t for t in expected.tensors} if expected is not None else None
    objects: list[ObjectEntry] = []
    entries: list[TensorEntry] = []
    with Uploader(store, "anchor", timings) as uploader:
        for key, part in read_parts(tensors, layout, part_bytes, timings):
            _anchor_part(
                run,
                version,
                key,
                part,
                want,
                entries,
                objects,
                uploader,
                timings,
                anchor_compression,
                algorithm,
            )
            del part  # else held while the next part is read: two parts resident, not one
        uploader.finish()
    digest = compute_state_hash(entries)
    if expected is not None and digest != expected.state_hash:
        raise MismatchError(
            f"anchor {version} of run {run} does not hold the state of {expected.kind} {version}"
        )
    manifest = Manifest(
        run=run,
        version=version,
        kind="anchor",
        parent=parent,
        anchor=version,
        codec=ANCHOR_CODECS[anchor_compression],
        objects=tuple(objects),
        tensors=tuple(entries),
        state_hash=digest,
        created=now_iso(),
        extra={"reason": reason},
        parent_state_hash=parent_state_hash,
        tensor_form=published_form(tensors) if isinstance(tensors, CheckpointReader) else None,
        content_hash=algorithm.name,
    )
    manifest = write_manifest(store, manifest, signing_key, "anchor")
    log.info(
        "anchor published",
        run=run,
        version=version,
        reason=reason,
        bytes=manifest.total_bytes,
        tensors=len(entries),
    )
    return manifest


# ---------------------------------------------------------------- deltas


def delta_manifest(
    run: str,
    version: int,
    parent: Manifest,
    level: int,
    objects: list[ObjectEntry],
    entries: list[TensorEntry],
    tensor_form: str | None = None,
) -> Manifest:
    """The manifest of a delta whose objects are uploaded (not yet written)."""
    return Manifest(
        run=run,
        version=version,
        kind="delta",
        parent=parent.version,
        anchor=parent.anchor,
        codec=CodecInfo(name=CODEC_NAME, version=CODEC_VERSION, level=level),
        objects=tuple(objects),
        tensors=tuple(entries),
        state_hash=compute_state_hash(entries),
        created=now_iso(),
        extra={
            "changed": sum(e.changed for e in entries),
            "elements": sum(e.numel for e in entries),
        },
        parent_state_hash=parent.state_hash,
        tensor_form=tensor_form,
        content_hash=parent.content_hash,  # a run keeps its first anchor's
    )


def publish_delta(
    store: ObjectStore,
    run: str,
    version: int,
    base: CheckpointReader,
    new: CheckpointReader,
    parent: Manifest,
    *,
    level: int,
    signing_key: PrivateKey | None = None,
    timings: PublishTimings | None = None,
    index: chain.VersionIndex | None = None,
    base_unchanged: Callable[[], bool] | None = None,
    on_part: Callable[[DeltaPart], None] | None = None,
    base_proven: bool = False,
) -> Manifest:
    """Encode ``new`` against ``base`` (which must hold ``parent``'s state) and publish it
    as delta ``version``, part by part in the run's partition, manifest last. ``index``
    saves a listing when the caller has just made one. ``base_unchanged`` is asked once
    every part is encoded, before the manifest: False means the base's files were
    modified while they were read (StaleBaseError, nothing published). ``on_part``
    gets a hint for each part object once it is stored (before the manifest).

    With an incremental content hash (the run's, see :mod:`pipeline.format.content_hashes`)
    the new hashes come from the parent's and the changes alone; ``base_proven`` (the
    base was proven to hold ``parent`` by a full hash, e.g. when its cache was rebuilt)
    then saves hashing the base too: the version costs its encoding and O(changed)."""
    found = _existing(store, run, "delta", version)
    if found is not None:
        log.info("delta exists, nothing to do", run=run, version=version)
        return found
    head = (index or chain.list_versions(store, run)).head
    if head is not None and version <= head:
        raise ChainError(f"run {run}: step {version} is not newer than head {head}")
    if parent.run != run or parent.version != head:
        raise ChainError(
            f"run {run}: delta {version} must follow head {head}, not version {parent.version}"
        )
    check_against(parent, new.specs(), f"checkpoint {new.path}")
    check_against(parent, base.specs(), f"base {base.path}")
    timings = timings or PublishTimings()
    clock = Clock()
    parent_hashes = {t.name: t.hash for t in parent.tensors}
    algorithm = content_hashes.of(parent)
    incremental = algorithm.incremental
    objects: list[ObjectEntry] = []
    entries: list[TensorEntry] = []
    # The base and new tensors are hashed on other threads while the codec encodes
    # (both release the GIL); the base is proven before the part is uploaded. With an
    # incremental hash the new tensors are not hashed, nor a proven base.
    with (
        Uploader(store, "publish", timings) as uploader,
        hash_pool() as hasher,
    ):
        for key, names in parent.parts():
            clock.lap()
            # Read-only views of the mapped files: the codec and the hashes only read.
            pairs = [(n, base.view(n), new.view(n)) for n in names]
            timings.read_s += clock.lap()
            hashed = [] if incremental and base_proven else pairs
            if incremental:  # the base alone, its hashes only checked
                hashed = [(n, b, b.reshape(-1)[:0]) for n, b, _ in hashed]
            hashes = submit_hashes(hasher, hashed, algorithm)
            faults.point("publish.after_read")
            data = encode_delta(pairs, level)
            timings.encode_s += clock.lap()
            base_hashes, new_hashes = hashes()
            delta = read_delta(data, object_name=key)
            if incremental:
                new_hashes = updated_hashes(delta, pairs, parent_hashes, algorithm)
            timings.verify_s += clock.lap()  # the hashing not hidden behind the encoding
            for n, digest in base_hashes.items():
                if digest != parent_hashes[n]:
                    raise StaleBaseError(
                        f"base tensor {n!r} in {base.path} does not match version {parent.version}"
                    )
            changed = {i.name: i.changed for i in delta.tensors}
            entries.extend(
                tensor_entry(n, t, key, changed[n], digest=new_hashes[n]) for n, _, t in pairs
            )
            stored = ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data))
            objects.append(stored)
            timings.encode_s += clock.lap()
            del pairs, delta
            # Unmap this part's pages: a model larger than RAM stays one part resident.
            base.close()
            new.close()
            faults.point("publish.after_encode")
            then = None
            if on_part is not None:
                hint = DeltaPart.now(
                    run=run,
                    version=version,
                    parent=parent.version,
                    key=key,
                    size=stored.size,
                    sha256=stored.sha256,
                )
                then = functools.partial(on_part, hint)
            uploader.submit(version_prefix(run, "delta", version) + key, data, then)
            del data
        uploader.finish()
    if base_unchanged is not None and not base_unchanged():
        raise StaleBaseError(f"base {base.path} was modified while delta {version} was encoded")
    # The run lock makes this the only writer; a holder that stalled past its lease
    # could have been overtaken meanwhile, so the head is looked at again.
    now = chain.list_versions(store, run).head
    if now != parent.version:
        raise ChainError(
            f"run {run}: head moved to {now} while delta {version} was encoded against "
            f"{parent.version}; not published"
        )
    manifest = delta_manifest(run, version, parent, level, objects, entries, published_form(new))
    manifest = write_manifest(store, manifest, signing_key, "publish")
    log.info(
        "delta published",
        run=run,
        version=version,
        parent=parent.version,
        bytes=manifest.total_bytes,
        changed=manifest.extra["changed"],
        elements=manifest.extra["elements"],
    )
    return manifest
