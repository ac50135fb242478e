"""Sharded runs on the diff side: one version from the pieces that trainer ranks staged
on several hosts, each part encoded on the host that holds it, manifest last.

The same diff path as every delta (:func:`pipeline.publish.diff.encode_parts`, part
records in a :class:`~pipeline.publish.ranks.fanout.RedisLedger`, parts routed to hosts
with :func:`~pipeline.publish.ranks.fanout.route_parts`); what differs is where a part's
tensors come from. A part holds pieces of one rank (``part-r<rank>-<i>``): its new
pieces are in the rank's staging folder on that rank's host, its base in that host's
cache of the rank (:mod:`pipeline.publish.caches.rank_cache`). So:

- the coordinator (the diff job holding the run's diff lease, on any host) reads the
  rank registrations from Redis, routes each part to its rank's host, starts the
  fan-out, calls the hosts' diff workers in (part jobs on their host queues), works
  its own host's parts if it serves one, waits until every part is recorded (at most
  ``wait_s``: then the step fails naming the hosts that did not record), and writes
  the manifest (schema 3, tensors in pieces). It never reads a host's files.
- a host's workers (:func:`work_host`) encode the parts of the ranks registered on
  their host, from folders under their own staging folder only.

The run's first anchor is written the same way: each host plans its ranks' parts
(each rank's pieces in sidecar order, split by the coordinator's ``part_bytes``, which
the fan-out carries, so that every host plans alike), routes them to itself
(one transaction per rank, so the coordinator learns a rank's parts at once) and
uploads them as anchor objects of 1-D pieces. That partition is the run's for good.

Only the ranks of the step's trainer start (its ``launch``) count: a step emitted
again after a restart is never diffed from an earlier start's folders.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

from pipeline import config
from pipeline.codec.anchor import check_compression, encode_anchor
from pipeline.coord.events import DeltaPart
from pipeline.coord.replicas import lock_held
from pipeline.coord.shards import RankFolder, rank_folders
from pipeline.errors import (
    ChainError,
    ConfigError,
    DeltasyncError,
    MismatchError,
)
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.shards import RankPiece, read_layout
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import (
    DTYPE_WIDTHS,
    Manifest,
    ObjectEntry,
    dtype_name,
    version_prefix,
)
from pipeline.format.pieces import StoredPiece, join_pieces
from pipeline.publish.caches.rank_cache import RankCache
from pipeline.publish.diff import (
    RANK_PART,
    DeltaTask,
    PartRecord,
    StaleBaseError,
    assemble_delta,
    encode_parts,
    part_index,
)
from pipeline.publish.parts import plan_parts
from pipeline.publish.ranks.fanout import (
    CallIn,
    RedisLedger,
    current_fanout,
    part_hosts,
    part_lock,
    route_parts,
    start_fanout,
)
from pipeline.publish.step import PublishResult, already_done
from pipeline.publish.uploads import holds
from pipeline.publish.version import (
    DEFAULT_OPTIONS,
    PrivateKey,
    PublishOptions,
    anchor_manifest,
    write_anchor,
)
from pipeline.store.base import ObjectStore
from pipeline.store.trust import signer_store
from pipeline.testing import faults
from pipeline.versions import chain

log = structlog.get_logger(__name__)

IDLE_S = 0.1  # between looks at the records


class MissingPartsError(ChainError):
    """Trainer hosts did not record their parts of a sharded step in time."""


def read_pieces(folder: Path) -> list[RankPiece]:
    """The pieces of a rank folder, in its sidecar's order."""
    return list(read_layout(folder).pieces)


# ------------------------------------------------------------------ the partition


def rank_part_key(rank: int, index: int) -> str:
    return f"part-r{rank:05d}-{index:05d}.safetensors"


def rank_of(key: str) -> int:
    m = RANK_PART.fullmatch(key)
    if m is None:
        raise MismatchError(f"part {key!r} is not a rank's part")
    return int(m.group(1))


