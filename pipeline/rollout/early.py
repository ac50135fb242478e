"""Early starts for the rollout node: part hints turned into downloads and proofs.

When the diff job announces a part of the version after the held one (see
pipeline/coord/hints.py), the node downloads that object while later parts are
still being encoded, and the target decodes and hashes it against its held
weights too (``Target.capabilities.early_proofs``): on the download's thread
(``"here"``, the torch target), or once the node's thread hands the download over
(``"handed"``, ``hand_off``: the vLLM target, whose proofs run in the engine's workers
through calls that stay on the thread that drives the engine). Once the manifest is read,
objects whose sha256 it confirms are not downloaded again and their proofs are
reused; everything else goes the usual way. A hint can only save time: a wrong,
late or missing one changes nothing applied.

It pays where the node has cores of its own. Where replicas share cores with the
diff worker, their early work slows the diff, which decides when the version
exists (docs/PERFORMANCE.md), so nodes start early only when asked to
(``DELTASYNC_EARLY_START``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from pipeline.coord.events import DeltaPart
from pipeline.coord.hints import PartListener
from pipeline.errors import CorruptObjectError, DeltasyncError
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import Manifest, object_key
from pipeline.store.base import ObjectStore, read_bounded
from pipeline.targets.base import EarlyProof, Target

log = structlog.get_logger("pipeline.rollout.node")

MAX_EARLY_PARTS = 256  # parts held ahead of their manifest at most


@dataclass(frozen=True)
class EarlyPart:
    data: bytes
    proof: EarlyProof | None  # None: the target only takes early downloads


class EarlyParts:
    """Early downloads and proofs of the next version's parts, keyed by (version, key)."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        target: Target | None,
        held: Callable[[], int | None],
    ) -> None:
        """``target``: proves each early download (on the download's thread, or when
        handed over) if its capabilities say it can; None to download only."""
        self.store, self.run, self._held = store, run, held
        self._proofs = "none" if target is None else target.capabilities.early_proofs
        self.target = None if self._proofs == "none" else target  # None: downloads only
        self._pool: ThreadPoolExecutor | None = None
        self._parts: dict[tuple[int, str], tuple[str, Future[EarlyPart]]] = {}
        self._taken: set[tuple[int, str]] = set()  # early downloads handed to a fetch
        self._handed: set[tuple[int, str]] = set()  # early downloads handed to the target
        self._lock = threading.Lock()
        self._listener: PartListener | None = None

    def listen(self, client: Any) -> None:
        """Follow the run's hint channel on ``client`` (a Redis client)."""
        if self._listener is None:
            self._listener = PartListener(client, self.run, self.on_part).start()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            for _, future in self._parts.values():
                future.cancel()
            self._parts.clear()
            self._taken.clear()
            self._handed.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def on_part(self, hint: DeltaPart) -> None:
        """Start on a hinted part if it follows the held version."""
        if hint.run != self.run or hint.parent != self._held():
            return
        with self._lock:
            if (hint.version, hint.key) in self._parts or len(self._parts) >= MAX_EARLY_PARTS:
                return
            if self._pool is None:
                # Its own thread: downloads of whole versions wait on these, never the
                # reverse, so they cannot share the node's download threads.
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltasync-early")
            future = self._pool.submit(self._start, hint)
            self._parts[(hint.version, hint.key)] = (hint.sha256, future)

    def _start(self, hint: DeltaPart) -> EarlyPart:
        """Download the hinted object, check it is as hinted, and prove it if the target can.
        Read as the manifest's objects are (``read_bounded``): no more than the hinted
        size, and only from a regular file, so that a FIFO, device or huge (sparse) file
        in the hinted object's place is refused at once instead of blocking the node or
        filling its memory."""
        try:
            key = object_key(self.run, "delta", hint.version, hint.key)
            data = read_bounded(self.store, key, hint.size, what="hinted object")
            if len(data) != hint.size or sha256_bytes(data) != hint.sha256:
                raise CorruptObjectError(f"object {hint.key} of v{hint.version} is not as hinted")
            if self.target is None or self._proofs != "here":
                return EarlyPart(data, None)
            return EarlyPart(data, self.target.prove_object(hint.key, data, hint.sha256))
        except DeltasyncError as exc:  # kept for _ready; said now, while it is news
            log.info("early part refused", version=hint.version, key=hint.key, error=str(exc))
            raise

    @property
    def hands_off(self) -> bool:
        """Whether the node's thread must hand early downloads to the target."""
        return self._proofs == "handed"

    def handoff_due(self) -> bool:
        """Whether early downloads are on their way to a target they are handed to: the
        node's thread should call ``hand_off`` soon."""
        if not self.hands_off:
            return False
        with self._lock:
            return any(k not in self._handed for k in self._parts)

    def hand_off(self) -> int:
        """Start the target's proof of each finished early download not handed to it
        yet (a target whose ``early_proofs`` are ``"handed"`` only). Call it from the
        thread that drives the target. Returns how many proofs were started."""
        target = self.target
        if target is None or not self.hands_off:
            return 0
        with self._lock:
            done = [
                (k, sha256, f)
                for k, (sha256, f) in self._parts.items()
                if k not in self._handed and f.done()
            ]
            self._handed.update(k for k, _, _ in done)
        started = 0
        for (version, key), sha256, future in done:
            if future.cancelled() or future.exception() is not None:
                continue  # the apply downloads it again, and says why (_ready)
            part = future.result()
            try:
                started += target.start_early_proof(key, part.data, sha256)
            except DeltasyncError as exc:  # an early start never fails an apply
                log.info("early proof not started", version=version, key=key, error=str(exc))
        return started

    def _ready(self, version: int, key: str, sha256: str) -> EarlyPart | None:
        with self._lock:
            found = self._parts.get((version, key))
        if found is None or found[0] != sha256:
            return None
        try:
            return found[1].result()
        except Exception as exc:  # an early start never fails an apply
            log.info("early part not used", version=version, key=key, error=str(exc))
            return None

    def data(self, version: int, key: str, sha256: str) -> bytes | None:
        """The object's bytes if an early start fetched exactly these (waits for it)."""
        ready = self._ready(version, key, sha256)
        if ready is None:
            return None
        with self._lock:
            self._taken.add((version, key))
        return ready.data

    def taken(self, version: int) -> int:
        """How many objects of ``version`` were served from early downloads."""
        with self._lock:
            return sum(1 for v, _ in self._taken if v == version)

    def proofs(self, manifest: Manifest) -> list[EarlyProof]:
        """The finished early proofs of ``manifest``'s objects, as the manifest lists
        them (the target checks the rest: generation, tensor placement, hashes)."""
        found = (self._ready(manifest.version, o.key, o.sha256) for o in manifest.objects)
        return [ready.proof for ready in found if ready is not None and ready.proof is not None]

    def started(self, version: int) -> int:
        """How many parts of ``version`` have an early start."""
        with self._lock:
            return sum(1 for v, _ in self._parts if v == version)

    def forget(self, upto: int) -> None:
        """Drop what was started for versions up to ``upto``."""
        with self._lock:
            for key in [k for k in self._parts if k[0] <= upto]:
                self._parts.pop(key)[1].cancel()
            self._taken = {k for k in self._taken if k[0] > upto}
            self._handed = {k for k in self._handed if k[0] > upto}
