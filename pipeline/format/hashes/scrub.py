"""Background scrub: held tensors re-hashed in full at a bounded pace, off the critical path.

A rollout node's apply proves only what it changes (the held hashes plus the changes,
see :mod:`pipeline.format.hashes.mixsum`), and a diff worker trusts a proven state
cache between full hashes; bytes that change behind their back (a bad DIMM or disk,
a stray write, a bug elsewhere) are caught here instead. A pass re-hashes every held
tensor against the hash it is known by; it runs on a thread of its own, one tensor
at a time, sleeping between tensors so that it uses at most ``cpu_fraction`` of the
cores it hashes on and takes about ``period_s`` for a full pass. Writers wait for
the tensor being hashed; readers never do. Used by rollout nodes
(:mod:`pipeline.rollout.node`) and diff workers (:mod:`pipeline.publish.caches.cache_scrub`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import structlog

from pipeline.errors import ConfigError
from pipeline.format.hashes import mixsum

log = structlog.get_logger(__name__)

DEFAULT_PERIOD_S = 600.0  # a full pass every 10 minutes
DEFAULT_CPU_FRACTION = 0.25


@dataclass(frozen=True)
class ScrubPace:
    period_s: float = DEFAULT_PERIOD_S  # a full pass takes about this long, at least
    cpu_fraction: float = DEFAULT_CPU_FRACTION  # of the hashing cores, at most

    def __post_init__(self) -> None:
        if not self.period_s >= 0:
            raise ConfigError(f"scrub period {self.period_s} s must be >= 0")
        if not 0 < self.cpu_fraction <= 1:
            raise ConfigError(f"scrub CPU fraction {self.cpu_fraction} must be in (0, 1]")

    def wait_after(self, hashed_s: float, share: float) -> float:
        """Seconds to sleep after hashing one tensor for ``hashed_s`` seconds, that
        tensor being ``share`` of the held bytes."""
        cores = mixsum.THREADS  # the full hash runs on this many threads
        by_cpu = hashed_s * cores * (1 - self.cpu_fraction) / self.cpu_fraction
        by_period = self.period_s * share - hashed_s
        return max(0.0, by_cpu, by_period)


@runtime_checkable
class Scrubbable(Protocol):
    """A target whose held tensors can be re-hashed against the hashes it knows."""

    def scrub_names(self) -> list[str]:
        """The tensors a pass re-hashes (the target's own names for them)."""

    def scrub_bytes(self, name: str) -> int:
        """Bytes of one of them (for the pace)."""

    def scrub(self, name: str) -> bool:
        """Re-hash one held tensor in full; False when it differs from its known hash."""


class Scrubber:
    """Scrub passes over ``target`` on a daemon thread until :meth:`stop`;
    ``on_mismatch(name)`` is called (on that thread) for a tensor that failed."""

    def __init__(
        self,
        target: Scrubbable,
        pace: ScrubPace,
        on_mismatch: Callable[[str], None],
        sleep: Callable[[float], bool] | None = None,
    ) -> None:
        self.target = target
        self.pace = pace
        self.on_mismatch = on_mismatch
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait  # True: stop now
        self._thread: threading.Thread | None = None
        self.hashed = 0  # tensors re-hashed

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="deltasync-scrub", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a pass stops after its tensor); :meth:`run_pass` and
        :meth:`start` work again after."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop.clear()

    def run_pass(self) -> list[str]:
        """One pass over every held tensor at the pace; the names that failed."""
        names = self.target.scrub_names()
        total = sum(self.target.scrub_bytes(n) for n in names) or 1
        failed: list[str] = []
        for name in names:
            if self._stop.is_set():
                break
            started = time.perf_counter()
            ok = self.target.scrub(name)
            hashed_s = time.perf_counter() - started
            self.hashed += 1
            if not ok:
                failed.append(name)
                log.warning("scrub: held tensor differs from its known hash", tensor=name)
                self.on_mismatch(name)
            if self._sleep(self.pace.wait_after(hashed_s, self.target.scrub_bytes(name) / total)):
                break
        return failed

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run_pass()
                if time.monotonic() - started < 1.0 and self._sleep(1.0):
                    return  # nothing held yet, or very little: no busy loop
            except Exception as exc:  # the target changed shape under a pass: next one
                log.info("scrub pass interrupted", error=str(exc))
                if self._sleep(1.0):
                    return
