"""The rollout node: keeps a target at the head of a run's version chain.

The store is the truth and events are hints. The node bootstraps from the
newest anchor at or below the head and replays the chain after it; then it
follows ``delta-available`` events and also lists the store every
``poll_interval_s``, so a lost event, a trimmed stream or a restarted Redis only
delays it. Whatever fails, the target keeps the last version that applied and
verified; the node reports the error and recovers from the store.

An inference server embeds a :class:`RolloutNode` (``run`` in a thread);
``workers/nodes/rollout.py`` is the process entry that wraps it. Its target holds
the weights here, or is a :class:`RemoteTarget` (a stock ``vllm serve``, each of
whose workers a node of its own brings to the versions handed over: ``bring_to``).
Downloads live in ``fetch.py``, event-stream following in ``stream.py``, events and
heartbeats in ``report.py`` and the state file in ``state.py``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol, cast, runtime_checkable

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pipeline import collector, metrics
from pipeline.config import REPLICA_TTL_S, VERIFY_MODES, Settings
from pipeline.coord.stream import EventStream
from pipeline.errors import (
    ChainError,
    ConfigError,
    CorruptObjectError,
    DeltasyncError,
    MismatchError,
    ObjectNotFoundError,
    RollbackError,
    SignatureError,
    StoreError,
    TargetError,
)
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.hashes.scrub import Scrubbable, Scrubber, ScrubPace
from pipeline.format.manifest import Kind, Manifest
from pipeline.format.matching import check_tensors
from pipeline.format.signing import load_public_key
from pipeline.rollout.early import EarlyParts
from pipeline.rollout.fetch import Fetched, fetch_delta, stream_anchor, stream_anchor_pieces
from pipeline.rollout.report import Reporter
from pipeline.rollout.state import (
    Recorded,
    dump_metadata,
    pin_path,
    read_dump,
    read_pin,
    read_state,
    write_pin,
    write_state,
)
from pipeline.rollout.stream import StreamFollower
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.store.trust import store_key, trusted
from pipeline.targets.base import Target, VerifyMode
from pipeline.testing import faults
from pipeline.versions import binding as run_binding
from pipeline.versions import chain

log = structlog.get_logger(__name__)

# How often the node's thread looks for early downloads to hand to a target whose
# proofs it must start itself (a vLLM engine): while some are on their way, and
# otherwise (hints arrive on another thread while this one waits for events).
HANDOFF_WAIT_S = 0.02
HANDOFF_IDLE_WAIT_S = 0.1


# ``NodeOptions.public_key``'s default: the verify key DELTASYNC_VERIFY_KEY names, so
# that a node built by hand checks signatures wherever one is configured.
CONFIGURED: Literal["configured"] = "configured"


def configured_public_key(settings: Settings | None = None) -> Ed25519PublicKey | None:
    """The verify key ``settings`` (default: the environment's) name, or None."""
    path = (settings or Settings.from_env()).verify_key_path
    return load_public_key(path) if path is not None else None


def state_path_for(data_dir: Path, run: str, node_id: str) -> Path:
    """Where a node records the last version it applied (checked, never trusted)."""
    return data_dir / "rollout" / run / f"{node_id}.json"


def parse_verify(value: str) -> VerifyMode:
    """``value`` as a verify mode; ConfigError for anything else."""
    if value not in VERIFY_MODES:
        raise ConfigError(f"verify mode {value!r} is not one of {', '.join(VERIFY_MODES)}")
    return cast(VerifyMode, value)


@dataclass(frozen=True)
class NodeOptions:
    """How a node follows its run; checked when built. ``public_key``: the manifests'
    signer (default: the configured key; None opts out). ``progress`` None: when
    stderr is a terminal. ``early_start`` needs ``prefetch`` and Redis. ``held_from``:
    the checkpoint the target was loaded from (a dump of this run's node: the node
    resumes from the version it records and keeps its floor)."""

    node_id: str = "node"
    verify: VerifyMode = "touched"
    poll_interval_s: float = 2.0
    prefetch: bool = True
    prefetch_depth: int = 2
    public_key: Ed25519PublicKey | Literal["configured"] | None = CONFIGURED
    state_path: Path | None = None
    heartbeat_interval_s: float = 5.0
    replica_ttl_s: float = REPLICA_TTL_S
    max_backoff_s: float = 30.0
    progress: bool | None = None
    early_start: bool = False
    scrub: ScrubPace | None = None
    held_from: Path | None = None

    def __post_init__(self) -> None:
        parse_verify(self.verify)
        if self.prefetch_depth < 1:
            raise ConfigError(f"prefetch_depth {self.prefetch_depth} is below 1")
        for name in ("poll_interval_s", "heartbeat_interval_s", "replica_ttl_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)} is negative")


@runtime_checkable
class RemoteTarget(Protocol):
    """Weights held elsewhere, whose own workers fetch, prove and apply versions (a
    vLLM server with the deltasync weight-transfer backend): the node fetches nothing,
    it hands manifests over in chain order (to bootstrap, the head's)."""

    def holds(self, manifest: Manifest) -> bool:
        """Whether it says it holds ``manifest``'s version already."""

    def bring_to(self, manifest: Manifest, verify: VerifyMode) -> None:
        """Hold ``manifest``'s version; raises when refused (it keeps what it held)."""


class RolloutNode:
    """Brings ``target`` to the head of ``run`` in ``store`` and keeps it there.

    :meth:`from_settings` wires everything the settings configure (store, Redis,
    signatures, state file, early start, scrubbing). Built directly, a node still checks
    signatures against the configured verify key unless ``NodeOptions(public_key=None)``
    says otherwise. ``target``: a :class:`Target`, or a :class:`RemoteTarget`."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        target: Target | RemoteTarget,
        options: NodeOptions | None = None,
        *,
        events: EventStream | None = None,
        redis: Any = None,
        on_applied: Callable[[Manifest], None] | None = None,
    ) -> None:
        """``events``: the run's event stream (hints, announcements); ``redis``: a
        client for heartbeats and part hints. ``on_applied(manifest)`` runs on the
        node's thread each time the target is known to hold a version (applied, loaded
        or resumed)."""
        if not isinstance(target, Target | RemoteTarget):
            raise ConfigError(f"{type(target).__name__} is not a Target subclass or a RemoteTarget")
        options = options or NodeOptions()
        self.options = options
        self.store = store
        self.run_name = run
        self.target = target
        self.events = events
        self.redis = redis
        self.node_id = options.node_id
        self.verify: VerifyMode = options.verify  # may be changed between syncs
        key = options.public_key
        self.public_key = configured_public_key() if key == CONFIGURED else key
        self.state_path = options.state_path
        self.progress = sys.stderr.isatty() if options.progress is None else options.progress
        self.on_applied = on_applied

        self._applied: int | None = None
        self._held: Manifest | None = None  # the manifest of the applied version
        # Freshness: the newest verified version seen, and the run instance (read from
        # the store once); a node never goes back below either's word.
        self._highest: int | None = None
        # The floor kept from before a restart (state file, dump) and the run instance
        # it belongs to: together with the above, what the node never goes below.
        self._floor: int | None = None
        self._floor_instance: str | None = None
        # Versions the state file or a dump says the target holds, not yet proved (their
        # manifest was not in the store): tried again once the store lists them.
        self._candidates: list[Recorded] = []
        # Manifests that failed to load or verify, skipped when looking for the head.
        self._unusable: dict[tuple[Kind, int], DeltasyncError] = {}
        self._instance: run_binding.RunInstance | None = None
        self._pinned: str | None = None  # the instance recorded beside the state file
        self._head_seen: int | None = None  # the store's head at the last sync
        self._state_hash: str | None = None
        self._started = False
        self._manifests: dict[tuple[Kind, int], Manifest] = {}  # write-once: safe to cache
        self._failures = 0
        self._next_retry = 0.0  # monotonic time before which polling waits after a failure
        self._need_bootstrap = False
        # (anchor, head, head's creation time) of a bootstrap whose replay failed: the
        # same store state is not bootstrapped again.
        self._stuck_on: tuple[int, int | None, str] | None = None
        self._cap: int | None = None  # the newest version a sync may bring (bring_to)
        self.last_error: DeltasyncError | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stream = StreamFollower(events, run)
        # Part hints start downloads, and proofs where the target can, before a
        # manifest exists (asked for, prefetch on, and Redis to hear the hints on).
        self.early: EarlyParts | None = None
        if options.early_start and options.prefetch and redis is not None:
            local = None if isinstance(target, RemoteTarget) else target
            self.early = EarlyParts(store, run, local, lambda: self._applied)
        self.report = Reporter(
            run,
            options.node_id,
            events=events,
            redis=redis,
            heartbeat_interval_s=options.heartbeat_interval_s,
            replica_ttl_s=options.replica_ttl_s,
            first_seen=self._stream.first_seen,
            early_start=self.early is not None,
        )
        self.history = self.report.history
        # Held tensors re-hashed in the background (a target that can be scrubbed):
        # a mismatch is reported and the node recovers from the store.
        self._scrub_failed: str | None = None
        self.scrubber: Scrubber | None = None
        if options.scrub is not None and isinstance(target, Scrubbable):
            self.scrubber = Scrubber(target, options.scrub, self._on_scrub_mismatch)

    # -- public ----------------------------------------------------------------------

    @classmethod
    def from_settings(
        cls,
        run: str,
        target: Target | RemoteTarget,
        settings: Settings | None = None,
        *,
        store: ObjectStore | None = None,
        redis: Any = None,
        node_id: str = "node",
        on_applied: Callable[[Manifest], None] | None = None,
        **options: Any,
    ) -> RolloutNode:
        """A node of ``run`` wired as ``settings`` (default: the environment's) say: the
        store, the verify key, the state file, the replica TTL, early start and scrubbing;
        ``redis`` (a client) adds events, hints and heartbeats. ``options``: other
        :class:`NodeOptions` fields (``verify``, ``poll_interval_s``, ...), over these."""
        settings = settings or Settings.from_env()
        scrub = settings.scrub_minutes * 60, settings.scrub_cpu
        wired = NodeOptions(
            node_id=node_id,
            public_key=configured_public_key(settings),
            state_path=state_path_for(settings.data_dir, run, node_id),
            replica_ttl_s=settings.replica_ttl_s,
            early_start=settings.early_start,
            scrub=ScrubPace(*scrub) if settings.scrub_minutes > 0 else None,
        )
        return cls(
            store if store is not None else open_store(settings.store_url),
            run,
            target,
            replace(wired, **options),
            events=None if redis is None else EventStream(redis, run),
            redis=redis,
            on_applied=on_applied,
        )

    @property
    def applied_version(self) -> int | None:
        """The version the target holds (verified), or None before the first one."""
        return self._applied

    @property
    def applied_state_hash(self) -> str | None:
        return self._state_hash

    def start(self) -> int | None:
        """Resume from the state file when the target's weights prove it, else leave
        the target for the first sync to bootstrap. Idempotent."""
        if not self._started:
            self._started = True
            self._resume()
            if self.scrubber is not None:
                self.scrubber.start()
        return self._applied

    def step_once(self) -> int | None:
        """One sync with the store: bring the target to the head. Errors are reported
        and remembered in ``last_error``, never raised. Returns the applied version.

        A process that drives its engine itself calls this between its own calls to
        the engine. With early start, part hints are then heard in the background
        from the first call on, and finished early downloads are handed to the target
        here, on the caller's thread, before the sync."""
        if self.early is not None:
            self.early.listen(self.redis)
            self.early.hand_off()
        return self._step()

    def bring_to(self, version: int) -> None:
        """One sync that brings the target to ``version``, not past it (the store may
        hold newer ones): for a caller that picks the versions, such as a server's
        workers told by a remote node. Raises what failed (kept in ``last_error``)."""
        self._cap = version
        try:
            self._step()
        finally:
            self._cap = None
        if self.last_error is not None:
            raise self.last_error

    def _on_scrub_mismatch(self, name: str) -> None:
        self._scrub_failed = name

    def _take_scrub_failure(self) -> None:
        """A scrub found held memory changed: report it and recover from the store
        (a bootstrap of the head), like a refused version."""
        name, self._scrub_failed = self._scrub_failed, None
        if name is None:
            return
        exc = MismatchError(
            f"scrub: held tensor {name!r} of v{self._applied} no longer matches its hash "
            "(memory changed behind the node's back); recovering from the store"
        )
        log.warning("scrub mismatch", run=self.run_name, node=self.node_id, tensor=name)
        metrics.scrub_mismatch(self.run_name, "rollout")
        self.report.failed(self._applied, exc)
        self._need_bootstrap = True
        self._stuck_on = None  # the held state is what is wrong, not the store's

    def _step(self) -> int | None:
        self.start()
        try:
            self._take_scrub_failure()
            self._sync()
        except DeltasyncError as exc:
            self._on_error(exc)
        else:
            self._failures = 0
            self._next_retry = 0.0
            self.last_error = None
            self.report.synced()
        self.report.heartbeat_if_due(self._applied, self._state_hash)
        metrics.replica_at(self.run_name, self.node_id, self._head_seen, self._applied)
        return self._applied

    def run(
        self, until_version: int | None = None, stop: threading.Event | None = None
    ) -> int | None:
        """Follow the run until ``stop`` is set, or until ``until_version`` (or a later
        one) has been applied. Returns the applied version."""
        stop = stop or threading.Event()
        after_id = self._stream.position()
        self.start()
        if self.early is not None:
            self.early.listen(self.redis)
        next_poll = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_poll and now >= self._next_retry:
                    self._step()  # handing parts over just before an apply gains nothing
                    next_poll = time.monotonic() + self.options.poll_interval_s
                if self._reached(until_version):
                    break
                self.report.heartbeat_if_due(self._applied, self._state_hash)
                wait_s = max(0.0, max(next_poll, self._next_retry) - time.monotonic())
                if self.early is not None and self.early.hands_off:
                    due = self.early.handoff_due()
                    wait_s = min(wait_s, HANDOFF_WAIT_S if due else HANDOFF_IDLE_WAIT_S)
                woken, after_id = self._stream.wait(after_id, wait_s, stop, self._applied)
                if woken:
                    next_poll = 0.0
                    self._next_retry = 0.0
                elif self.early is not None:
                    self.early.hand_off()  # on this thread: it may call into the target
        finally:
            self.close()
        return self._applied

    @property
    def floor(self) -> int | None:
        """The newest version this node verified, across restarts: it never goes below."""
        known = [v for v in (self._highest, self._applied, self._floor) if v is not None]
        return max(known) if known else None

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write the target's weights (checkpoint names) as a safetensors file; its
        metadata names the version held and the node's floor (for a restart from it)."""
        out = Path(path)
        if isinstance(self.target, RemoteTarget):
            raise TargetError(f"{type(self.target).__name__} holds its weights elsewhere")
        meta = dump_metadata(self.run_name, self._held, self.floor, self._floor_instance)
        write_checkpoint(out, self.target.export(), metadata=meta)
        return out

    def close(self) -> None:
        if self.scrubber is not None:
            self.scrubber.stop()
        if self.early is not None:
            self.early.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- resume ----------------------------------------------------------------------

    def _resume(self) -> None:
        """Keep the floor the state file and a dump of this node record, and resume
        from a version they say the target holds, once its weights prove it."""
        for source, recorded in (
            ("state file", read_state(self.state_path, self.run_name)),
            ("dump", read_dump(self.options.held_from, self.run_name)),
        ):
            if recorded is None:
                continue
            self._keep_floor(recorded, source)
            seen = {(c.version, c.kind) for c in self._candidates}
            if recorded.version is not None and (recorded.version, recorded.kind) not in seen:
                self._candidates.append(recorded)
        self._try_resume(None)

    def _keep_floor(self, recorded: Recorded, source: str) -> None:
        """Adopt a recorded floor unless the store's run record names another instance
        of the run (a new run under the old name, whose manifests a key would tell
        apart; an old instance's versions are refused anyway)."""
        if recorded.instance is not None:
            record: run_binding.RunInstance | None = None
            try:  # read here, not kept: _check_instance reads it with its own checks
                record = run_binding.read_instance(self.store, self.run_name, self._key())
            except DeltasyncError as exc:
                log.info("cannot read the run record; keeping the floor", error=str(exc))
            if record is not None and record.instance != recorded.instance:
                log.info(
                    "recorded floor belongs to another instance of the run, not kept",
                    floor=recorded.floor,
                    source=source,
                )
                return
            self._floor_instance = recorded.instance
        if self._floor is None or recorded.floor > self._floor:
            self._floor = recorded.floor
        log.info("floor kept across the restart", floor=self._floor, source=source)

    def _try_resume(self, index: chain.VersionIndex | None) -> None:
        """Resume from the first candidate the target's weights prove. One whose
        manifest is not there (or not listed in ``index``) is kept for a later sync."""
        for recorded in list(self._candidates):
            version, kind = recorded.version, recorded.kind
            assert version is not None  # only held versions are candidates
            if index is not None and not _listed(index, kind, version):
                continue
            try:
                manifest = self._manifest(kind, version)
            except DeltasyncError as exc:
                log.info("cannot resume yet", version=version, error=str(exc))
                continue
            self._candidates.remove(recorded)
            if not self._proves(manifest):
                continue
            self._candidates.clear()
            self._set_applied(manifest)
            log.info("resumed", run=self.run_name, version=version)
            return

    def _proves(self, manifest: Manifest) -> bool:
        """Whether the target's weights are ``manifest``'s (a remote target's word)."""
        if isinstance(self.target, RemoteTarget):
            return self.target.holds(manifest)
        try:
            held = self.target.hashes([t.name for t in manifest.tensors], manifest.content_hash)
        except DeltasyncError as exc:
            log.info("cannot resume, will bootstrap", version=manifest.version, error=str(exc))
            return False
        bad = [t.name for t in manifest.tensors if held.get(t.name) != t.hash]
        if bad:
            log.info(
                "held weights are not the recorded version, will bootstrap",
                version=manifest.version,
                first_mismatch=bad[0],
                mismatches=len(bad),
            )
        return not bad

    def _hold(self, manifest: Manifest | None, instance: str | None) -> None:
        """Record ``manifest`` as held (None mid-load: nothing provable; the floor stays)."""
        self._applied = None if manifest is None else manifest.version
        self._held = manifest
        self._state_hash = None if manifest is None else manifest.state_hash
        if instance is not None:
            self._floor_instance = instance
        write_state(
            self.state_path, self.run_name, self.node_id, manifest, self.floor, self._floor_instance
        )

    # -- sync ------------------------------------------------------------------------

    def _sync(self) -> None:
        # No cyclic collection from the listing to the last apply (see collector.py):
        # a full one walks every object of the process, on the version's critical path.
        with collector.held_off():
            self._sync_listed()

    def _sync_listed(self) -> None:
        # Read before the listing: a version announced by then has its manifest stored.
        announced = self._announced() if self._cap is None else None
        index = listed = self._listing()
        try:
            self._sync_from(index)
        except (ObjectNotFoundError, CorruptObjectError):  # a manifest or an object gone
            fresh = self._listing()
            if not _collected(index, fresh):
                raise
            # A compaction's garbage collection took versions after the listing: not a
            # fault of the store or of this node. Once more, from a fresh listing (a
            # real fault on the way from there is raised and reported).
            log.info("versions collected since the listing, syncing again", run=self.run_name)
            self._manifests.clear()
            listed = fresh
            self._sync_from(fresh)
        # Announced versions the store does not list at all: hidden or deleted. (One
        # listed but unusable is reported by its own error, below.)
        if announced is not None and (listed.head is None or announced > listed.head):
            raise RollbackError(
                f"run {self.run_name}: store behind announcements: v{announced} announced, "
                f"head {_shown(listed.head)} (versions hidden or deleted from the store); "
                f"this node holds {_shown(self._applied)}"
            )
        above = [
            (v, exc)
            for (_, v), exc in self._unusable.items()
            if v in listed.versions and (self._head_seen is None or v > self._head_seen)
        ]
        if above:
            # Synced to the newest usable version; what sits above it is still reported.
            raise max(above, key=lambda item: item[0])[1]

    def _listing(self) -> chain.VersionIndex:
        """The store's versions of the run, up to the cap of a ``bring_to``."""
        index = chain.list_versions(self.store, self.run_name)
        cap = self._cap
        if cap is None:
            return index
        return replace(
            index,
            deltas=tuple(v for v in index.deltas if v <= cap),
            anchors=tuple(v for v in index.anchors if v <= cap),
        )

    def _announced(self) -> int | None:
        """The newest version Redis says was announced (None: none, or no Redis)."""
        if self.events is None:
            return None
        try:
            return self.events.announced_head()
        except DeltasyncError:
            return None  # events are hints: the store sync goes on without them

    def _sync_from(self, index: chain.VersionIndex) -> None:
        top = self._usable_head(index)
        head = None if top is None else top.version
        cap = self._cap
        if cap is not None and head != cap:  # bring_to: that version or nothing
            refused = [exc for (_, v), exc in self._unusable.items() if v == cap]
            if refused:
                raise refused[0]
            raise StoreError(  # not listed (yet): nothing the node holds is wrong
                f"run {self.run_name}: v{cap} is not in the store (head {_shown(head)})"
            )
        floor = self.floor
        if floor is not None and (head is None or head < floor):
            raise RollbackError(
                f"run {self.run_name}: store head {_shown(head)} is below this node's floor "
                f"v{floor} (the newest version it verified); refusing to go back, keeping "
                f"what it holds ({_shown(self._applied)})"
            )
        self._head_seen = head
        if top is None or head is None:
            return
        if self._applied is None and self._candidates:
            self._try_resume(index)
        if self._applied is None or self._need_bootstrap:
            self._bootstrap(index, top)
            return
        if head <= self._applied:
            return
        path = self._plan(index, self._applied, head)
        anchor = self._newest_usable_anchor(index, head)
        if path is None or (
            anchor is not None and anchor > self._applied and self._anchor_is_cheaper(anchor, path)
        ):
            self._bootstrap(index, top)
            return
        self._apply_chain(path)

    def _usable_head(self, index: chain.VersionIndex) -> Manifest | None:
        """The manifest of the newest listed version that loads and verifies. Unusable
        ones above it (corrupt, unsigned, another instance) are logged and skipped, so
        one planted at the head stops no node; the newest is read again each sync (a
        good version may replace it)."""
        newest = index.head
        for version in reversed(index.versions):
            for kind in ("delta", "anchor"):
                skipped = (kind, version) in self._unusable and version != newest
                if _listed(index, kind, version) and not skipped:
                    manifest = self._usable(kind, version)
                    if manifest is not None:
                        return manifest
        return None

    def _newest_usable_anchor(self, index: chain.VersionIndex, head: int) -> int | None:
        for version in sorted((a for a in index.anchors if a <= head), reverse=True):
            if ("anchor", version) not in self._unusable and self._usable("anchor", version):
                return version
        return None

    def _usable(self, kind: Kind, version: int) -> Manifest | None:
        """The manifest, or None (logged once) when it fails to load or verify; a store
        failure or a missing manifest is raised."""
        try:
            manifest = self._manifest(kind, version)
        except StoreError:
            raise
        except DeltasyncError as exc:
            if (kind, version) not in self._unusable:
                log.warning(
                    "unusable manifest skipped",
                    run=self.run_name,
                    node=self.node_id,
                    kind=kind,
                    version=version,
                    error=str(exc),
                    error_type=type(exc).__name__,
                )
                metrics.refused(self.run_name, "rollout", exc)
            self._unusable[(kind, version)] = exc
            return None
        self._unusable.pop((kind, version), None)  # replaced by a good one since
        return manifest

    def _plan(self, index: chain.VersionIndex, held: int, head: int) -> list[Manifest] | None:
        """The delta manifests from ``held`` (exclusive) to ``head``, in chain order;
        None when the chain does not lead back to ``held``."""
        return chain.deltas_after(held, head, index.deltas, lambda v: self._manifest("delta", v))

    def _anchor_is_cheaper(self, anchor: int, path: list[Manifest]) -> bool:
        anchor_bytes = sum(o.size for o in self._manifest("anchor", anchor).objects)
        chain_bytes = sum(o.size for m in path for o in m.objects)
        after_anchor = sum(o.size for m in path if m.version > anchor for o in m.objects)
        return anchor_bytes + after_anchor < chain_bytes

    def _bootstrap(self, index: chain.VersionIndex, top: Manifest) -> None:
        head = top.version
        anchor = self._newest_usable_anchor(index, head)
        if anchor is None:
            raise ChainError(f"run {self.run_name}: no usable anchor at or below head v{head}")
        store_state = (anchor, head, top.created)  # tells a republished head apart
        planned: list[Manifest] | None = None
        floor = self.floor
        if floor is not None and anchor < floor and head > anchor:
            # Below the floor on the way up: only when the chain leads past it.
            planned = self._plan(index, anchor, head)
            if planned is None:
                raise ChainError(
                    f"run {self.run_name}: no delta chain from anchor v{anchor} to head "
                    f"v{head}; not loading an anchor below this node's floor v{floor}"
                )
        if self._stuck_on == store_state and self._applied is not None:
            # The same store state already failed to replay: keep what we hold, and
            # do not download the anchor again until the store changes.
            raise self.last_error or ChainError(
                f"run {self.run_name}: chain from anchor v{anchor} to v{head} does not apply"
            )
        target = self.target
        if isinstance(target, RemoteTarget):
            self._hand_over([top])  # its workers build the head from its anchor and chain
            self._need_bootstrap = False
            return
        manifest = self._manifest("anchor", anchor)
        # Every tensor of the anchor is held with its dtype and shape (checked before
        # anything is written; the target checks that nothing it holds is left out).
        check_tensors(manifest, target.specs(), holder="the target")
        log.info("bootstrapping", run=self.run_name, anchor=anchor, head=head)
        started = time.perf_counter()
        ahead = self.options.prefetch_depth if self.options.prefetch else 1
        # Serving a version: prove the whole anchor (sizes, sha256, tensor hashes) before
        # the first weight is overwritten, so a damaged anchor leaves the served version
        # intact rather than a mix of two versions.
        whole = self._applied is not None
        load: Callable[[], None]
        if manifest.is_pieced:
            if not target.capabilities.pieces:
                raise TargetError(
                    f"run {self.run_name} is sharded (tensors in pieces): target "
                    f"{type(target).__name__} cannot apply its versions"
                )
            pieces = stream_anchor_pieces(self.store, manifest, self._submit, ahead, self.progress)
            load = partial(target.load_pieces, iter(list(pieces)) if whole else pieces)
        else:
            # stream_anchor checks each tensor against these hashes as it comes.
            hashes = {t.name: t.hash for t in manifest.tensors}
            tensors = stream_anchor(self.store, manifest, self._submit, ahead, self.progress)
            load = partial(target.load_state, iter(list(tensors)) if whole else tensors, hashes)
        self._stuck_on = store_state
        self._hold(None, manifest.instance)  # mid-load the target holds no provable version
        target.use_content_hash(manifest.content_hash)
        load()
        load_s = time.perf_counter() - started
        self._need_bootstrap = False
        self._set_applied(manifest)
        self.report.applied(manifest, fetch_s=0.0, apply_s=load_s, pause_s=load_s)
        if head > anchor:
            path = planned or self._plan(index, anchor, head)
            if path is None:
                raise ChainError(
                    f"run {self.run_name}: no delta chain from anchor v{anchor} to head v{head}"
                )
            self._apply_chain(path)
        self._stuck_on = None

    def _apply_chain(self, path: list[Manifest]) -> None:
        """Apply deltas in order; downloads run ahead of the applies."""
        if isinstance(self.target, RemoteTarget):
            self._hand_over(path)
            return
        pending: deque[Future[Fetched]] = deque()
        todo = deque(path)
        depth = self.options.prefetch_depth if self.options.prefetch else 1
        have = None if self.early is None else self.early.data  # early downloads, if any
        try:
            while todo or pending:
                while todo and len(pending) < depth:
                    pending.append(
                        self._submit(fetch_delta, self.store, todo.popleft(), self.progress, have)
                    )
                self._apply_one(pending.popleft().result())
        finally:
            for future in pending:
                future.cancel()

    def _hand_over(self, path: list[Manifest]) -> None:
        """A remote target brings itself to each version of ``path`` in turn."""
        target = self.target
        assert isinstance(target, RemoteTarget)
        for manifest in path:
            if self._applied is None and target.holds(manifest):
                log.info("target holds the version already", version=manifest.version)
                self._set_applied(manifest)
                continue
            started = time.perf_counter()
            target.bring_to(manifest, self.verify)
            spent = time.perf_counter() - started
            self._set_applied(manifest)
            log.info(
                "applied", run=self.run_name, version=manifest.version, pause_s=round(spent, 4)
            )
            self.report.applied(manifest, fetch_s=0.0, apply_s=spent, pause_s=spent)

    def _apply_one(self, fetched: Fetched) -> None:
        target = self.target
        assert not isinstance(target, RemoteTarget)  # handed over instead
        manifest = fetched.manifest
        if manifest.parent != self._applied:
            raise ChainError(
                f"run {self.run_name} v{manifest.version}: parent v{manifest.parent} is not "
                f"the held v{self._applied}"
            )
        started = time.perf_counter()
        early = [] if self.early is None else self.early.proofs(manifest)
        early_fetched = 0 if self.early is None else self.early.taken(manifest.version)
        try:
            report = target.apply_delta(manifest, fetched.objects, self.verify, early)
        except MismatchError:
            self._need_bootstrap = True  # the held weights may be what is wrong
            raise
        finally:
            if self.early is not None:
                self.early.forget(manifest.version)
        apply_s = time.perf_counter() - started
        faults.point("rollout.after_apply")
        self._set_applied(manifest)
        log.info(
            "applied",
            run=self.run_name,
            version=manifest.version,
            tensors=report.tensors,
            changed=report.changed,
            fetch_s=round(fetched.fetch_s, 4),
            apply_s=round(apply_s, 4),
            pause_s=round(report.pause_s, 4),
            early_parts=early_fetched,
            early_tensors=report.early_tensors,
            walked=report.walked,
        )
        self.report.applied(manifest, fetched.fetch_s, apply_s, report.pause_s, early_fetched)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if not self.options.prefetch:
            future: Future[Any] = Future()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltasync-fetch")
        return self._pool.submit(fn, *args)

    def _manifest(self, kind: Kind, version: int) -> Manifest:
        """A validated (and, with a public key, signature-checked) manifest; cached, as
        manifests are write-once."""
        key = (kind, version)
        manifest = self._manifests.get(key)
        if manifest is None:
            store = trusted(self.store, self.public_key)
            manifest = chain.load_manifest(store, self.run_name, kind, version)
            self._check_instance(manifest)
            if self.public_key is not None:
                self._highest = max(self._highest or 0, manifest.version)
            self._manifests[key] = manifest
        return manifest

    def _check_instance(self, manifest: Manifest) -> None:
        """SignatureError for a manifest of another instance of the run (an old run's
        signed versions under a reused name and key), or one without an instance where
        the run's record says every manifest has one.

        With a key, the record (``run.json``) must be signed by it, every manifest must
        carry its instance, and the instance must be the one this node has followed
        (pinned beside its state file): none of this needs Redis, so a node without it,
        or after Redis lost its data, refuses another instance's versions too."""
        key = self._key()
        if self._instance is None:
            record = run_binding.read_instance(self.store, self.run_name, key)
            if record is not None and key is not None:
                pinned = read_pin(self.state_path, self.run_name)
                if pinned is not None and pinned != record.instance:
                    where = pin_path(self.state_path) if self.state_path else "its pin"
                    raise SignatureError(
                        f"run {self.run_name}: the store holds instance {record.instance[:8]}, "
                        f"this node follows instance {pinned[:8]}; if the run was started "
                        f"anew on purpose, remove {where}"
                    )
            self._instance = record
        record = self._instance
        name = f"{manifest.kind} {manifest.version} of run {self.run_name}"
        if record is None:
            if key is not None:
                raise SignatureError(
                    f"{name}: the run has no run record ({run_binding.record_key(self.run_name)})"
                    " to check its instance against"
                )
            return  # a run older than instance ids
        if manifest.instance is None and (key is not None or manifest.version >= record.since):
            raise SignatureError(f"{name} carries no run instance")
        if manifest.instance is not None and manifest.instance != record.instance:
            raise SignatureError(
                f"{name} belongs to another instance of the run ({manifest.instance[:8]}, "
                f"not {record.instance[:8]})"
            )

    def _key(self) -> Ed25519PublicKey | None:
        """The key manifests and the run record must be signed by, or None."""
        return self.public_key if self.public_key is not None else store_key(self.store)

    def _set_applied(self, manifest: Manifest) -> None:
        self._hold(manifest, manifest.instance)
        if manifest.instance not in (None, self._pinned) and self._key() is not None:
            assert manifest.instance is not None
            write_pin(self.state_path, self.run_name, manifest.instance)
            self._pinned = manifest.instance
        if self.on_applied is not None:
            self.on_applied(manifest)
        self.report.heartbeat(self._applied, self._state_hash)

    # -- failures --------------------------------------------------------------------

    def _on_error(self, exc: DeltasyncError) -> None:
        self.last_error = exc
        self._failures += 1
        backoff = min(
            self.options.max_backoff_s, self.options.poll_interval_s * 2 ** (self._failures - 1)
        )
        self._next_retry = time.monotonic() + backoff
        self._manifests.clear()  # a repaired store may answer differently
        if isinstance(exc, ChainError | ObjectNotFoundError) and not isinstance(exc, RollbackError):
            self._need_bootstrap = True  # broken chain or collected delta
        if isinstance(exc, SignatureError):
            self._need_bootstrap = False
        log.warning(
            "sync failed",
            run=self.run_name,
            node=self.node_id,
            held=self._applied,
            error=str(exc),
            error_type=type(exc).__name__,
            retry_in_s=round(backoff, 2),
        )
        self.report.failed(self._applied, exc)

    def _reached(self, until_version: int | None) -> bool:
        return (
            until_version is not None
            and self._applied is not None
            and self._applied >= until_version
        )


def _collected(before: chain.VersionIndex, after: chain.VersionIndex) -> bool:
    """Whether versions listed ``before`` are gone from the listing ``after``."""
    return bool(set(before.deltas) - set(after.deltas) or set(before.anchors) - set(after.anchors))


def _listed(index: chain.VersionIndex, kind: Kind, version: int) -> bool:
    return version in (index.deltas if kind == "delta" else index.anchors)


def _shown(version: int | None) -> str:
    return "none" if version is None else f"v{version}"
