"""The diff worker's scrub of its state caches: each run's cached version re-hashed in
full in the background, like a replica's held tensors.

A proven cache is trusted between full hashes (a diff against it hashes only what
changes), so bytes that rot on disk, or are written by someone else, would go into
the next delta unseen. :class:`CacheScrub` re-hashes one cached tensor at a time
against the hash in the cached version's manifest (loaded from the store once per
version: the state file names only the state hash, and the store's manifest is the
signed truth). It hashes only under the cache's shared lock, and only while the
state file still names the switch the pass began on; a pass interrupted by a switch
starts over on the new state. A tensor that differs marks the cache damaged (its
state file removed, under the exclusive lock and only if nothing switched since):
the next diff rebuilds it from the store. Each finding is logged, counted in
``deltasync_scrub_mismatches`` and recorded for ``deltasync status``.

An unproven state (advanced in place, linked to the trainer's files, adopted
unproven) gets its one full proof here: a pass that matched every tensor of that
very state marks it proven, so later diffs skip hashing their base. Such passes run
as fast as the CPU share allows (no period); proven states are scrubbed at the
configured period, split between the runs. Caches of runs whose content hash is not
incremental are skipped: each diff hashes their whole base anyway.

A sharded run's rank caches (:class:`~pipeline.publish.caches.rank_cache.RankCache`,
``<run>/rank-<R>/``) are scrubbed the same way, each cached 1-D piece re-hashed as a
piece (``piece(tensor, start)``) against its ``Piece.hash`` in the manifest; a
mismatch forgets the rank cache, and the next step rebuilds it from the store.

:class:`CacheScrubber` runs the passes over every run under the cache folder on a
daemon thread; one process per cache folder scrubs (a lock file), and it yields
(up to :data:`MAX_YIELD_S` between tensors) while its process runs a job.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
import structlog

from pipeline import metrics
from pipeline.coord.problems import report_cache_damage
from pipeline.errors import ChainError, ConfigError, DeltasyncError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.scrub import Scrubber, ScrubPace
from pipeline.format.manifest import Kind, Manifest, check_run
from pipeline.format.regions import Region
from pipeline.publish.caches.rank_cache import RankCache
from pipeline.publish.caches.state_cache import CacheBusyError, StateCache
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)

MAX_YIELD_S = 10.0  # between tensors, a scrub waits at most this long for a running job
IDLE_S = 1.0  # between rounds that hashed nothing
SCRUB_LOCK = ".scrub.lock"  # in the cache folder: held by the one process scrubbing it


class CacheMovedError(ChainError):
    """The state cache switched during a scrub pass: the pass starts over."""


class CacheScrub:
    """:class:`~pipeline.format.hashes.scrub.Scrubbable` over the state ``cache`` holds,
    known by the hashes of its version's manifest in ``store``."""

    def __init__(self, cache: StateCache | RankCache, store: ObjectStore) -> None:
        self.cache = cache
        self.store = store
        self.proven = False  # the state being scrubbed is proven
        self.proofs = 0  # states this scrub proved
        self.damaged: tuple[int, str, str] | None = None  # last finding: version, tensor, note
        self._manifest: Manifest | None = None
        self._switched: str | None = None  # the switch this pass scrubs
        self._reader: CheckpointReader | None = None  # of the state this pass scrubs
        self._names: list[str] = []
        self._position: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._hashes: dict[str, tuple[Region | None, str]] = {}  # a piece's region, hash
        self._ok: set[str] = set()
        self._next = 0  # where the next pass begins: coverage goes on across switches

    def scrub_names(self) -> list[str]:
        """The cached tensors, from where the last pass left off; none when the cache
        holds nothing to scrub (no state, another state than the store's, a run
        hashed in full by every diff)."""
        state = self.cache.current()
        if state is None or not isinstance(state.get("switched"), str):
            self._forget()
            return []
        if state["switched"] != self._switched and not self._begin(state):
            self._forget()
            return []
        self.proven = state.get("proven") is True
        start = self._next % len(self._names)
        return self._names[start:] + self._names[:start]

    def scrub_bytes(self, name: str) -> int:
        return self._sizes.get(name, 0)

    def scrub(self, name: str) -> bool:
        """Re-hash one cached tensor in full; False when it differs from its version's
        hash (the cache is then marked damaged). True with nothing hashed once this
        pass marked the cache damaged (nothing left to compare). CacheMovedError when
        the cache switched since the pass began, CacheBusyError while it is written."""
        switched, reader, manifest = self._switched, self._reader, self._manifest
        if switched is None or reader is None or manifest is None:
            return True
        with self.cache.scrub_lock():
            state = self.cache.current()
            if state is None or state.get("switched") != switched:
                raise CacheMovedError(f"state cache {self.cache.root} switched during a scrub")
            region, expected = self._hashes[name]
            algorithm = content_hashes.of(manifest)
            # The same switch: the files the reader was opened on. Mapped for the hash
            # alone, so residency stays one tensor.
            got = reader.read_mapped(name, lambda view: algorithm.piece(view, region))
            same = got == expected
        self._next = self._position[name] + 1
        if same:
            self._ok.add(name)
            if not self.proven and len(self._ok) == len(self._names):
                self._prove(switched, manifest)
            return True
        # Judged under the exclusive lock: only a state nobody switched since is damaged.
        rewritten = isinstance(self.cache, StateCache) and not self.cache.linked_files_unchanged()
        if not self.cache.mark_damaged(switched):
            raise CacheMovedError(f"state cache {self.cache.root} switched during a scrub")
        note = (
            "a linked checkpoint file was modified after it was published"
            if rewritten
            else "the cached bytes changed on disk"
        )
        self.damaged = (manifest.version, name, note)
        self._forget()
        return False

    def _prove(self, switched: str, manifest: Manifest) -> None:
        if self.cache.mark_proven(switched):
            self.proven = True
            self.proofs += 1
            log.info(
                "state cache proven by a full scrub", run=self.cache.run, version=manifest.version
            )

    def _begin(self, state: dict[str, Any]) -> bool:
        """A pass over a state it has not scrubbed yet: its manifest, names and sizes."""
        version, state_hash = int(state["version"]), str(state["state_hash"])
        manifest = self._manifest
        if manifest is None or manifest.version != version or manifest.state_hash != state_hash:
            manifest = self._load(version)
        if manifest is None or manifest.state_hash != state_hash:
            return False
        if not content_hashes.of(manifest).incremental:
            return False
        hashes = self._expected(manifest)
        if hashes is None:
            return False
        reader = CheckpointReader(self.cache.root / str(state["folder"]))
        names = reader.names()
        sizes = {n: reader.nbytes(n) for n in names}
        self._manifest, self._switched, self._reader = manifest, str(state["switched"]), reader
        self._names, self._sizes = names, sizes
        self._position = {n: i for i, n in enumerate(names)}
        self._hashes = hashes
        self._ok = set()
        return bool(names)

    def _expected(self, manifest: Manifest) -> dict[str, tuple[Region | None, str]] | None:
        """Each cached tensor's hash in ``manifest`` (a rank cache's: its pieces', with
        their region); None when the cache does not hold that version."""
        cache = self.cache
        if isinstance(cache, StateCache):
            if not cache.is_valid_for(manifest):
                return None
            return {t.name: (None, t.hash) for t in manifest.tensors}
        keys = cache.keys_of(manifest)
        if not keys or not cache.is_valid_for(manifest, keys):
            return None
        return {
            entry.name: (entry.region(piece), piece.hash)
            for key, held in manifest.layout()
            if key in keys
            for entry, piece in held
        }

    def _load(self, version: int) -> Manifest | None:
        index = chain.list_versions(self.store, self.cache.run)
        if version not in index.versions:  # collected: the next diff rebuilds the cache anyway
            return None
        kind: Kind = "delta" if version in index.deltas else "anchor"
        return chain.load_manifest(self.store, self.cache.run, kind, version)

    def _forget(self) -> None:
        self._switched = self._reader = None
        self._ok = set()
        self.proven = False


