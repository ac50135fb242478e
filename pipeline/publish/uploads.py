"""Uploading a version's objects in the background, and timing a publish's phases."""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import structlog

from pipeline.errors import ObjectNotFoundError
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.logs import Throttle
from pipeline.store.base import ObjectStore
from pipeline.testing import faults

log = structlog.get_logger(__name__)


@dataclass
class PublishTimings:
    """Seconds spent per phase of one publish."""

    read_s: float = 0.0
    verify_s: float = 0.0  # waiting for the hashes (base: is it the parent?; new)
    encode_s: float = 0.0
    upload_s: float = 0.0
    cache_s: float = 0.0  # bringing the state cache to the new version

    def as_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 4) for f in fields(self)}


class Clock:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        return elapsed


class Uploader:
    """Uploads a version's objects on one background thread, so the next part is read and
    encoded while the previous one travels; at most ``depth`` finished parts wait. A
    long publish logs its progress (``logs.PROGRESS_EVERY_S``)."""

    def __init__(self, store: ObjectStore, fault: str, timings: PublishTimings, depth: int = 1):
        self.store, self.fault, self.timings, self.depth = store, fault, timings, depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-upload")
        self.pending: deque[tuple[Future[float], Callable[[], None] | None]] = deque()
        self.progress = Throttle()
        self.objects = 0
        self.bytes = 0

    def _put(
        self, key: str, data: bytes, then: Callable[[], None] | None, sha256: str | None
    ) -> float:
        started = time.perf_counter()
        if sha256 is None or not holds(self.store, key, len(data), sha256):
            self.store.put(key, data)
        elapsed = time.perf_counter() - started
        self._progress(key, len(data))
        if then is not None:
            try:
                then()
            except Exception as exc:  # an announcement is a hint: it never fails a publish
                log.warning("after-upload callback failed", key=key, error=str(exc))
        return elapsed

    def _progress(self, key: str, size: int) -> None:
        self.objects += 1
        self.bytes += size
        if not self.progress.due():
            return
        seconds = self.progress.elapsed
        log.info(
            "upload progress",
            objects=self.objects,
            mb=round(self.bytes / 1e6, 1),
            seconds=round(seconds, 1),
            mb_per_s=round(self.bytes / 1e6 / max(seconds, 1e-9), 1),
            last=key,
        )

    def _collect(self) -> None:
        future, after = self.pending.popleft()
        self.timings.upload_s += future.result()
        faults.point(f"{self.fault}.after_upload")
        if after is not None:
            after()

    def submit(
        self,
        key: str,
        data: bytes,
        then: Callable[[], None] | None = None,
        *,
        after: Callable[[], None] | None = None,
        sha256: str | None = None,
    ) -> None:
        """Upload in the background. ``then`` runs on the upload thread once the object is
        stored (a hint: its errors are logged); ``after`` runs on the caller's thread once
        the upload is collected (its errors are raised). With ``sha256`` an object that
        already holds exactly those bytes is not uploaded again (a retried part)."""
        # The caller's log context (run, version, job) goes with the upload.
        context = contextvars.copy_context()
        future = self.pool.submit(context.run, self._put, key, data, then, sha256)
        self.pending.append((future, after))
        while len(self.pending) > self.depth:
            self._collect()

    def finish(self) -> None:
        """Wait for every upload; raises the first upload error."""
        while self.pending:
            self._collect()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def holds(store: ObjectStore, key: str, size: int, sha256: str) -> bool:
    """Whether ``key`` already holds exactly the ``size`` bytes of digest ``sha256``."""
    try:
        if not store.exists(key) or store.size(key) != size:
            return False
        return sha256_bytes(store.get(key)) == sha256
    except ObjectNotFoundError:
        return False