def plan_rank_parts(
    rank: int, pieces: Iterable[RankPiece], part_bytes: int
) -> list[tuple[str, list[RankPiece]]]:
    """Rank ``rank``'s parts: its non-empty pieces in order, split by ``part_bytes`` as
    :func:`pipeline.publish.parts.plan_parts` splits tensors."""
    held = [p for p in pieces if p.numel > 0]
    sizes = ((str(i), p.numel * DTYPE_WIDTHS[p.dtype]) for i, p in enumerate(held))
    return [
        (rank_part_key(rank, j), [held[int(i)] for i in names])
        for j, (_, names) in enumerate(plan_parts(sizes, part_bytes))
    ]


def rank_keys(manifest: Manifest) -> dict[int, list[str]]:
    """Each rank's part keys in a pieced manifest, in order."""
    out: dict[int, list[str]] = {}
    for key, _ in sorted(manifest.layout(), key=lambda p: part_index(p[0], 0)):
        out.setdefault(rank_of(key), []).append(key)
    return out


def check_rank_pieces(manifest: Manifest, rank: int, pieces: list[RankPiece], step: int) -> None:
    """A rank's staged pieces must be those the run's partition gives it."""
    fixed = [
        (e.name, e.dtype, e.shape, e.region(p))
        for key in rank_keys(manifest).get(rank, [])
        for e, p in dict(manifest.layout())[key]
    ]
    staged = [(p.name, p.dtype, p.shape, p.region) for p in pieces if p.numel > 0]
    if staged != fixed:
        raise MismatchError(
            f"run {manifest.run}: rank {rank} of step {step} holds other pieces than the "
            "run's first anchor fixed; refused"
        )


def check_layouts(parent: Manifest, ranks: dict[int, RankFolder], step: int) -> None:
    """The ranks of ``step`` must hold what the ranks of the run's first anchor held
    (its layout digests, carried by every later manifest)."""
    run = parent.run
    if not parent.is_pieced:
        raise MismatchError(
            f"run {run}: step {step} is sharded, {parent.kind} {parent.version} is not; refused"
        )
    fixed = parent.extra.get("ranks")
    if not isinstance(fixed, dict) or len(fixed) != len(ranks):
        count = len(fixed) if isinstance(fixed, dict) else "no"
        raise MismatchError(
            f"run {run}: step {step} has {len(ranks)} ranks, the run's partition {count}"
        )
    for rank, folder in sorted(ranks.items()):
        if fixed.get(str(rank)) != folder.layout:
            raise MismatchError(
                f"run {run}: the layout of rank {rank} of step {step} differs from the "
                "run's, which its first anchor fixed; refused"
            )


def _check_complete(run: str, step: int, ranks: dict[int, RankFolder]) -> int:
    worlds = {f.world for f in ranks.values()}
    world = worlds.pop() if len(worlds) == 1 else 0
    if world < 1 or worlds or set(ranks) != set(range(world)):
        raise ChainError(
            f"run {run} step {step}: ranks {sorted(ranks)[:8]} registered, not every rank "
            f"of one world; not published"
        )
    return world


# ------------------------------------------------------------------ a host's workers


@dataclass(frozen=True)
class HostSide:
    """What a diff worker serving trainer host ``host`` works with: Redis, the store,
    and its own staging and cache folders (it opens no folder outside them)."""

    client: redis.Redis
    store: ObjectStore
    host: str
    staging_dir: Path
    cache_dir: Path
    part_bytes: int
    on_part: Callable[[DeltaPart], None] | None = None

    def own_folder(self, run: str, rank: int, folder: RankFolder) -> Path:
        """The registered folder of ``rank``, refused unless it is in this host's staging."""
        path = Path(folder.path)
        root = (self.staging_dir / run).resolve()
        if folder.host != self.host or path.is_symlink() or not path.resolve().is_relative_to(root):
            raise ConfigError(
                f"rank {rank} folder {folder.path[:200]} is not in host {self.host}'s "
                "staging folder; refused"
            )
        return path


