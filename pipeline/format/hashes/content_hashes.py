"""The tensor content hashes a manifest may name, by name: the one definition that
publishing, verification, compaction, the state cache and every target use.

A run's first anchor fixes its algorithm; every later version of the run carries the
same one. Schema 1 manifests name none: they are ``xxh3-128``, a hash of the bytes
that must be recomputed in full after any change. Schema 2 manifests name theirs;
new runs use ``mixsum-128`` (:mod:`pipeline.format.hashes.mixsum`), which is updated from the
changed elements alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError, CorruptObjectError
from pipeline.format.hashes.digests import CONTENT_HASH

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from pipeline.format.manifest import Manifest
    from pipeline.format.regions import Region

    Positions = torch.Tensor | npt.NDArray[np.int64]
    Values = torch.Tensor | npt.NDArray[Any]

XXH3 = CONTENT_HASH
MIXSUM = "mixsum-128"  # (pipeline.format.hashes.mixsum)
DEFAULT = MIXSUM  # what a new run's first anchor fixes

# The hashing modules (torch, compiled loops) are imported where a tensor is hashed:
# reading a manifest names its algorithm and hashes nothing.


def _xxh3_full(tensor: torch.Tensor) -> str:
    from pipeline.format.hashes.hashing import content_hash

    return content_hash(tensor)


def _mixsum_full(tensor: torch.Tensor) -> str:
    from pipeline.format.hashes.mixsum import full

    return full(tensor)


@dataclass(frozen=True)
class HashAlgorithm:
    name: str
    full: Callable[[torch.Tensor], str]  # the digest of a whole tensor's bits
    incremental: bool  # whether :meth:`updated` applies

    def piece(self, tensor: torch.Tensor, where: Region | None) -> str:
        """The digest of ``tensor``'s elements as the elements of region ``where`` of a
        larger tensor (None: the tensor itself): what a rank holding that piece
        contributes (see :meth:`combine`)."""
        if where is not None and tensor.numel() != where.numel:
            raise CorruptObjectError(
                f"a piece of {tensor.numel()} elements is hashed as {where.numel} of its tensor"
            )
        if where is None or (where.is_contiguous and where.start == 0):
            return self.full(tensor)
        if not self.incremental:
            raise ConfigError(f"content hash {self.name} cannot hash a piece of a tensor")
        from pipeline.format.hashes.mixsum import digest, runs_lanes

        return digest(runs_lanes(tensor, *where.runs))

    def combine(self, digests: Sequence[str]) -> str:
        """The digest of a tensor from the digests of pieces covering it once."""
        if len(digests) == 1:
            return digests[0]
        if not self.incremental:
            raise ConfigError(f"content hash {self.name} cannot combine pieces")
        from pipeline.format.hashes.mixsum import total

        return total(digests)

    def updated(self, held: str, positions: Positions, old: Values, new: Values, width: int) -> str:
        """The digest after the elements at ``positions`` change from ``old`` to
        ``new`` (integer contents of ``width`` bytes), from the digest before."""
        if not self.incremental:
            raise ConfigError(f"content hash {self.name} cannot be updated from changes")
        from pipeline.format.hashes.mixsum import updated

        return updated(held, positions, old, new, width)

    def updated_many(
        self,
        helds: Sequence[str],
        positions: npt.NDArray[np.int64],
        old: npt.NDArray[Any],
        new: npt.NDArray[Any],
        bounds: Sequence[int],
        width: int,
    ) -> list[str]:
        """:meth:`updated` of several tensors whose changes lie back to back in CPU
        arrays: tensor k has digest ``helds[k]`` before and changes ``[bounds[k],
        bounds[k + 1])``."""
        if not self.incremental:
            raise ConfigError(f"content hash {self.name} cannot be updated from changes")
        from pipeline.format.hashes.mixsum import updated_many

        return updated_many(helds, positions, old, new, bounds, width)

    def gathered(
        self,
        held: str,
        flat: torch.Tensor,
        positions: npt.NDArray[np.int64],
        diffs: Values,
        where: Region | None = None,
    ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(digest after, positions, old, new) of the change ``diffs`` (new - old in
        the integer view, as a delta's streams give it) at ``positions`` of ``flat``
        (a held tensor's flat integer view, only read): the old contents are read at
        the changed positions once, on the tensor's device (see
        :func:`pipeline.format.hashes.mixsum.gathered_update`). With ``where``,
        ``flat`` is the piece of region ``where`` of its tensor: positions index the
        piece, the digest mixes them as the tensor's."""
        if not self.incremental:
            raise ConfigError(f"content hash {self.name} cannot be updated from changes")
        import numpy as np

        steps = diffs if isinstance(diffs, np.ndarray) else diffs.cpu().numpy()
        runs = None if where is None else where.runs
        from pipeline.format.hashes.mixsum import gathered_update

        return gathered_update(held, flat, positions, steps, runs=runs)


ALGORITHMS: dict[str, HashAlgorithm] = {
    XXH3: HashAlgorithm(XXH3, _xxh3_full, incremental=False),
    MIXSUM: HashAlgorithm(MIXSUM, _mixsum_full, incremental=True),
}

XXH3_ALGORITHM = ALGORITHMS[XXH3]


def get(name: str) -> HashAlgorithm:
    """The algorithm ``name``; CorruptObjectError for one this build does not know."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise CorruptObjectError(
            f"unknown content hash {name!r} (known: {', '.join(sorted(ALGORITHMS))})"
        ) from None


def of(manifest: Manifest) -> HashAlgorithm:
    """The algorithm of a manifest's tensor hashes."""
    return get(manifest.content_hash)
