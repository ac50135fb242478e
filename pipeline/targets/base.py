"""The interface a rollout node applies versions to.

Names are checkpoint (HF) names throughout; a target maps them onto its own
parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch

from pipeline.codec.api import HashedPatch
from pipeline.errors import TargetError
from pipeline.format.hashes.content_hashes import XXH3
from pipeline.format.manifest import Manifest, Piece
from pipeline.format.tensors import TensorSpec

__all__ = [
    "ApplyReport",
    "EarlyProof",
    "EarlyResult",
    "HeldWeights",
    "ProvenDigest",
    "Target",
    "TargetCapabilities",
    "TensorSpec",
    "VerifyMode",
]

VerifyMode = Literal["touched", "all", "none"]


@dataclass(frozen=True)
class ProvenDigest:
    """An early proof that kept only the hash after the patch (the tensor is walked
    when written, see :mod:`pipeline.targets.walking`)."""

    digest: str
    changed: int


EarlyResult = HashedPatch | ProvenDigest


@dataclass(frozen=True)
class EarlyProof:
    """A delta object decoded and hashed against a target's held weights before its
    manifest was read: what :func:`prove_entries` would compute for its tensors."""

    key: str  # the object's key in its version folder
    sha256: str  # of the object's bytes
    generation: str  # the target and its write count when made: stale after a write
    hashed: dict[str, EarlyResult]
    content_hash: str = XXH3  # the algorithm of its digests: others' proofs are ignored


@dataclass(frozen=True)
class ApplyReport:
    version: int
    tensors: int  # tensors patched
    changed: int  # elements written
    pause_s: float  # time the target was unavailable (the apply alone)
    walked: int = 0  # tensors decoded straight into the weights, no patch kept
    early_tensors: int = 0  # tensors whose early proofs stood in for decode and hash


@dataclass(frozen=True)
class TargetCapabilities:
    """What a target can do beyond the methods every target has; a rollout node reads
    it. ``early_proofs``: whether the target proves a delta object before its manifest
    exists, and how: ``"here"`` (``prove_object``, on the thread that downloaded the
    object, the proof handed back to ``apply_delta``), ``"handed"`` (``start_early_proof``,
    from the thread that drives the target, which proves where its weights are and
    keeps the proofs for its next ``apply_delta``) or ``"none"``. ``pieces``: it reads a
    sharded run's versions (tensors stored in pieces, ``load_pieces``)."""

    early_proofs: Literal["none", "here", "handed"] = "none"
    pieces: bool = False


class Target(ABC):
    """Something that holds weights and can be patched in place. The optional
    capabilities have safe defaults; a target that has one overrides its method and
    says so in ``capabilities``."""

    capabilities: ClassVar[TargetCapabilities] = TargetCapabilities()

    @abstractmethod
    def specs(self) -> dict[str, TensorSpec]:
        """Checkpoint name -> dtype and shape of every tensor the target holds."""

    @abstractmethod
    def load_state(
        self, tensors: Iterable[tuple[str, torch.Tensor]], hashes: Mapping[str, str] | None = None
    ) -> None:
        """Replace every tensor (bootstrap from an anchor or a reconstruction).
        ``hashes``: content hashes the caller proved the given tensors to have (a
        target may keep them as its held tensors' instead of hashing them again)."""

    @abstractmethod
    def apply_delta(
        self,
        manifest: Manifest,
        objects: dict[str, bytes],
        verify: VerifyMode,
        early: Sequence[EarlyProof] = (),
    ) -> ApplyReport:
        """Decode the delta against the held weights, check names, shapes, dtypes and
        the manifest's base, then apply all tensors or none; verify content hashes
        of the touched (or all) tensors afterwards. Raises a DeltasyncError and
        leaves the weights untouched when any check fails. ``early``: proofs from
        ``prove_object``, reused where the manifest names their object with the same
        sha256 and they were made against the held weights (others are ignored)."""

    @abstractmethod
    def hashes(
        self, names: Sequence[str] | None = None, algorithm: str | None = None
    ) -> dict[str, str]:
        """Content hashes of held tensors, by ``algorithm`` (a manifest's
        ``content_hash``, see pipeline.format.hashes.content_hashes; default: the one in use)."""

    @abstractmethod
    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """CPU copies of every tensor in checkpoint names (for dumps and checks)."""

    def use_content_hash(self, name: str) -> None:  # noqa: B027 (a default: nothing)
        """Hash held tensors with algorithm ``name`` from now on: a node says so at
        bootstrap, before any delta names the run's hash. By default nothing: the
        target takes the algorithm from each manifest it applies."""

    def load_pieces(self, pieces: Iterable[tuple[str, Piece, torch.Tensor]]) -> None:
        """Replace every tensor from (name, piece, its 1-D elements): each piece copied
        into its flat range of the held tensor; every element must be given once
        (``capabilities.pieces``)."""
        raise TargetError(f"target {type(self).__name__} cannot apply a sharded run's versions")

    def prove_object(self, key: str, data: bytes, sha256: str) -> EarlyProof:
        """Decode and hash object ``key`` (of sha256 ``sha256``) against the held
        weights; nothing is written. Valid until the next write
        (``capabilities.early_proofs == "here"``)."""
        raise TargetError(f"target {type(self).__name__} cannot prove objects early")

    def start_early_proof(self, key: str, data: bytes, sha256: str) -> bool:
        """Start proving object ``key`` (bytes checked against ``sha256``) against the
        held weights, from the thread that drives the target; nothing is written, and
        the next ``apply_delta`` uses the proofs that hold. False when the target cannot
        take it now, and always by default (``capabilities.early_proofs == "handed"``)."""
        return False


class HeldWeights(Protocol):
    """What a target supplies to the one path that proves and writes a delta
    (:func:`pipeline.targets.proving.prove_and_write`): how its held weights are read
    and hashed, and what surrounds a write. The checks of a manifest against the
    target (names, base) and the caches kept stay the target's own."""

    def specs(self) -> dict[str, TensorSpec]:
        """Checkpoint name -> dtype and shape of every held tensor."""

    def tensor(self, name: str) -> torch.Tensor:
        """The held tensor a delta decodes against and is written into (contiguous,
        checkpoint layout, its exact current contents)."""

    def held_hash(self, name: str) -> str:
        """The content hash (the one in use) the held tensor is known by."""

    def canonical(self, name: str) -> str:
        """The name a tensor is held under (tied names share one: written once)."""

    def writing(self, names: Sequence[str]) -> AbstractContextManager[object]:
        """Entered after the proof, around the write of tensors ``names``: refuse what
        cannot be written, make early proofs stale, lock out readers, wait for the
        device."""