class _HostLedger(RedisLedger):
    """A host's view of the fan-out's records: only its ranks' parts are claimed, and
    each object it records is noted in the rank's cache (what it uploaded)."""

    def __init__(self, side: HostSide, fanout: DeltaTask, caches: dict[int, RankCache]) -> None:
        super().__init__(side.client, fanout, host=side.host)
        self.caches = caches

    def claim(self, index: int, key: str) -> contextlib.ExitStack | None:
        m = RANK_PART.fullmatch(key)
        if m is None or int(m.group(1)) not in self.caches:
            return None
        return super().claim(index, key)

    def record(self, key: str, record: PartRecord) -> None:
        self.caches[rank_of(key)].record_upload(self.fanout.step, key, record.object.sha256)
        super().record(key, record)


def work_host(side: HostSide, fanout: DeltaTask, first: str | None = None) -> int:
    """Encode every unrecorded, unclaimed part of ``fanout`` whose rank is registered on
    this host (``first`` first); the number of parts this call recorded."""
    run, step = fanout.run, fanout.step
    ranks = rank_folders(side.client, run, step, fanout.launch)
    mine = {r: f for r, f in ranks.items() if f.host == side.host}
    if not mine:
        return 0
    folders = {r: side.own_folder(run, r, f) for r, f in mine.items()}
    caches = {r: RankCache(side.cache_dir, run, r) for r in mine}
    if fanout.publishes == "anchor":
        return _anchor_parts(side, fanout, folders, caches, first)
    parent = chain.load_manifest(side.store, run, fanout.parent_kind, fanout.parent)
    keys = rank_keys(parent)
    for rank, folder in folders.items():
        check_rank_pieces(parent, rank, read_pieces(folder), step)
    for attempt in range(2):
        proven = all(
            [_ready(side, caches[r], parent, keys.get(r, []), attempt > 0) for r in sorted(mine)]
        )
        with contextlib.ExitStack() as stack:
            bases = {r: stack.enter_context(caches[r].reader()) for r in mine}
            news = {r: stack.enter_context(CheckpointReader(folders[r])) for r in mine}
            try:
                return encode_parts(
                    side.store,
                    fanout,
                    parent,
                    functools.partial(_of_rank, bases),
                    functools.partial(_of_rank, news),
                    _HostLedger(side, fanout, caches),
                    base_proven=proven,
                    on_part=side.on_part,
                    first=first,
                )
            except StaleBaseError as e:
                if attempt:
                    raise
                log.warning("rank cache is damaged, rebuilding", error=str(e))
    raise AssertionError("unreachable")


def _of_rank(readers: dict[int, CheckpointReader], key: str) -> CheckpointReader:
    return readers[rank_of(key)]


def _ready(
    side: HostSide, cache: RankCache, parent: Manifest, keys: list[str], rebuild: bool
) -> bool:
    """Bring ``cache`` to ``parent``'s pieces of its rank: as it is, by adopting the
    rank's staging folder of that step, or rebuilt from the store. Whether its bytes are
    proven by a full hash."""
    with cache.locked():
        if not rebuild and cache.is_valid_for(parent, keys):
            return cache.is_proven_for(parent, keys)
        staged = None
        prior = rank_folders(side.client, parent.run, parent.version).get(cache.rank)
        if prior is not None and prior.host == side.host:
            with contextlib.suppress(ConfigError):
                staged = side.own_folder(parent.run, cache.rank, prior)
        if (
            not rebuild
            and staged is not None
            and staged.is_dir()
            and cache.adopt(staged, parent, keys)
        ):
            log.info("rank cache adopted its staged step", rank=cache.rank, version=parent.version)
            _remove_stale(side, parent, cache.rank)
            return True
        cache.rebuild(side.store, parent, keys)
        if staged is not None and staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)  # published, and in the cache now
        _remove_stale(side, parent, cache.rank)
        return True


