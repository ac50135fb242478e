"""Publishing versions to a store: anchors, and what every version's manifest needs.

Each version is stored as one object per part of the run's partition
(:mod:`pipeline.publish.parts`): ``part-00000.safetensors`` etc. inside the version
folder. Deltas are written by :mod:`pipeline.publish.diff`.

Every publish uploads all objects first and writes the manifest last, and is
idempotent: an existing manifest is returned untouched. Crash points for
fault-injection tests (see :mod:`pipeline.testing.faults`): ``anchor.after_read``,
``anchor.after_encode``, ``anchor.after_upload``, ``anchor.before_manifest``,
``anchor.after_manifest``; deltas use the same names under ``publish.``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import structlog
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.codec.anchor import ZSTD_LEVEL, check_compression, encode_anchor
from pipeline.codec.names import DEFAULT_LEVEL
from pipeline.config import Settings
from pipeline.errors import ConfigError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_names import published_form
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import (
    PIECES_SCHEMA,
    SCHEMA_VERSION,
    CodecInfo,
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
from pipeline.format.pieces import StoredPiece, join_pieces
from pipeline.format.signing import sign
from pipeline.publish.parts import DEFAULT_PART_BYTES, Layout, read_parts
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


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """How a publisher writes every version, whatever the run: the delta codec's
    ``level``, the ``signing_key`` its manifests are signed with, and what a new run's
    first anchor fixes for good: its ``part_bytes`` (the partition), its
    ``anchor_compression`` (``"none"`` or ``"zstd"``, see :mod:`pipeline.codec.anchor`;
    also that of its compactions) and its tensor hash ``content_hash`` (None:
    ``content_hashes.DEFAULT``). Later versions keep the run's partition and hash."""

    level: int = DEFAULT_LEVEL
    signing_key: PrivateKey | None = None
    part_bytes: int = DEFAULT_PART_BYTES
    anchor_compression: str = "none"
    content_hash: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> PublishOptions:
        """The options ``settings`` configure (the signing key file is read here)."""
        return cls(
            level=settings.level,
            signing_key=settings.signing_key(),
            part_bytes=settings.part_bytes,
            anchor_compression=settings.anchor_compression,
            content_hash=settings.content_hash,
        )


DEFAULT_OPTIONS = PublishOptions()


def _existing_anchor(store: ObjectStore, run: str, version: int) -> Manifest | None:
    if not store.exists(manifest_key(run, "anchor", version)):
        return None
    log.info("anchor exists, nothing to do", run=run, version=version)
    return chain.load_manifest(store, run, "anchor", version)


def write_manifest(
    store: ObjectStore, manifest: Manifest, signing_key: PrivateKey | None, fault: str
) -> Manifest:
    manifest = replace(
        manifest,
        instance=run_binding.instance_for_publish(store, manifest.run, signing_key).instance,
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


def anchor_manifest(
    run: str,
    version: int,
    objects: list[ObjectEntry],
    entries: list[TensorEntry],
    compression: str,
    algorithm: HashAlgorithm,
    *,
    reason: str,
    expected: Manifest | None = None,
    parent: int | None = None,
    parent_state_hash: str | None = None,
    tensor_form: str | None = None,
    extra: dict[str, object] | None = None,
) -> Manifest:
    """The manifest of anchor ``version`` whose objects are uploaded, to be written last
    (:func:`write_anchor`); schema 3 when its tensors are in pieces (a sharded run).
    ``expected``: the manifest of the version it replaces, whose state it must hold
    (MismatchError otherwise)."""
    digest = compute_state_hash(entries)
    if expected is not None and digest != expected.state_hash:
        raise MismatchError(
            f"anchor {version} of run {run} does not hold the state of {expected.kind} {version}"
        )
    return Manifest(
        run=run,
        version=version,
        kind="anchor",
        parent=parent,
        anchor=version,
        codec=ANCHOR_CODECS[compression],
        objects=tuple(objects),
        tensors=tuple(entries),
        state_hash=digest,
        created=now_iso(),
        schema=PIECES_SCHEMA if any(e.pieces for e in entries) else SCHEMA_VERSION,
        extra={"reason": reason, **(extra or {})},
        parent_state_hash=parent_state_hash,
        tensor_form=tensor_form,
        content_hash=algorithm.name,
    )


def write_anchor(
    store: ObjectStore, manifest: Manifest, signing_key: PrivateKey | None, **logged: object
) -> Manifest:
    """Write an anchor's manifest (last, signed with ``signing_key``) and log it."""
    manifest = write_manifest(store, manifest, signing_key, "anchor")
    log.info(
        "anchor published",
        run=manifest.run,
        version=manifest.version,
        reason=manifest.extra.get("reason"),
        bytes=manifest.total_bytes,
        tensors=len(manifest.tensors),
        **logged,
    )
    return manifest


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


# ---------------------------------------------------------------- anchors


def _upload_part(
    uploader: Uploader,
    run: str,
    version: int,
    key: str,
    part: list[tuple[str, torch.Tensor]],
    compression: str,
    objects: list[ObjectEntry],
    clock: Clock,
) -> None:
    data = encode_anchor(part, compression, metadata={"deltasync.run": run})
    objects.append(ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data)))
    uploader.timings.encode_s += clock.lap()
    faults.point("anchor.after_encode")
    uploader.submit(version_prefix(run, "anchor", version) + key, data)


