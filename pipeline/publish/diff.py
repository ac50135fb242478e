"""The one diff path: a delta encoded part by part, recorded in a ledger, manifest last.

A version's delta is the run's partition of parts (:mod:`pipeline.publish.parts`),
each encoded against the parent's state and uploaded as one object. Which worker
encodes which part is the ledger's business: a single worker keeps the records in
memory (:class:`LocalLedger`) and claims every part; the hosts of a sharded step
keep them in Redis (:mod:`pipeline.publish.ranks.fanout`) and claim parts with leases.
Both run :func:`encode_parts`, and :func:`assemble_delta` writes the manifest from
the records once every part is recorded.

Crash points (see :mod:`pipeline.testing.faults`): ``publish.after_read``,
``publish.after_encode``, ``publish.after_upload``, ``publish.before_manifest``,
``publish.after_manifest``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import structlog
import torch

from pipeline import cpus
from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta
from pipeline.coord.events import DeltaPart
from pipeline.errors import ChainError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_names import published_form
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import (
    PIECES_SCHEMA,
    SCHEMA_VERSION,
    CodecInfo,
    Kind,
    Manifest,
    ObjectEntry,
    Piece,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    manifest_key,
    now_iso,
    version_prefix,
)
from pipeline.format.matching import check_tensors
from pipeline.format.pieces import StoredPiece, join_pieces
from pipeline.format.regions import Region
from pipeline.publish.uploads import Clock, PublishTimings, Uploader
from pipeline.publish.version import (
    DEFAULT_OPTIONS,
    PrivateKey,
    PublishOptions,
    tensor_entry,
    write_manifest,
)
from pipeline.store.base import ObjectStore
from pipeline.testing import faults
from pipeline.versions import chain

log = structlog.get_logger(__name__)


class StaleBaseError(MismatchError):
    """The diff base does not hold the parent's state (a damaged or outdated cache)."""


@dataclass(frozen=True)
class DeltaTask:
    """Delta ``step`` of ``run``: ``checkpoint`` encoded against version ``parent``.

    ``sharded``: the step's tensors are pieces staged by trainer ranks on several hosts
    (:mod:`pipeline.publish.ranks.sharded`). ``publishes`` is "anchor" only for the first
    version of a sharded run, written part by part too; its fan-out names the version
    itself as ``parent`` (nothing precedes it), and ``anchor_compression`` the format
    of its objects, the same on every host. ``launch``: the trainer start whose ranks
    staged the step (:mod:`pipeline.coord.shards`). ``part_bytes``: the coordinator's
    part size, by which every host plans its ranks' parts of that first anchor (None
    elsewhere: the partition is the parent's)."""

    run: str
    step: int
    checkpoint: str
    parent: int
    parent_kind: Kind
    level: int
    sharded: bool = False
    publishes: Kind = "delta"
    anchor_compression: str = "none"
    launch: str | None = None
    part_bytes: int | None = None


@dataclass(frozen=True)
class PartRecord:
    """One encoded, stored part: its object and the tensor entries it holds, or for a
    sharded run's part the pieces it holds (``tensors`` empty): the manifest's entries
    are joined from every part's pieces (:func:`pipeline.format.pieces.join_pieces`)."""

    object: ObjectEntry
    tensors: tuple[TensorEntry, ...]
    pieces: tuple[StoredPiece, ...] = ()


class Ledger(Protocol):
    """Where a delta's part records live, and who encodes which part."""

    def is_recorded(self, key: str) -> bool: ...

    def claim(self, index: int, key: str) -> contextlib.ExitStack | None:
        """Part ``index`` (``key``) is this worker's until the stack is closed; None:
        another worker holds it."""

    def record(self, key: str, record: PartRecord) -> None: ...

    def records(self) -> dict[str, PartRecord]: ...

    def close(self) -> None:
        """The manifest is written (or the attempt given up): nobody starts a part."""