_STEP_FOLDER = re.compile(r"step-(\d{10})")


def _remove_stale(side: HostSide, head: Manifest, rank: int) -> None:
    """Remove this host's staged folders of ``rank`` for steps behind ``head`` (steps
    that failed, now stale: they can never be published), and step folders left empty."""
    root = side.staging_dir / head.run
    for step_folder in root.glob("step-*") if root.is_dir() else ():
        m = _STEP_FOLDER.fullmatch(step_folder.name)
        if m is None or int(m.group(1)) > head.version or step_folder.is_symlink():
            continue
        shutil.rmtree(step_folder / f"rank-{rank:05d}", ignore_errors=True)
        with contextlib.suppress(OSError):
            step_folder.rmdir()  # once every rank of this host is out of it


def _anchor_parts(
    side: HostSide,
    fanout: DeltaTask,
    folders: dict[int, Path],
    caches: dict[int, RankCache],
    first: str | None,
) -> int:
    """This host's parts of a sharded run's first anchor: each rank's pieces planned into
    parts and routed here, then each part claimed, stored as an anchor object of 1-D
    pieces and recorded."""
    run, step = fanout.run, fanout.step
    algorithm = content_hashes.get(content_hashes.MIXSUM)
    # The coordinator's size (a fan-out of an older coordinator carries none: our own).
    part_bytes = side.part_bytes if fanout.part_bytes is None else fanout.part_bytes
    plans: dict[int, list[tuple[str, list[RankPiece]]]] = {}
    for rank in sorted(folders):
        plans[rank] = plan_rank_parts(rank, read_pieces(folders[rank]), part_bytes)
        if not plans[rank]:
            raise MismatchError(f"run {run}: rank {rank} of step {step} holds no elements")
        route_parts(side.client, run, step, {key: side.host for key, _ in plans[rank]})
    ledger = _HostLedger(side, fanout, caches)
    prefix = version_prefix(run, "anchor", step)
    done = 0
    for rank in sorted(plans, key=lambda r: f"rank-{r:05d}" != first):
        with CheckpointReader(folders[rank]) as reader:
            for key, pieces in plans[rank]:
                if ledger.is_recorded(key):
                    continue
                claim = ledger.claim(part_index(key, 0), key)
                if claim is None:
                    continue
                with claim:
                    if ledger.is_recorded(key):
                        continue
                    started = time.perf_counter()
                    tensors = [(p.name, reader.view(p.name)) for p in pieces]
                    for p, (_, t) in zip(pieces, tensors, strict=True):
                        if tuple(t.shape) != (p.numel,) or dtype_name(t.dtype) != p.dtype:
                            raise MismatchError(
                                f"{folders[rank]}: piece of {p.name!r} is {t.dtype} "
                                f"{tuple(t.shape)}, its sidecar says {p.dtype} ({p.numel},)"
                            )
                    faults.point("anchor.after_read")
                    stored = tuple(
                        StoredPiece.at(
                            p.name, p.dtype, p.region, p.shape, key, algorithm.piece(t, p.region)
                        )
                        for p, (_, t) in zip(pieces, tensors, strict=True)
                    )
                    data = encode_anchor(
                        tensors, fanout.anchor_compression, metadata={"deltasync.run": run}
                    )
                    del tensors
                    reader.close()
                    entry = ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data))
                    faults.point("anchor.after_encode")
                    if not holds(side.store, prefix + key, entry.size, entry.sha256):
                        side.store.put(prefix + key, data)
                    del data
                    faults.point("anchor.after_upload")
                    ledger.record(key, PartRecord(entry, (), stored))
                done += 1
                log.info(
                    "part encoded",
                    run=run,
                    version=step,
                    part=key,
                    bytes=entry.size,
                    seconds=round(time.perf_counter() - started, 4),
                )
    return done