def publish_anchor(
    store: ObjectStore,
    run: str,
    version: int,
    tensors: CheckpointReader | Iterable[tuple[str, torch.Tensor]],
    options: PublishOptions = DEFAULT_OPTIONS,
    *,
    parent: int | None,
    reason: str,
    layout: Layout | None = None,
    expected: Manifest | None = None,
    parent_state_hash: str | None = None,
    timings: PublishTimings | None = None,
) -> Manifest:
    """Publish a full version as safetensors parts (``options.part_bytes`` each unless
    ``layout`` keeps an existing partition): plain (any safetensors reader loads them)
    or, with ``options.anchor_compression`` ``"zstd"``, as lossless zstd byte planes
    (see :mod:`pipeline.codec.anchor`). ``expected`` is a manifest of the same version
    whose tensor hashes (in the run's hash) the anchor must match before its manifest
    is written; without it, the anchor is a new run's, hashed with
    ``options.content_hash``."""
    compression = options.anchor_compression
    check_compression(compression)
    if expected is not None and expected.is_pieced:
        raise ConfigError(
            f"{expected.kind} {version} of run {run} is stored in pieces: its anchor keeps "
            "them (publish_pieced_anchor)"
        )
    if expected is not None:
        algorithm = content_hashes.of(expected)
    else:
        algorithm = content_hashes.get(options.content_hash or content_hashes.DEFAULT)
    found = _existing_anchor(store, run, version)
    if found is not None:
        return found
    timings = timings or PublishTimings()
    want = {t.name: t for t in expected.tensors} if expected is not None else None
    objects: list[ObjectEntry] = []
    entries: list[TensorEntry] = []
    with Uploader(store, "anchor", timings) as uploader:
        for key, part in read_parts(tensors, layout, options.part_bytes, timings):
            faults.point("anchor.after_read")
            clock = Clock()
            for name, tensor in part:
                e = tensor_entry(name, tensor, key, algorithm=algorithm)
                w = e if want is None else want.get(name)  # a new run's: nothing to match
                if w is None or (w.dtype, w.shape, w.hash) != (e.dtype, e.shape, e.hash):
                    raise MismatchError(
                        f"anchor {version} of run {run}: tensor {name!r} does not match the "
                        "version it replaces"
                    )
                entries.append(e)
            _upload_part(uploader, run, version, key, part, compression, objects, clock)
            del part  # else held while the next part is read: two parts resident, not one
        uploader.finish()
    manifest = anchor_manifest(
        run,
        version,
        objects,
        entries,
        compression,
        algorithm,
        reason=reason,
        expected=expected,
        parent=parent,
        parent_state_hash=parent_state_hash,
        tensor_form=published_form(tensors) if isinstance(tensors, CheckpointReader) else None,
    )
    return write_anchor(store, manifest, options.signing_key)


def publish_pieced_anchor(
    store: ObjectStore,
    run: str,
    version: int,
    parts: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]],
    expected: Manifest,
    options: PublishOptions = DEFAULT_OPTIONS,
    *,
    reason: str,
    timings: PublishTimings | None = None,
) -> Manifest:
    """An anchor of a sharded run's version ``version`` that keeps its pieces: the same
    objects holding the same flat ranges as ``expected`` (the pieced manifest of that
    version), each object written from one of ``parts`` ((object key, [(name, 1-D
    piece)]), as ``chain.reconstruct_parts`` yields them), one part in memory at a time.
    Every piece must hash to ``expected``'s piece hash (MismatchError) before the
    manifest (schema 3) is written last, signed with ``options.signing_key``; its objects
    are in ``options.anchor_compression``. Idempotent."""
    compression = options.anchor_compression
    check_compression(compression)
    found = _existing_anchor(store, run, version)
    if found is not None:
        return found
    algorithm = content_hashes.of(expected)
    timings = timings or PublishTimings()
    layout = dict(expected.layout())
    objects: list[ObjectEntry] = []
    pieces: list[StoredPiece] = []
    with Uploader(store, "anchor", timings) as uploader:
        for key, part in parts:
            faults.point("anchor.after_read")
            held = layout.get(key)
            if held is None or [e.name for e, _ in held] != [n for n, _ in part]:
                raise MismatchError(
                    f"anchor {version} of run {run}: part {key} does not hold the pieces of "
                    f"{expected.kind} {version}"
                )
            clock = Clock()
            for (entry, piece), (name, tensor) in zip(held, part, strict=True):
                if tuple(tensor.shape) != (piece.numel,) or dtype_name(tensor.dtype) != entry.dtype:
                    raise MismatchError(
                        f"anchor {version} of run {run}: piece ({piece.describe()}) of "
                        f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}"
                    )
                region = entry.region(piece)
                digest = algorithm.piece(tensor, region)
                if digest != piece.hash:
                    raise MismatchError(
                        f"anchor {version} of run {run}: piece ({piece.describe()}) "
                        f"of tensor {name!r} does not match the version it replaces"
                    )
                pieces.append(StoredPiece.at(name, entry.dtype, region, entry.shape, key, digest))
            _upload_part(uploader, run, version, key, part, compression, objects, clock)
            del part  # one part resident, not two
        uploader.finish()
    if [o.key for o in objects] != list(layout):
        raise MismatchError(f"anchor {version} of run {run}: parts missing from what was given")
    entries = join_pieces(pieces, [t.name for t in expected.tensors], algorithm)
    manifest = anchor_manifest(
        run,
        version,
        objects,
        entries,
        compression,
        algorithm,
        reason=reason,
        expected=expected,
        parent=expected.parent,
        parent_state_hash=expected.parent_state_hash,
        tensor_form=expected.tensor_form,
        # The ranks' layouts the run's partition was fixed by: the next step checks its own.
        extra={k: v for k, v in expected.extra.items() if k == "ranks"},
    )
    return write_anchor(store, manifest, options.signing_key, pieced=True)