_RANK_FOLDER = re.compile(r"rank-(\d{5})")


def _cache_name(run: str, rank: int | None) -> str:
    return run if rank is None else f"{run}/rank-{rank:05d}"


def _host_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._:@-]", "-", socket.gethostname())[:255]
    return name if name[:1].isalnum() else "diff-worker"


class CacheScrubber:
    """Scrub passes over the state cache of every run under ``cache_dir`` on a daemon
    thread until :meth:`stop`. A damaged cache is counted, logged and, with ``redis``,
    recorded under ``host`` for ``deltasync status``. ``busy()`` True: a job is
    running in this process (the scrub waits for it between tensors, up to
    ``max_yield_s`` each time)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        store: ObjectStore,
        pace: ScrubPace,
        *,
        redis_client: redis.Redis | None = None,
        host: str | None = None,
        busy: Callable[[], bool] | None = None,
        max_yield_s: float = MAX_YIELD_S,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.store = store
        self.pace = pace
        self.redis = redis_client
        self.host = host or _host_name()
        self._busy = busy or (lambda: False)
        self.max_yield_s = max_yield_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.scrubs: dict[str, CacheScrub] = {}
        self._scrubbers: dict[str, Scrubber] = {}
        self.found: list[tuple[str, int, str]] = []  # (run, version, tensor) found damaged

    def start(self) -> CacheScrubber:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="deltasync-cache-scrub", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop.clear()

    @property
    def hashed(self) -> int:
        return sum(s.hashed for s in self._scrubbers.values())

    def runs(self) -> list[str]:
        """The runs whose cache holds a version."""
        return sorted({run for run, _ in self.caches() if _ is None})

    def caches(self) -> list[tuple[str, int | None]]:
        """Every cache under the folder holding a version: (run, None) for a run's state
        cache, (run, rank) for a sharded run's rank cache."""
        found: list[tuple[str, int | None]] = []
        with contextlib.suppress(OSError):
            for path in sorted(self.cache_dir.iterdir()):
                if path.name.startswith(".") or not path.is_dir():
                    continue
                try:
                    run = check_run(path.name)
                except ConfigError:
                    continue
                if (path / StateCache.STATE).is_file():
                    found.append((run, None))
                for sub in sorted(path.glob("rank-*")):
                    m = _RANK_FOLDER.fullmatch(sub.name)
                    if m is not None and (sub / RankCache.STATE).is_file():
                        found.append((run, int(m.group(1))))
        return found

    def run_round(self) -> int:
        """One pass over every cache (each run's state cache and rank caches) at the
        pace; the tensors hashed."""
        caches = self.caches()
        names = {_cache_name(run, rank): (run, rank) for run, rank in caches}
        before = self.hashed
        for name, (run, rank) in names.items():
            if self._stop.is_set():
                break
            scrub = self.scrubs.get(name)
            if scrub is None:
                cache = (
                    StateCache(self.cache_dir, run)
                    if rank is None
                    else RankCache(self.cache_dir, run, rank)
                )
                scrub = self.scrubs[name] = CacheScrub(cache, self.store)
                self._scrubbers[name] = Scrubber(
                    scrub, self.pace, functools.partial(self._damaged, name), sleep=self._sleep
                )
            scrubber = self._scrubbers[name]
            try:
                if not scrub.scrub_names():
                    continue
                # An unproven state is proven as fast as the CPU share allows.
                period = self.pace.period_s / len(names) if scrub.proven else 0.0
                scrubber.pace = ScrubPace(period, self.pace.cpu_fraction)
                scrubber.run_pass()
            except (CacheMovedError, CacheBusyError) as exc:
                log.debug("cache scrub starts over", run=run, reason=str(exc))
            except (DeltasyncError, OSError) as exc:
                log.info("cache scrub pass failed", run=run, error=str(exc))
        for gone in set(self.scrubs) - set(names):
            del self.scrubs[gone], self._scrubbers[gone]
        return self.hashed - before

    def _damaged(self, name: str, _tensor: str) -> None:
        scrub = self.scrubs[name]
        finding, run = scrub.damaged, scrub.cache.run
        if finding is None:
            return
        version, tensor, note = finding
        if isinstance(scrub.cache, RankCache):
            note = f"rank {scrub.cache.rank}: {note}"
        self.found.append((run, version, tensor))
        metrics.scrub_mismatch(run, "diff")
        what = "rank cache" if isinstance(scrub.cache, RankCache) else "state cache"
        log.warning(
            f"{what} damaged: a tensor no longer matches its version's hash; "
            "the next step rebuilds the cache from the store",
            run=run,
            version=version,
            tensor=tensor,
            note=note,
        )
        if self.redis is not None:
            try:
                report_cache_damage(self.redis, run, self.host, version, tensor, note)
            except DeltasyncError as exc:
                log.warning("could not record the state-cache damage", error=str(exc))

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``, then for a running job to end (up to ``max_yield_s``);
        True: stop now."""
        if self._stop.wait(seconds):
            return True
        waited = 0.0
        while waited < self.max_yield_s and self._busy():
            if self._stop.wait(0.05):
                return True
            waited += 0.05
        return False

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._only_scrubber() as mine:
                while mine and not self._stop.is_set():
                    try:
                        hashed = self.run_round()
                    except Exception as exc:  # never end the thread: the next round retries
                        log.info("cache scrub round failed", error=str(exc))
                        hashed = 0
                    if not hashed and self._stop.wait(IDLE_S):
                        return
            if self._stop.wait(5 * IDLE_S):  # another process scrubs this folder
                return

    @contextlib.contextmanager
    def _only_scrubber(self) -> Iterator[bool]:
        """Held by the one process that scrubs ``cache_dir`` (others wait their turn)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cache_dir / SCRUB_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)