# ------------------------------------------------------------------ the coordinator


def publish_sharded(
    client: redis.Redis,
    store: ObjectStore,
    run: str,
    step: int,
    checkpoint: str,
    options: PublishOptions = DEFAULT_OPTIONS,
    *,
    call_in: CallIn,
    call_again: CallIn | None = None,
    work_here: Callable[[DeltaTask], object] | None = None,
    wait_s: float,
    on_published: Callable[[Manifest], None] | None = None,
    launch: str | None = None,
) -> PublishResult:
    """Publish sharded step ``step`` of ``run`` (every rank registered) as one version:
    the run's first anchor, or a delta against the head, each part encoded by a worker
    of its rank's host, manifest last. ``call_in`` queues a job per part (for the
    anchor: per rank, ``rank-<R>``) on the given host's queue; ``call_again`` (default
    ``call_in``) queues one more for a part nobody holds while the coordinator waits.
    ``work_here`` works the coordinator's own host's parts. ``checkpoint`` (the
    completing rank's step folder) only names the step; nothing is read from it.
    ``options.part_bytes``: the size by which every host splits its ranks' pieces into
    the first anchor's parts (later versions keep that partition). ``launch``: the
    trainer start that completed the step; only its ranks count."""
    signing_key, level, part_bytes = options.signing_key, options.level, options.part_bytes
    store = signer_store(store, signing_key)
    index = chain.list_versions(store, run)
    done = already_done(store, run, step, index)
    if done is not None:
        return done
    ranks = rank_folders(client, run, step, launch)
    _check_complete(run, step, ranks)
    started = time.perf_counter()
    head = index.head
    again = call_again or call_in
    if head is None:
        name = options.content_hash or content_hashes.DEFAULT
        if name != content_hashes.MIXSUM:
            raise ConfigError(
                f"run {run}: a sharded run hashes its pieces with {content_hashes.MIXSUM}, "
                f"not {name}"
            )
        check_compression(options.anchor_compression)
        prior = current_fanout(client, run)
        if prior is not None and (prior.step, prior.publishes) == (step, "anchor"):
            # A dead coordinator's anchor: its hosts planned (and maybe stored) parts by
            # its size; another would route a second partition beside the first.
            part_bytes = prior.part_bytes or part_bytes
        fanout = DeltaTask(
            run,
            step,
            checkpoint,
            step,
            "anchor",
            level,
            sharded=True,
            publishes="anchor",
            anchor_compression=options.anchor_compression,
            launch=launch,
            part_bytes=part_bytes,
        )
        planned = None
        calls = [(f"rank-{r:05d}", f.host) for r, f in sorted(ranks.items())]
    else:
        parent = chain.load_manifest(
            store, run, "anchor" if head in index.anchors else "delta", head
        )
        check_layouts(parent, ranks, step)
        planned = [key for key, _ in parent.parts()]
        route_parts(client, run, step, {key: ranks[rank_of(key)].host for key in planned})
        fanout = DeltaTask(run, step, checkpoint, head, parent.kind, level, True, launch=launch)
        calls = [(key, ranks[rank_of(key)].host) for key in planned]
    start_fanout(client, fanout)
    ledger = RedisLedger(client, fanout, owner=True)
    call_in(fanout, calls)
    try:
        records = _await_parts(client, fanout, ledger, ranks, planned, again, work_here, wait_s)
        if head is None:
            manifest = _assemble_anchor(store, fanout, ranks, records, signing_key)
        else:
            manifest = assemble_delta(
                store,
                fanout,
                parent,
                records,
                signing_key=signing_key,
                tensor_form=parent.tensor_form,
            )
    finally:
        ledger.close()
    published_s = round(time.perf_counter() - started, 4)
    if on_published is not None:
        on_published(manifest)
    return PublishResult.published(manifest, head, {"published_s": published_s})


