"""The vLLM worker side's state and answers (see ``pipeline.targets.vllm.extension``;
the requests it takes are typed in ``pipeline.targets.vllm.protocol``).

Every RPC answers with an envelope, ``{"ok": True, "value": ...}`` or ``{"ok": False,
"error": class name, "message": ...}``, so errors survive the trip whatever the
executor. ``WorkerState`` is what each worker keeps: the shadow (checkpoint-named
weights on CPU), its cached hashes, where each tensor lives in the model, early
proofs of the next delta's parts, and a delta prepared but not yet committed. It is
the ``HeldWeights`` the one prove-and-write path reads and writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from pipeline.errors import DeltasyncError, TargetError
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.hashes.hashing import state_hash
from pipeline.targets.base import TensorSpec
from pipeline.targets.early_proofs import BackgroundProofs
from pipeline.targets.vllm.mapping import Placement, Route
from pipeline.targets.walking import Written

log = structlog.get_logger(__name__)

Envelope = dict[str, Any]


def ok(value: object = None) -> Envelope:
    return {"ok": True, "value": value}


def failed(exc: BaseException) -> Envelope:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    name = type(exc).__name__ if isinstance(exc, DeltasyncError) else "TargetError"
    if not isinstance(exc, DeltasyncError):
        message = f"vLLM worker: {type(exc).__name__}: {message}"
    return {"ok": False, "error": name, "message": message}


def enveloped(call: Callable[[], object]) -> Envelope:
    try:
        return ok(call())
    except Exception as exc:
        log.warning("deltasync worker call failed", error=str(exc))
        return failed(exc)


@dataclass
class WorkerState:
    """What one vLLM worker holds for deltasync (kept on the worker object)."""

    shadow: dict[str, torch.Tensor] = field(default_factory=dict)
    hashes: dict[str, str] = field(default_factory=dict)  # cache; missing = not computed
    # The run's content hash (named by its manifests); ``hashes`` holds this one's.
    algorithm: HashAlgorithm = content_hashes.XXH3_ALGORITHM
    routes: dict[str, Route] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    staging: dict[str, torch.Tensor] | None = None
    pending: Written | None = None  # written to the shadow, not yet pushed into the model
    loaded: bool = False
    # A prepare running on a thread of its own while the engine keeps serving.
    preparing: threading.Thread | None = None
    prepared: Envelope | None = None
    # Part hints proven against the shadow before their manifest (early start).
    early: BackgroundProofs = field(init=False)

    def __post_init__(self) -> None:
        self.early = BackgroundProofs(self.tensor, lambda: self.algorithm, self.held_hash)

    def tensor(self, name: str) -> torch.Tensor:
        return self.shadow[name]

    def canonical(self, name: str) -> str:
        return name

    @contextmanager
    def writing(self, names: Sequence[str]) -> Iterator[None]:
        """Around a proven delta's write into the shadow (see ``HeldWeights``): every
        tensor must have its place in the model; early proofs go stale."""
        for name in names:
            if self.routes.get(name) is None:
                raise TargetError(f"tensor {name}: no place for it in the vLLM model")
        self.early.wrote()
        for name in names:
            self.hashes.pop(name, None)
        yield

    def undo(self, pending: Written) -> None:
        """Take a prepared delta back out of the shadow (the model is not touched)."""
        self.early.wrote()
        pending.rollback()
        for name in pending.touched:
            self.hashes.pop(name, None)
        self.pending = None

    def busy(self) -> bool:
        """A background prepare is running, or a prepared delta awaits its commit."""
        thread = self.preparing
        return self.pending is not None or (thread is not None and thread.is_alive())

    def check_idle(self) -> None:
        """Refuse to read or change the shadow while a background prepare writes it."""
        thread = self.preparing
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            raise TargetError("vLLM worker: a delta is being prepared (wait for its result)")

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in self.shadow.items()}

    def use(self, name: object) -> HashAlgorithm:
        """Hash with the algorithm ``name`` (a manifest's ``content_hash``; None:
        keep the one in use) from now on."""
        if isinstance(name, str) and name != self.algorithm.name:
            self.algorithm = content_hashes.get(name)
            self.hashes = {}
        return self.algorithm

    def state_hash(self) -> str:
        return state_hash((n, self.held_hash(n)) for n in self.shadow)

    def held_hash(self, name: str) -> str:
        digest = self.hashes.get(name)
        if digest is None:
            digest = self.algorithm.full(self.shadow[name])
            self.hashes[name] = digest
        return digest
