"""Early proofs made on a thread of their own, next to the weights they read.

A vLLM node cannot prove a hinted part on its own threads: the weights it checks
(each worker's shadow) live in the engine's workers, reached only through calls
from the thread that drives the engine. So the node hands each early download to
the workers, and each worker proves it with a ``BackgroundProofs`` while the
engine keeps serving. The apply that follows takes the proofs; every write to the
weights first waits for running proofs and drops them all, so a proof never reads
a tensor being written and never outlives the weights it was made against.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch

from pipeline.format.hashes.content_hashes import XXH3_ALGORITHM, HashAlgorithm
from pipeline.targets.base import EarlyProof
from pipeline.targets.proving import DEFAULT_PATCH_MEMORY_BYTES, PatchAllowance, prove_object

log = structlog.get_logger(__name__)

MAX_PROOFS = 256  # proofs held ahead of their apply at most (as the node's early parts)


class BackgroundProofs:
    """Early proofs of delta objects against ``base`` weights, one at a time on a
    thread of their own."""

    def __init__(
        self,
        base: Callable[[str], torch.Tensor],
        algorithm: Callable[[], HashAlgorithm] = lambda: XXH3_ALGORITHM,
        held_hash: Callable[[str], str] | None = None,
    ) -> None:
        """``algorithm()``: the content hash in use; an incremental one is proven
        from ``held_hash(name)`` and the changes (see ``prove_incremental``)."""
        self._base = base
        self._algorithm = algorithm
        self._held_hash = held_hash
        self._writes = 0
        # The budget for patches the proofs keep until the next write (set by the
        # worker from each proof's request: DELTASYNC_PATCH_MEMORY_MB).
        self.patch_memory_bytes = DEFAULT_PATCH_MEMORY_BYTES
        self._kept = PatchAllowance(lambda: self.patch_memory_bytes)
        self._proofs: dict[tuple[str, str], Future[EarlyProof]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def generation(self) -> str:
        """Changes with every write to the weights: proofs made before it are stale."""
        return str(self._writes)

    def start(self, key: str, data: bytes, sha256: str) -> bool:
        """Start proving object ``key`` (whose bytes the caller checked against
        ``sha256``); False when it is already started or too many are held."""
        with self._lock:
            if (key, sha256) in self._proofs or len(self._proofs) >= MAX_PROOFS:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltasync-early-proof")
            generation = self.generation
            self._proofs[(key, sha256)] = self._pool.submit(
                self._prove, key, data, sha256, generation
            )
        return True

    def _prove(self, key: str, data: bytes, sha256: str, generation: str) -> EarlyProof:
        return prove_object(
            key,
            data,
            sha256,
            generation,
            self._base,
            self._algorithm(),
            self._held_hash,
            self._kept.admit,
        )

    def take(self) -> list[EarlyProof]:
        """Wait for every proof started, then hand over those made against the weights
        as they are now; none is kept. A proof that failed is left out (the apply
        proves its tensors itself)."""
        with self._lock:
            futures = list(self._proofs.values())
            self._proofs.clear()
        proofs: list[EarlyProof] = []
        for future in futures:
            try:
                proof = future.result()
            except Exception as exc:  # an early proof never fails an apply
                log.info("early proof not used", error=str(exc))
                continue
            if proof.generation == self.generation:
                proofs.append(proof)
        return proofs

    def wrote(self) -> None:
        """A write to the weights begins: wait for running proofs and drop them all."""
        self.take()
        with self._lock:
            self._writes += 1
        self._kept.reset()

    def close(self) -> None:
        self.wrote()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