def _await_parts(
    client: redis.Redis,
    fanout: DeltaTask,
    ledger: RedisLedger,
    ranks: dict[int, RankFolder],
    planned: list[str] | None,
    call_again: CallIn,
    work_here: Callable[[DeltaTask], object] | None,
    wait_s: float,
) -> dict[str, PartRecord]:
    """Every part's record, once all are in; MissingPartsError after ``wait_s``. A part
    (for the anchor: a rank not yet planned) that no live worker holds is called in
    again, less often as the wait goes on."""
    run, step = fanout.run, fanout.step
    deadline = time.monotonic() + wait_s
    pause = config.SHARDED_RECALL_S
    recall_at = time.monotonic() + pause
    if work_here is not None:
        work_here(fanout)
    while True:
        # The keys only while waiting: at scale the records are megabytes.
        recorded = ledger.recorded_keys()
        if planned is None:  # the anchor: each rank's parts as its host routed them
            routed = part_hosts(client, run, step)
            unplanned = sorted(set(ranks) - {rank_of(k) for k in routed})
            expected = sorted(routed, key=lambda k: part_index(k, 0))
        else:
            unplanned, expected = [], planned
        missing = [k for k in expected if k not in recorded]
        if not missing and not unplanned:
            records = ledger.records()
            return {k: records[k] for k in expected}
        faults.point("sharded.waiting")  # parts still out on the hosts
        now = time.monotonic()
        if now >= deadline:
            hosts = {ranks[rank_of(k)].host for k in missing} | {ranks[r].host for r in unplanned}
            raise MissingPartsError(
                f"run {run} step {step}: host(s) {', '.join(sorted(hosts))} did not record "
                f"{len(missing) + len(unplanned)} part(s) within {wait_s:g}s; not published"
            )
        if now >= recall_at:
            if work_here is not None:
                work_here(fanout)
            lost: list[tuple[str, str]] = [
                (k, ranks[rank_of(k)].host)
                for k in missing
                if not lock_held(client, run, part_lock(step, part_index(k, 0)))
            ]
            lost += [(f"rank-{r:05d}", ranks[r].host) for r in unplanned]
            if lost:
                log.info("calling hosts in again", parts=len(lost))
                call_again(fanout, lost)
            pause = min(pause * 2, config.SHARDED_RECALL_S * 16)
            recall_at = time.monotonic() + pause
        time.sleep(IDLE_S)


def _assemble_anchor(
    store: ObjectStore,
    fanout: DeltaTask,
    ranks: dict[int, RankFolder],
    records: dict[str, PartRecord],
    signing_key: PrivateKey | None,
) -> Manifest:
    """The first anchor's manifest from its parts' pieces (written last)."""
    run, step = fanout.run, fanout.step
    keys = sorted(records, key=lambda k: part_index(k, 0))
    pieces = [p for k in keys for p in records[k].pieces]
    order = list(dict.fromkeys(p.name for p in pieces))
    algorithm = content_hashes.get(content_hashes.MIXSUM)
    entries = join_pieces(pieces, order, algorithm)
    head = chain.list_versions(store, run).head
    if head is not None:
        raise ChainError(f"run {run}: version {head} appeared while anchor {step} was written")
    manifest = anchor_manifest(
        run,
        step,
        [records[k].object for k in keys],
        entries,
        fanout.anchor_compression,
        algorithm,
        reason="first version",
        extra={"ranks": {str(r): f.layout for r, f in sorted(ranks.items())}},
    )
    return write_anchor(store, manifest, signing_key, ranks=len(ranks))


def help_host(side: HostSide, fanout: DeltaTask, first: str | None = None) -> int:
    """:func:`work_host` at best effort: a host that cannot do its parts says why in its
    log, and the coordinator's wait names it."""
    try:
        return work_host(side, fanout, first)
    except (DeltasyncError, OSError) as e:
        log.warning(
            "cannot encode this host's parts", version=fanout.step, host=side.host, error=str(e)
        )
        return 0
