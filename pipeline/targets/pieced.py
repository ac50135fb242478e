"""Anchors of a sharded run on a replica: tensors stored in pieces.

In a pieced version (manifest schema 3) each object holds, per piece, a 1-D record of
the piece's elements named by the tensor. An anchor's pieces are checked against
their piece hashes here and handed to a target (``Target.load_pieces``) or assembled into
whole tensors. A delta's records are proven against the held tensors with the rest
of the delta (``pipeline.targets.proving.prove_pieced``): the held hash plus every
piece's change must be the entry's hash, which the parser checked is the sum of the
piece hashes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from pipeline.codec import anchor_tensors
from pipeline.errors import CorruptObjectError, MismatchError
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import Manifest, Piece
from pipeline.targets.patching import int_view

# (tensor name, piece, its 1-D elements): what a pieced anchor hands a target.
AnchorPiece = tuple[str, Piece, torch.Tensor]


def anchor_pieces(data: bytes, manifest: Manifest, key: str) -> Iterator[AnchorPiece]:
    """The pieces anchor object ``key`` of ``manifest`` holds (bytes checked by the
    caller), each checked against its piece hash at its flat positions."""
    algorithm = content_hashes.of(manifest)
    held = dict(manifest.layout()).get(key)
    if held is None:
        raise CorruptObjectError(f"object {key} is not in anchor v{manifest.version}")
    shapes = {e.name: (e.dtype, (p.numel,) if e.pieces else e.shape) for e, p in held}
    pieces = {e.name: p for e, p in held}
    entries = {e.name: e for e, _ in held}
    seen: set[str] = set()
    for name, tensor in anchor_tensors(data, key, shapes):
        piece = pieces[name]  # the shapes check named every stored tensor
        entry = entries[name]
        if algorithm.piece(tensor.reshape(-1), entry.region(piece)) != piece.hash:
            raise CorruptObjectError(
                f"anchor v{manifest.version}: {piece.describe()} of tensor {name!r} in {key} "
                "do not match their piece hash"
            )
        seen.add(name)
        yield name, piece, tensor.reshape(-1)
    if len(seen) != len(pieces):
        lacking = next(n for n in pieces if n not in seen)
        raise CorruptObjectError(f"object {key} lacks its piece of tensor {lacking!r}")


def whole_tensors(
    pieces: Iterable[AnchorPiece], shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors (of ``shapes``) from a pieced anchor's pieces, each handed out
    once all its elements are in: for targets that load whole tensors only. Memory:
    the tensors being assembled. Pieces must not overlap (the manifest's do not)."""
    building: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, elements in)
    for name, piece, tensor in pieces:
        shape = shapes.get(name)
        if shape is None:
            raise MismatchError(f"tensor {name!r} of the anchor is not held by the target")
        whole, filled = building.get(name) or (torch.empty(shape, dtype=tensor.dtype), 0)
        try:
            region = piece.region(tuple(shape))
        except MismatchError:
            region = None
        if region is None or tensor.numel() != piece.numel:
            raise MismatchError(f"tensor {name!r}: piece ({piece.describe()}) does not fit")
        region.put(int_view(whole), int_view(tensor))
        filled += piece.numel
        if filled == whole.numel():
            building.pop(name, None)
            yield name, whole
        else:
            building[name] = (whole, filled)
    if building:
        raise CorruptObjectError(
            f"tensor {next(iter(building))!r} of the anchor was left incomplete"
        )
