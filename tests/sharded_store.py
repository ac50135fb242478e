"""A genuine pieced run written into a store without the diff side: an anchor (version
0) and a chain of deltas of a :class:`pipeline.testing.sharded.ShardedTrainer`, each
rank's pieces in ``part-r{rank:05d}-00000.safetensors`` (anchors: ``encode_anchor`` of
the 1-D pieces; deltas: ``encode_delta`` over the 1-D base and new pieces), entries
joined by ``join_pieces``, manifests schema 3 through ``write_manifest``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from pipeline.codec import encode_anchor, encode_delta
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import (
    PIECES_SCHEMA,
    Manifest,
    ObjectEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
    object_key,
)
from pipeline.format.pieces import StoredPiece, join_pieces
from pipeline.format.regions import Region
from pipeline.publish.diff import delta_manifest
from pipeline.publish.version import ANCHOR_CODEC, PrivateKey, write_manifest
from pipeline.store.base import ObjectStore
from pipeline.targets.patching import int_view
from pipeline.testing.sharded import (
    RankRange,
    ShardedTensor,
    ShardedTrainer,
    piece_of,
    rank_ranges,
)

ALGORITHM = content_hashes.get(content_hashes.MIXSUM)


def rank_part(rank: int) -> str:
    return f"part-r{rank:05d}-00000.safetensors"


def _stored(r: RankRange, spec: ShardedTensor, piece: torch.Tensor, changed: int) -> StoredPiece:
    return StoredPiece(
        r.name,
        dtype_name(spec.dtype),
        spec.shape,
        r.start,
        r.stop,
        rank_part(r.rank),
        ALGORITHM.piece(piece, Region.flat(math.prod(spec.shape), r.start, r.stop)),
        changed,
    )


@dataclass
class PiecedRun:
    """What was written, with the full state of every version (the truth to compare).
    ``trainer`` makes the states (``write_delta()``), or the caller gives them."""

    store: ObjectStore
    run: str
    tensors: tuple[ShardedTensor, ...]
    trainer: ShardedTrainer | None = None
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    manifests: list[Manifest] = field(default_factory=list)
    signing_key: PrivateKey | None = None
    level: int = 1

    @property
    def order(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def ranges(self) -> dict[int, list[RankRange]]:
        return rank_ranges(self.tensors)

    def _pieces(
        self, state: dict[str, torch.Tensor], rank: int
    ) -> list[tuple[RankRange, torch.Tensor]]:
        return [(r, piece_of(state, r)) for r in self.ranges[rank]]

    def write_anchor(self, state: dict[str, torch.Tensor] | None = None) -> Manifest:
        if state is None:
            assert self.trainer is not None
            state = self.trainer.state
        specs = {t.name: t for t in self.tensors}
        objects: list[ObjectEntry] = []
        pieces: list[StoredPiece] = []
        for rank in self.ranges:
            held = self._pieces(state, rank)
            data = encode_anchor([(r.name, p) for r, p in held])
            key = rank_part(rank)
            self.store.put(object_key(self.run, "anchor", 0, key), data)
            objects.append(ObjectEntry(key, len(data), sha256_bytes(data)))
            pieces += [_stored(r, specs[r.name], p, 0) for r, p in held]
        entries = join_pieces(pieces, self.order, ALGORITHM)
        manifest = Manifest(
            run=self.run,
            version=0,
            kind="anchor",
            parent=None,
            anchor=0,
            codec=ANCHOR_CODEC,
            objects=tuple(objects),
            tensors=tuple(entries),
            state_hash=compute_state_hash(entries),
            created=now_iso(),
            schema=PIECES_SCHEMA,
            extra={"reason": "first"},
            content_hash=ALGORITHM.name,
        )
        manifest = write_manifest(self.store, manifest, self.signing_key, "anchor")
        self.states.append(state)
        self.manifests.append(manifest)
        return manifest

    def write_delta(self, new: dict[str, torch.Tensor] | None = None) -> Manifest:
        if new is None:
            assert self.trainer is not None
            new = self.trainer.step()
        specs = {t.name: t for t in self.tensors}
        parent = self.manifests[-1]
        version = parent.version + 1
        base = self.states[-1]
        objects: list[ObjectEntry] = []
        pieces: list[StoredPiece] = []
        for rank in self.ranges:
            olds = dict(self._pieces(base, rank))
            news = self._pieces(new, rank)
            data = encode_delta([(r.name, olds[r], p) for r, p in news], self.level)
            key = rank_part(rank)
            self.store.put(object_key(self.run, "delta", version, key), data)
            objects.append(ObjectEntry(key, len(data), sha256_bytes(data)))
            for r, p in news:
                changed = int((int_view(p) != int_view(olds[r])).sum())
                pieces.append(_stored(r, specs[r.name], p, changed))
        entries = join_pieces(pieces, self.order, ALGORITHM)
        manifest = delta_manifest(self.run, version, parent, self.level, objects, entries)
        manifest = replace(manifest, schema=PIECES_SCHEMA)
        manifest = write_manifest(self.store, manifest, self.signing_key, "publish")
        self.states.append(new)
        self.manifests.append(manifest)
        return manifest


def build_pieced_run(
    store: ObjectStore,
    run: str,
    deltas: int = 3,
    *,
    seed: int = 0,
    level: int = 1,
    signing_key: PrivateKey | None = None,
) -> PiecedRun:
    """Anchor 0 and deltas 1..``deltas`` of a fresh sharded trainer, written to ``store``."""
    trainer = ShardedTrainer(seed=seed)
    built = PiecedRun(store, run, trainer.tensors, trainer, signing_key=signing_key, level=level)
    built.write_anchor()
    for _ in range(deltas):
        built.write_delta()
    return built


__all__ = ["ALGORITHM", "PiecedRun", "build_pieced_run", "rank_part"]