class LocalLedger:
    """A single worker's ledger: every part is its own, records in memory."""

    def __init__(self) -> None:
        self._records: dict[str, PartRecord] = {}

    def is_recorded(self, key: str) -> bool:
        return key in self._records

    def claim(self, index: int, key: str) -> contextlib.ExitStack | None:
        return contextlib.ExitStack()

    def record(self, key: str, record: PartRecord) -> None:
        self._records.setdefault(key, record)

    def records(self) -> dict[str, PartRecord]:
        return dict(self._records)

    def close(self) -> None:
        pass


Pairs = list[tuple[str, torch.Tensor, torch.Tensor]]

# Threads hashing base and new while the codec encodes: one per four CPUs (the
# encoder takes one per two), so a 2-core machine keeps one.
HASH_THREADS = max(1, min(4, cpus.available() // 4))


def _pair_hashes(
    pairs: Pairs,
    algorithm: HashAlgorithm = content_hashes.XXH3_ALGORITHM,
    regions: dict[str, Region] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Content hashes of the (base, new) tensors of ``pairs``; a tensor that is a piece
    is hashed at its flat positions from ``regions`` (absent: a whole tensor)."""
    at = regions or {}
    return (
        {n: algorithm.piece(b, at.get(n)) for n, b, _ in pairs},
        {n: algorithm.piece(t, at.get(n)) for n, _, t in pairs},
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
    regions: dict[str, Region] | None = None,
) -> Callable[[], tuple[dict[str, str], dict[str, str]]]:
    """Hash ``pairs`` on ``HASH_THREADS`` of ``pool``'s threads; the returned call waits
    for all of them."""
    futures = [
        pool.submit(_pair_hashes, share, algorithm, regions)
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


def scan_hasher(
    pairs: Pairs,
    held: dict[str, str],
    algorithm: HashAlgorithm | None,
    regions: dict[str, Region] | None = None,
) -> tuple[
    Callable[[str, npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]], None],
    dict[str, int],
    dict[str, str],
]:
    """(the encoder's ``on_changes`` hook, the changed count of each tensor it fills,
    the new content hashes it fills): the encoder tells the hook every change its own
    scan found, so neither needs the object parsed again. With an incremental
    ``algorithm``, each changed tensor's new hash comes from its base's (``held``) and
    those changes, with the base contents the scan took at the changed positions: no
    second decode of the object, no second read of the base. The hash comes from the
    true base and new (not from the object's decoding), so a replica that decodes the
    object into anything else refuses it. A piece's positions are its own;
    ``regions`` places them in the tensor. An unchanged tensor has neither a count nor
    a hash here: its hash is its base's."""
    widths = {name: base.element_size() for name, base, _ in pairs}
    at = regions or {}
    counts: dict[str, int] = {}
    out: dict[str, str] = {}

    def hook(
        name: str, positions: npt.NDArray[np.int64], diffs: npt.NDArray[Any], old: npt.NDArray[Any]
    ) -> None:
        counts[name] = positions.size
        if algorithm is None:
            return
        region = at.get(name)
        where = positions if region is None else region.positions(positions)
        new = old + diffs  # wraps in the unsigned width, as the scan took it
        out[name] = algorithm.updated(held[name], where, old, new, widths[name])

    return hook, counts, out


# A part's readers: one for every part, or one per part (a sharded run's: the rank's).
Readers = CheckpointReader | Callable[[str], CheckpointReader]


def _per_part(readers: Readers) -> Callable[[str], CheckpointReader]:
    if isinstance(readers, CheckpointReader):
        return lambda key: readers
    return readers


def encode_parts(
    store: ObjectStore,
    task: DeltaTask,
    parent: Manifest,
    base: Readers,
    new: Readers,
    ledger: Ledger,
    *,
    timings: PublishTimings | None = None,
    base_proven: bool = False,
    on_part: Callable[[DeltaPart], None] | None = None,
    first: str | None = None,
) -> int:
    """Encode and store every part of ``task`` that is neither recorded nor claimed by
    another worker (``first`` first), and record each once its object is stored.
    Returns the number of parts this call recorded.

    ``base`` must hold ``parent``'s state: each part's base tensors are hashed while the
    codec encodes (both release the GIL) and proven before the part is uploaded
    (StaleBaseError otherwise). With an incremental content hash the new hashes come
    from the parent's and the changes alone, and ``base_proven`` (the base was proven
    by a full hash, e.g. when its cache was rebuilt) saves hashing the base too.
    ``on_part`` gets a hint for each part once its object is stored.

    ``base`` and ``new`` are readers of whole tensors, or for a sharded run's parent
    (its tensors in pieces) calls giving each part's readers, which hold that part's
    pieces as 1-D tensors of the tensors' names: the pieces are hashed at their flat
    positions against the parent's piece hashes, and recorded as pieces."""
    timings = timings or PublishTimings()
    clock = Clock()
    base_of, new_of = _per_part(base), _per_part(new)
    algorithm = content_hashes.of(parent)
    incremental = algorithm.incremental
    pieced = parent.is_pieced
    parts = parent.layout()
    index_of = {key: part_index(key, i) for i, (key, _) in enumerate(parts)}
    if first is not None:
        parts.sort(key=lambda p: p[0] != first)
    prefix = version_prefix(task.run, "delta", task.step)
    done = 0

    def recorded(key: str, record: PartRecord, claim: contextlib.ExitStack, t0: float) -> None:
        nonlocal done
        with claim:  # released once recorded (or when recording fails)
            ledger.record(key, record)
        done += 1
        log.info(
            "part encoded",
            run=task.run,
            version=task.step,
            part=key,
            bytes=record.object.size,
            seconds=round(time.perf_counter() - t0, 4),
        )

    # Claims whose part is encoded but not yet recorded (its upload in flight).
    held = contextlib.ExitStack()
    with held, Uploader(store, "publish", timings) as uploader, hash_pool() as hasher:
        for key, held_pieces in parts:
            if ledger.is_recorded(key):
                continue
            claim = ledger.claim(index_of[key], key)
            if claim is None:
                continue  # another worker holds this part
            held.push(claim)
            if ledger.is_recorded(key):  # recorded between the look and the claim
                claim.close()
                continue
            started = time.perf_counter()
            clock.lap()
            part_base, part_new = base_of(key), new_of(key)
            names = [e.name for e, _ in held_pieces]
            # A whole tensor is the piece at 0: the same hashes as of the whole.
            parent_hashes = {e.name: p.hash for e, p in held_pieces}
            regions = {e.name: e.region(p) for e, p in held_pieces} if pieced else None
            # Read-only views of the mapped files: the codec and the hashes only read.
            pairs = [(n, part_base.view(n), part_new.view(n)) for n in names]
            if pieced:
                _check_pieces(key, held_pieces, pairs)
            timings.read_s += clock.lap()
            hashed = [] if incremental and base_proven else pairs
            if incremental:  # the base alone, its hashes only checked
                hashed = [(n, b, b.reshape(-1)[:0]) for n, b, _ in hashed]
            hashes = submit_hashes(hasher, hashed, algorithm, regions)
            faults.point("publish.after_read")
            hook, changed, scanned = scan_hasher(
                pairs, parent_hashes, algorithm if incremental else None, regions
            )
            data = encode_delta(pairs, task.level, on_changes=hook)
            timings.encode_s += clock.lap()
            base_hashes, new_hashes = hashes()
            if incremental:
                new_hashes = {n: scanned.get(n, parent_hashes[n]) for n in names}
            timings.verify_s += clock.lap()  # the hashing not hidden behind the encoding
            for n, digest in base_hashes.items():
                if digest != parent_hashes[n]:
                    raise StaleBaseError(
                        f"base tensor {n!r} in {part_base.path} does not match version "
                        f"{parent.version}"
                    )
            stored = ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data))
            if pieced:
                record = PartRecord(
                    stored,
                    (),
                    tuple(
                        StoredPiece.at(
                            e.name,
                            e.dtype,
                            e.region(p),
                            e.shape,
                            key,
                            new_hashes[e.name],
                            changed.get(e.name, 0),
                        )
                        for e, p in held_pieces
                    ),
                )
            else:
                record = PartRecord(
                    stored,
                    tuple(
                        tensor_entry(n, t, key, changed.get(n, 0), digest=new_hashes[n])
                        for n, _, t in pairs
                    ),
                )
            timings.encode_s += clock.lap()
            del pairs
            # Unmap this part's pages: a model larger than RAM stays one part resident.
            part_base.close()
            part_new.close()
            faults.point("publish.after_encode")
            hint = None
            if on_part is not None:
                part = DeltaPart.now(
                    run=task.run,
                    version=task.step,
                    parent=parent.version,
                    key=key,
                    size=stored.size,
                    sha256=stored.sha256,
                )
                hint = functools.partial(on_part, part)
            # A retry that finds this very part stored does not upload it again; an
            # object left by an encoding against another parent is replaced.
            uploader.submit(
                prefix + key,
                data,
                hint,
                after=functools.partial(recorded, key, record, claim, started),
                sha256=stored.sha256,
            )
            del data
        uploader.finish()
    return done


def part_index(key: str, position: int) -> int:
    """The claim index of part ``key`` (at ``position`` of its version's parts): a
    sharded run's ``part-r<rank>-<i>`` is numbered by rank and i, so that every worker
    names its claim alike without knowing the other hosts' parts."""
    m = RANK_PART.fullmatch(key)
    return position if m is None else int(m.group(1)) * RANK_PARTS + int(m.group(2))


RANK_PARTS = 100_000  # part numbers of one rank (the key holds five digits)
RANK_PART = re.compile(r"part-r(\d{5})-(\d{5})\.safetensors")


def _check_pieces(key: str, held: list[tuple[TensorEntry, Piece]], pairs: Pairs) -> None:
    """Each piece of a part read as a 1-D tensor of the piece's length and the tensor's
    dtype (a base or staging folder of another layout is refused here)."""
    for (entry, piece), (name, b, t) in zip(held, pairs, strict=True):
        for what, tensor in (("base", b), ("new", t)):
            if tuple(tensor.shape) != (piece.numel,) or dtype_name(tensor.dtype) != entry.dtype:
                raise MismatchError(
                    f"part {key}: {what} piece of {name!r} is {tensor.dtype} "
                    f"{tuple(tensor.shape)}, expected {entry.dtype} ({piece.numel},)"
                )


def assemble_delta(
    store: ObjectStore,
    task: DeltaTask,
    parent: Manifest,
    records: dict[str, PartRecord],
    *,
    signing_key: PrivateKey | None = None,
    base_unchanged: Callable[[], bool] | None = None,
    tensor_form: str | None = None,
    base_path: object = None,
) -> Manifest:
    """Write delta ``task.step``'s manifest (last) from its part ``records``, only while
    ``parent`` is still the head: a worker whose lease lapsed while it encoded must not
    publish behind a newer version. ``base_unchanged`` is asked first: False means the
    base's files were modified while they were read (StaleBaseError, nothing
    published)."""
    objects: list[ObjectEntry] = []
    entries: list[TensorEntry] = []
    pieces: list[StoredPiece] = []
    for key, held in parent.layout():
        record = records.get(key)
        if record is None:
            raise ChainError(f"run {task.run}: part {key} of delta {task.step} is not recorded")
        if parent.is_pieced:
            found = [(p.name, p.region) for p in record.pieces]
            if record.tensors or found != [(e.name, e.region(p)) for e, p in held]:
                raise MismatchError(
                    f"run {task.run}: part {key} of delta {task.step} holds other pieces"
                )
            pieces.extend(record.pieces)
        elif record.pieces or [t.name for t in record.tensors] != [e.name for e, _ in held]:
            raise MismatchError(
                f"run {task.run}: part {key} of delta {task.step} holds other tensors"
            )
        objects.append(record.object)
        entries.extend(record.tensors)
    if parent.is_pieced:
        order = [t.name for t in parent.tensors]
        entries = join_pieces(pieces, order, content_hashes.of(parent))
    if base_unchanged is not None and not base_unchanged():
        raise StaleBaseError(f"base {base_path} was modified while delta {task.step} was encoded")
    # The run's diff lease makes this the only writer; a holder that stalled past its
    # lease could have been overtaken meanwhile, so the head is looked at again.
    head = chain.list_versions(store, task.run).head
    if head != parent.version:
        raise ChainError(
            f"run {task.run}: head moved to {head} while delta {task.step} was encoded "
            f"against {parent.version}; not published"
        )
    manifest = delta_manifest(
        task.run, task.step, parent, task.level, objects, entries, tensor_form
    )
    manifest = write_manifest(store, manifest, signing_key, "publish")
    log.info(
        "delta published",
        run=task.run,
        version=task.step,
        parent=parent.version,
        parts=len(objects),
        bytes=manifest.total_bytes,
        changed=manifest.extra["changed"],
        elements=manifest.extra["elements"],
    )
    return manifest


def delta_manifest(
    run: str,
    version: int,
    parent: Manifest,
    level: int,
    objects: list[ObjectEntry],
    entries: list[TensorEntry],
    tensor_form: str | None = None,
) -> Manifest:
    """The manifest of a delta whose objects are uploaded (not yet written); schema 3
    when its tensors are in pieces (a sharded run, whose rank layouts it carries on)."""
    pieced = any(e.pieces for e in entries)
    carried = {"ranks": parent.extra["ranks"]} if "ranks" in parent.extra else {}
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
        schema=PIECES_SCHEMA if pieced else SCHEMA_VERSION,
        extra={
            "changed": sum(e.changed for e in entries),
            "elements": sum(e.numel for e in entries),
            **carried,
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
    options: PublishOptions = DEFAULT_OPTIONS,
    *,
    timings: PublishTimings | None = None,
    index: chain.VersionIndex | None = None,
    base_unchanged: Callable[[], bool] | None = None,
    on_part: Callable[[DeltaPart], None] | None = None,
    base_proven: bool = False,
) -> Manifest:
    """Encode ``new`` against ``base`` (which must hold ``parent``'s state) and publish it
    as delta ``version`` at ``options.level``, part by part in the run's partition,
    manifest last (signed with ``options.signing_key``). ``index`` saves a listing when
    the caller has just made one. See :func:`encode_parts` and :func:`assemble_delta`
    for ``on_part``, ``base_proven`` and ``base_unchanged``."""
    key = manifest_key(run, "delta", version)
    if store.exists(key):
        log.info("delta exists, nothing to do", run=run, version=version)
        return chain.load_manifest(store, run, "delta", version)
    head = (index or chain.list_versions(store, run)).head
    if head is not None and version <= head:
        raise ChainError(f"run {run}: step {version} is not newer than head {head}")
    if parent.run != run or parent.version != head:
        raise ChainError(
            f"run {run}: delta {version} must follow head {head}, not version {parent.version}"
        )
    check_tensors(parent, new.specs(), holder=f"checkpoint {new.path}", complete=True)
    check_tensors(parent, base.specs(), holder=f"base {base.path}", complete=True)
    parent_kind: Kind = parent.kind
    task = DeltaTask(run, version, str(new.path), parent.version, parent_kind, options.level)
    ledger = LocalLedger()
    encode_parts(
        store,
        task,
        parent,
        base,
        new,
        ledger,
        timings=timings,
        base_proven=base_proven,
        on_part=on_part,
    )
    return assemble_delta(
        store,
        task,
        parent,
        ledger.records(),
        signing_key=options.signing_key,
        base_unchanged=base_unchanged,
        tensor_form=published_form(new),
        base_path=base.path,
    )
