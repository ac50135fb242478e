"""Torch target: a state dict or an nn.Module (CPU or GPU) patched in place.

Tensors keep their identity: patches are written into the existing storage, so
a live model sees the new weights without any reallocation. Tied weights (two
checkpoint names on one storage, e.g. ``lm_head.weight`` and
``model.embed_tokens.weight``) are one tensor here: a checkpoint may carry
either name or both, and a patch is applied once.

``lock`` is held while weights are written; a server that must never read a
half-written model can hold it around its forward passes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import structlog
import torch
from torch import nn

from pipeline import collector
from pipeline.errors import MismatchError, TargetError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.hashes.hashing import state_hash
from pipeline.format.manifest import Manifest, TensorEntry, dtype_name
from pipeline.format.matching import check_tensors
from pipeline.format.regions import Region, tiling_error
from pipeline.targets.base import (
    ApplyReport,
    EarlyProof,
    Target,
    TargetCapabilities,
    TensorSpec,
    VerifyMode,
)
from pipeline.targets.patching import check_objects, int_view
from pipeline.targets.pieced import AnchorPiece
from pipeline.targets.proving import (
    DEFAULT_PATCH_MEMORY_BYTES,
    PatchAllowance,
    check_base,
    early_results,
    prove_and_write,
    prove_object,
)
from pipeline.targets.setup import TargetSetup, anchor_specs
from pipeline.testing import faults

log = structlog.get_logger(__name__)


def _alias_key(t: torch.Tensor) -> tuple[object, ...]:
    """Identical views of one storage share this key."""
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


def _sync(devices: Iterable[torch.device]) -> None:
    """Wait for queued GPU work, so timings and hashes see the written weights."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class TorchTarget(Target):
    """Weights held as torch tensors, by checkpoint name."""

    capabilities = TargetCapabilities(early_proofs="here", pieces=True)

    def __init__(
        self,
        weights: nn.Module | Mapping[str, torch.Tensor],
        *,
        patch_memory_bytes: int = DEFAULT_PATCH_MEMORY_BYTES,
    ) -> None:
        """``patch_memory_bytes``: decoded patches of one version kept in memory at
        most; a larger delta keeps none for the CPU tensors it can walk (their
        locked write then decodes too, a longer pause for far less memory)."""
        if isinstance(weights, nn.Module):
            # keep_vars: the Parameter objects themselves (parameters AND persistent
            # buffers, every name of a tied weight), not detached copies.
            source: Mapping[str, torch.Tensor] = weights.state_dict(keep_vars=True)
        else:
            source = weights
        self.lock = threading.RLock()  # held while weights are written
        self._write_lock = threading.RLock()  # serialises writers (apply, load)
        self._tensors: dict[str, torch.Tensor] = {}  # canonical name -> tensor
        self._canonical: dict[str, str] = {}  # every name -> canonical name
        self._names: list[str] = []  # every name, in source order
        by_storage: dict[tuple[object, ...], str] = {}
        for name, tensor in source.items():
            if not isinstance(tensor, torch.Tensor):
                raise TargetError(f"tensor {name!r}: not a torch.Tensor")
            t = tensor.detach()
            if t.device.type == "meta":
                raise TargetError(f"tensor {name!r}: on the meta device, it holds no data")
            if not t.is_contiguous():
                raise TargetError(f"tensor {name!r}: not contiguous, cannot be patched in place")
            key = _alias_key(t)
            canonical = by_storage.setdefault(key, name)
            self._canonical[name] = canonical
            self._names.append(name)
            if canonical == name:
                self._tensors[name] = t
        if not self._tensors:
            raise TargetError("torch target holds no tensors")
        self._devices = {t.device for t in self._tensors.values()}
        # Names as the checkpoint carries them (for export); all names until known.
        self._checkpoint_names: list[str] = list(self._names)
        self._hash_cache: dict[str, str] = {}  # canonical name -> content hash
        # The run's content hash (its manifests name it); the cache holds this one's.
        self._algorithm: HashAlgorithm = content_hashes.XXH3_ALGORITHM
        # This target and its writes so far: an early proof holds until the next write.
        self._token = uuid.uuid4().hex
        self._writes = 0
        self.patch_memory_bytes = patch_memory_bytes
        self._early_kept = PatchAllowance(lambda: self.patch_memory_bytes)
        self._pause_s = 0.0  # the last write's

    @classmethod
    def for_node(cls, setup: TargetSetup) -> TorchTarget | None:
        """A rollout node's torch target on ``setup.device``: the checkpoint at
        ``setup.model_path`` (a safetensors file or sharded folder: a node restarted
        with its own ``--dump`` resumes without a bootstrap), else empty tensors shaped
        like the newest anchor, which the bootstrap fills (waiting for the run's first
        anchor; None when stopped meanwhile)."""
        if setup.model_path is not None:
            with CheckpointReader(setup.model_path) as reader:
                tensors = {name: reader.get(name).to(setup.device) for name in reader.names()}
        else:
            specs = anchor_specs(setup.store, setup.run, setup.stop, setup.refused)
            if specs is None:
                return None
            tensors = {
                name: torch.empty(spec.shape, dtype=spec.dtype, device=setup.device)
                for name, spec in specs.items()
            }
        budget = setup.patch_memory_bytes
        return cls(
            tensors, patch_memory_bytes=DEFAULT_PATCH_MEMORY_BYTES if budget is None else budget
        )

    # -- introspection -------------------------------------------------------------

    def specs(self) -> dict[str, TensorSpec]:
        return {
            name: TensorSpec(t.dtype, tuple(t.shape))
            for name in self._names
            for t in (self._tensors[self._canonical[name]],)
        }

    def aliases(self) -> dict[str, str]:
        """Every name that shares storage with another -> the name it is held under."""
        return {n: c for n, c in self._canonical.items() if n != c}

    def tensor(self, name: str) -> torch.Tensor:
        """The live tensor held under a checkpoint name (shares storage with the model)."""
        return self._tensors[self._resolve(name, "target")]

    def _resolve(self, name: str, where: str) -> str:
        try:
            return self._canonical[name]
        except KeyError:
            raise MismatchError(
                f"tensor {name!r} from {where} is not in the torch target"
            ) from None

    def _check_spec(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], where: str
    ) -> None:
        held = self._tensors[self._canonical[name]]
        if held.dtype != dtype:
            raise MismatchError(
                f"tensor {name!r} from {where}: dtype {dtype_name(dtype)} but the target holds "
                f"{dtype_name(held.dtype)}"
            )
        if tuple(held.shape) != shape:
            raise MismatchError(
                f"tensor {name!r} from {where}: shape {list(shape)} but the target holds "
                f"{list(held.shape)}"
            )

    # -- hashes --------------------------------------------------------------------

    def hashes(
        self, names: Sequence[str] | None = None, algorithm: str | None = None
    ) -> dict[str, str]:
        """Fresh content hashes (computed now, not cached) of the named tensors, by
        ``algorithm`` (a manifest's ``content_hash``; default: the one in use)."""
        wanted = self._names if names is None else list(names)
        out: dict[str, str] = {}
        with self.lock:
            if algorithm is not None:
                self._use(content_hashes.get(algorithm))
            for name in wanted:
                canonical = self._resolve(name, "hashes()")
                digest = self._algorithm.full(self._tensors[canonical])  # computed now
                self._hash_cache[canonical] = out[name] = digest
        return out

    def use_content_hash(self, name: str) -> None:
        """Hash with ``name`` (the run's ``content_hash``) from now on: a node says so
        at bootstrap, so that early proofs before the first delta use it too."""
        with self._write_lock:
            self._use(content_hashes.get(name))

    def _use(self, algorithm: HashAlgorithm) -> None:
        """Hash with ``algorithm`` from now on (a run's manifests name it)."""
        if algorithm is not self._algorithm:
            self._algorithm = algorithm
            self._hash_cache.clear()
            self._wrote()  # early proofs hashed with the other one are stale

    def held_hash(self, name: str) -> str:
        return self._cached_hash(self._canonical[name])

    def _cached_hash(self, canonical: str) -> str:
        digest = self._hash_cache.get(canonical)
        if digest is None:
            digest = self._algorithm.full(self._tensors[canonical])
            self._hash_cache[canonical] = digest
        return digest

    # -- scrubbing -----------------------------------------------------------------

    def scrub_names(self) -> list[str]:
        """The held tensors a scrub pass re-hashes, by canonical name."""
        return list(self._tensors)

    def scrub_bytes(self, canonical: str) -> int:
        return self._tensors[canonical].nbytes

    def scrub(self, canonical: str) -> bool:
        """Re-hash one held tensor in full and compare it with the hash it is known by
        (False: its memory changed behind the target's back). Writers wait meanwhile;
        readers of ``lock`` do not. A tensor with no known hash is True (nothing to
        compare: its next use hashes it in full)."""
        with self._write_lock:
            known = self._hash_cache.get(canonical)
            if known is None:
                return True
            same = self._algorithm.full(self._tensors[canonical]) == known
            faults.point("target.mid_scrub")
            return same

    def state_hash(self, names: Iterable[str] | None = None) -> str:
        """State hash over the given checkpoint names (default: the checkpoint's names),
        from cached content hashes (each tensor is hashed at most once after it changes)."""
        wanted = self._checkpoint_names if names is None else names
        return state_hash((n, self._cached_hash(self._resolve(n, "state_hash()"))) for n in wanted)

    # -- whole-state load ----------------------------------------------------------

    def load_state(
        self, tensors: Iterable[tuple[str, torch.Tensor]], hashes: Mapping[str, str] | None = None
    ) -> None:
        """Copy every tensor in place. Each tensor's name, dtype and shape is checked
        before it is written; every held tensor must be given. A source that fails
        part way leaves a mix: callers must treat the target as holding no version.
        ``hashes``: content hashes (of the hash in use) the caller proved the given
        tensors to have, as a bootstrap checks each anchor tensor as it streams; they
        become the held tensors' hashes, so the next delta does not hash the whole
        model again."""
        seen: dict[str, str] = {}  # canonical -> first name given
        order: list[str] = []
        with self._write_lock, self.lock:
            self._hash_cache.clear()
            self._wrote()
            for name, src in tensors:
                canonical = self._resolve(name, "load_state")
                self._check_spec(name, src.dtype, tuple(src.shape), "load_state")
                order.append(name)
                dst = self._tensors[canonical]
                src_hash = None if hashes is None else hashes.get(name)
                # The incremental hash costs more in full: its first use computes it.
                eager = src.device.type == "cpu" and not self._algorithm.incremental
                if src_hash is None and eager:
                    src_hash = self._algorithm.full(src)
                if canonical in seen:
                    # The other name of a tied weight: must carry the same bits.
                    if src_hash is None:
                        src_hash = self._algorithm.full(src)
                    if src_hash != self._cached_hash(canonical):
                        raise MismatchError(
                            f"tensors {seen[canonical]!r} and {name!r} share storage in the "
                            "target but differ in load_state"
                        )
                    continue
                seen[canonical] = name
                # Bit copy through integer views: NaN payloads and -0.0 stay as they are.
                int_view(dst).copy_(int_view(src.detach().contiguous()))
                if src_hash is not None:
                    self._hash_cache[canonical] = src_hash
            missing = [c for c in self._tensors if c not in seen]
            if missing:
                raise MismatchError(
                    f"load_state did not provide tensor {missing[0]!r} "
                    f"({len(missing)} missing in all)"
                )
            _sync(self._devices)
            self._checkpoint_names = order

    def load_pieces(self, pieces: Iterable[AnchorPiece]) -> None:
        """Bootstrap from a sharded run's anchor: each 1-D piece is copied in place into
        its region of the held tensor (checked first: name, dtype, region). Every
        element of every held tensor must be given exactly once. A source that fails
        part way leaves a mix, as ``load_state``."""
        given: dict[str, list[Region]] = {}  # canonical -> regions written
        named: dict[str, str] = {}  # canonical -> the name its pieces came under
        order: list[str] = []
        with self._write_lock, self.lock:
            self._hash_cache.clear()
            self._wrote()
            for name, piece, src in pieces:
                canonical = self._resolve(name, "load_pieces")
                dst = self._tensors[canonical]
                if src.dtype != dst.dtype or src.dim() != 1 or src.numel() != piece.numel:
                    raise MismatchError(
                        f"tensor {name!r}: piece ({piece.describe()}) is {src.dtype} "
                        f"{list(src.shape)}, the target holds {dst.dtype}"
                    )
                try:
                    region = piece.region(tuple(dst.shape))
                except MismatchError:
                    raise MismatchError(
                        f"tensor {name!r}: piece ({piece.describe()}) is outside its "
                        f"{list(dst.shape)}"
                    ) from None
                if name not in order:
                    order.append(name)
                slot = region.take(int_view(dst))
                first = named.setdefault(canonical, name)
                if first != name:
                    # The other name of a tied weight: must carry the same bits.
                    if not torch.equal(slot, int_view(src.to(dst.device))):
                        raise MismatchError(
                            f"tensors {first!r} and {name!r} share storage in the target but "
                            "differ in load_pieces"
                        )
                    continue
                region.put(int_view(dst), int_view(src.detach().contiguous()))
                given.setdefault(canonical, []).append(region)
            for canonical, t in self._tensors.items():
                if tiling_error(t.numel(), given.get(canonical, [])) is not None:
                    raise MismatchError(
                        f"load_pieces did not provide every element of tensor {canonical!r} "
                        "exactly once"
                    )
            _sync(self._devices)
            self._checkpoint_names = order

    # -- delta apply ---------------------------------------------------------------

    @property
    def _generation(self) -> str:
        return f"{self._token}/{self._writes}"

    def _wrote(self) -> None:
        """A write begins: earlier proofs are stale, and so is what they kept."""
        self._writes += 1
        self._early_kept.reset()

    def prove_object(self, key: str, data: bytes, sha256: str) -> EarlyProof:
        """Decode and hash one delta object against the held weights before its
        manifest is known (a part hint); ``apply_delta(early=...)`` reuses the result
        if the manifest confirms the object and nothing was written meanwhile."""
        with self._write_lock, collector.held_off():
            return prove_object(
                key,
                data,
                sha256,
                self._generation,
                self.tensor,
                self._algorithm,
                self.held_hash,
                self._early_kept.admit,
            )

    def apply_delta(
        self,
        manifest: Manifest,
        objects: dict[str, bytes],
        verify: VerifyMode = "touched",
        early: Sequence[EarlyProof] = (),
    ) -> ApplyReport:
        """Check names/dtypes/shapes and the base, decode every patch and prove each
        touched tensor's result against the manifest on a scratch copy, then take
        ``lock`` only to write the patches. ``verify="all"`` also rehashes every tensor:
        the untouched ones before writing, the touched ones again after (a mismatch then
        restores the old contents at the patched positions). ``early`` proofs (see
        ``prove_object``) stand in for the decode and hash of their tensors. A delta
        whose patches would exceed ``patch_memory_bytes`` keeps none for the tensors it
        can walk: they are decoded again, straight into the weights, under ``lock``."""
        if verify not in ("touched", "all", "none"):
            raise TargetError(f"unknown verify mode {verify!r}")
        where = f"{manifest.run} v{manifest.version}"
        # Only writers take _write_lock, so the held weights stay as checked until the
        # write, while readers holding ``lock`` keep running meanwhile.
        with self._write_lock, collector.held_off():
            self._use(content_hashes.of(manifest))
            if verify == "all":
                self._hash_cache.clear()  # every held hash is recomputed in full
            entries = self._check_manifest(manifest, where)
            # Fresh hashes for "all", the hashes known since their last change else.
            names = [e.name for e in manifest.tensors]
            check_base(
                self,
                manifest.tensors,
                manifest.parent_state_hash,
                lambda: self.state_hash(names),
                where,
            )
            if manifest.kind != "delta":
                raise MismatchError(f"{where} is an {manifest.kind}, not a delta")
            check_objects(manifest, objects)
            vouched = {o.key: o.sha256 for o in manifest.objects}
            early_used = early_results(
                manifest.tensors, vouched, early, self._generation, self._algorithm.name
            )
            written = prove_and_write(
                self,
                manifest.tensors,
                objects,
                verify,
                self._algorithm,
                early_used,
                self.patch_memory_bytes,
            )
            for name in written.touched:
                canonical = self._canonical[name]
                self._hash_cache[canonical] = written.hashes.get(name, entries[canonical].hash)
            self._checkpoint_names = [e.name for e in manifest.tensors]
        log.debug(
            "delta applied",
            run=manifest.run,
            version=manifest.version,
            changed=written.changed,
            walked=len(written.walks),
        )
        return ApplyReport(
            version=manifest.version,
            tensors=len(written.touched),
            changed=written.changed,
            pause_s=self._pause_s,
            walked=len(written.walks),
            early_tensors=written.early_tensors,
        )

    def canonical(self, name: str) -> str:
        return self._canonical[name]

    @contextmanager
    def writing(self, names: Sequence[str]) -> Iterator[None]:
        """Around the write of a proven delta (see ``HeldWeights``): readers of ``lock``
        wait, and the pause they see is kept for the apply's report."""
        with self.lock:
            self._wrote()
            for name in names:
                self._hash_cache.pop(self._canonical[name], None)
            start = time.perf_counter()
            try:
                yield
            finally:
                _sync(self._devices)
                self._pause_s = time.perf_counter() - start

    def _check_manifest(self, manifest: Manifest, where: str) -> dict[str, TensorEntry]:
        """Every manifest tensor is held with its dtype and shape and every held tensor is
        named; returns the entry per held tensor (tied names must carry the same hash)."""
        check_tensors(manifest, self.specs(), holder="the torch target")
        entries: dict[str, TensorEntry] = {}
        for entry in manifest.tensors:
            canonical = self._canonical[entry.name]
            other = entries.setdefault(canonical, entry)
            if other.hash != entry.hash:
                raise MismatchError(
                    f"{where}: tied tensors {other.name!r} and {entry.name!r} have different "
                    "hashes in the manifest"
                )
        # Tied names share one tensor: naming either of them is enough.
        missing = [c for c in self._tensors if c not in entries]
        if missing:
            raise MismatchError(
                f"{where}: the delta does not name held tensor {missing[0]!r} "
                f"({len(missing)} missing in all)"
            )
        return entries

    # -- export --------------------------------------------------------------------

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """CPU copies under the names the checkpoint carries."""
        for name in list(self._checkpoint_names):
            with self.lock:
                copy = self._tensors[self._canonical[name]].to("cpu", copy=True)
            yield name, copy
