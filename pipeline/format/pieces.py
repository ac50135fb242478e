"""Tensors of a sharded run assembled from their pieces: the one place that turns the
pieces recorded part by part (each trainer rank's flat ranges) into manifest entries.

A piece's hash is its elements' content hash at their flat positions in the whole
tensor (``HashAlgorithm.piece``), so the tensor's hash is the sum of its pieces'
(``HashAlgorithm.combine``): nothing is gathered to hash a tensor no process holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.errors import MismatchError
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.manifest import Piece, TensorEntry
from pipeline.format.regions import Region, tiling_error


@dataclass(frozen=True)
class StoredPiece:
    """Flat elements ``[start, stop)`` of tensor ``name`` (``dtype``, full ``shape``),
    or with ``size`` the box ``offset``/``size`` (``start``/``stop`` its flat span),
    stored in ``object``: what a part records for each piece it holds."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    object: str
    hash: str
    changed: int = 0
    offset: tuple[int, ...] = ()
    size: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.piece().numel

    @property
    def region(self) -> Region:
        return self.piece().region(self.shape)

    def piece(self) -> Piece:
        return Piece(
            self.object, self.start, self.stop, self.hash, self.changed, self.offset, self.size
        )

    @classmethod
    def at(
        cls,
        name: str,
        dtype: str,
        region: Region,
        shape: tuple[int, ...],
        object: str,
        hash: str,
        changed: int = 0,
    ) -> StoredPiece:
        """The record of the piece of tensor ``name`` (full ``shape``) at ``region``."""
        p = Piece.at(object, region, hash, changed)
        return cls(name, dtype, shape, p.start, p.stop, object, hash, changed, p.offset, p.size)


def join_pieces(
    pieces: Iterable[StoredPiece], order: Sequence[str], algorithm: HashAlgorithm
) -> list[TensorEntry]:
    """The manifest entries of the tensors named in ``order``, from their ``pieces``
    (any order): each tensor's pieces sorted by start, checked to cover it once (flat
    ranges in a row, or boxes in a grid: pipeline.format.regions), its
    hash and change count their sums. Every entry lists its pieces, even a single one:
    a piece is stored as a 1-D tensor, which an entry without pieces is not.
    MismatchError names the first gap, overlap or disagreement."""
    by_name: dict[str, list[StoredPiece]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    extra = set(by_name) - set(order)
    if extra:
        raise MismatchError(f"a piece of tensor {sorted(extra)[0]!r} is not in the version")
    out: list[TensorEntry] = []
    for name in order:
        found = sorted(by_name.get(name, []), key=lambda p: p.start)
        if not found:
            raise MismatchError(f"no piece of tensor {name!r} is recorded")
        first = found[0]
        for p in found:
            if (p.dtype, p.shape) != (first.dtype, first.shape):
                raise MismatchError(
                    f"pieces of tensor {name!r} disagree: {p.dtype} {p.shape} against "
                    f"{first.dtype} {first.shape}"
                )
        gap = tiling_error(math.prod(first.shape), [p.region for p in found])
        if gap is not None:
            raise MismatchError(f"pieces of tensor {name!r}: {gap}")
        out.append(
            TensorEntry(
                name=name,
                dtype=first.dtype,
                shape=first.shape,
                hash=algorithm.combine([p.hash for p in found]),
                object=first.object,
                changed=sum(p.changed for p in found),
                pieces=tuple(p.piece() for p in found),
            )
        )
    return out
