"""Deltas and anchors of a sharded run on a replica: tensors stored in pieces.

In a pieced version (manifest schema 3) each object holds, per piece, a 1-D record of
the piece's elements named by the tensor. A delta's record decodes against the held
tensor's elements of the piece's region (the base its encoder saw: a flat slice, or a
box, see pipeline.format.regions); its positions, placed by the region, are a patch of
the whole tensor. A tensor's patch is the union of its pieces' (disjoint; boxes'
sorted into flat order), and its proof covers them all: the held hash plus every
piece's change (mixsum is additive over flat positions) must be the entry's
hash, which the parser checked is the sum of the piece hashes. Nothing is written
here: targets write the proven patches as they write any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from pipeline.codec import DeltaObject, TensorPatch, anchor_tensors
from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.manifest import Manifest, Piece, TensorEntry, dtype_name
from pipeline.format.matching import check_entry
from pipeline.targets.base import TensorSpec
from pipeline.targets.patching import (
    check_patch,
    guarded,
    hash_mismatch,
    int_view,
    parse_objects,
)
from pipeline.targets.walking import ProvenPatches, Walk

# (tensor name, piece, its 1-D elements): what a pieced anchor hands a target.
AnchorPiece = tuple[str, Piece, torch.Tensor]


def _where(entry: TensorEntry, piece: Piece) -> str:
    return f"tensor {entry.name}: {piece.describe()} in object {piece.object}"


def _slice(held: torch.Tensor, entry: TensorEntry, piece: Piece) -> torch.Tensor:
    """The held elements a piece's record decodes against: a flat slice (a view), a
    box's elements (a copy), or the tensor itself for an entry stored whole."""
    if not entry.pieces:
        return held
    return entry.region(piece).take(held.detach())


def _changed_pieces(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    specs: Mapping[str, TensorSpec],
) -> tuple[dict[str, DeltaObject], list[tuple[TensorEntry, list[Piece]]]]:
    """The parsed objects and every changed tensor with its changed pieces, after
    checking every entry against ``specs`` and every record against its piece."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise MismatchError("manifest lists a tensor twice")
    for entry in entries:
        check_entry(entry, specs, of="the delta", holder="the target")
    changed = [(e, [p for p in e.stored if p.changed]) for e in entries if e.changed > 0]
    parsed = parse_objects(objects, (p.object for _, ps in changed for p in ps))
    listed = {(p.object, e.name) for e, ps in changed for p in ps}
    for key, delta in parsed.items():
        for stored in delta.tensors:
            if stored.changed > 0 and (key, stored.name) not in listed:
                raise MismatchError(
                    f"tensor {stored.name} is changed in object {key} but not in the manifest"
                )
    for entry, pieces in changed:
        spec = specs[entry.name]
        for piece in pieces:
            delta = parsed[piece.object]
            try:
                info = delta.info(entry.name)
            except MismatchError:
                raise MismatchError(f"{_where(entry, piece)}: not in the object") from None
            want = (piece.numel,) if entry.pieces else spec.shape
            if info.dtype != spec.dtype or tuple(info.shape) != want:
                raise MismatchError(
                    f"{_where(entry, piece)}: the object holds "
                    f"{dtype_name(info.dtype)}{list(info.shape)}, expected "
                    f"{dtype_name(spec.dtype)}{list(want)} (a piece at the wrong place?)"
                )
            if info.changed != piece.changed:
                raise MismatchError(
                    f"{_where(entry, piece)}: the object changes {info.changed} elements, "
                    f"manifest says {piece.changed}"
                )
    return parsed, changed


def prove_pieced(
    entries: Sequence[TensorEntry],
    objects: Mapping[str, bytes],
    base: Callable[[str], torch.Tensor],
    specs: Mapping[str, TensorSpec],
    held_hash: Callable[[str], str] | None,
    algorithm: HashAlgorithm,
    *,
    keep_patches: bool = True,
) -> ProvenPatches:
    """Whole-tensor patches of a pieced delta's changed tensors, proven against the
    manifest (with ``held_hash``: the hash each held tensor is known by; None decodes
    without proving), with the old contents at their positions; nothing is written.
    The caller checked the objects' sizes and sha256. ``base(name)`` is the held
    tensor (contiguous). A record of the wrong size or count, a patch out of range or
    a hash that does not come out is a one-line MismatchError / CorruptObjectError.

    Without ``keep_patches``, a proven CPU tensor whose pieces are all flat runs the
    compiled walk reads keeps only its hash: it comes back as one walk per piece
    (``ProvenPatches.walks``), written by walking each record into its span."""
    if held_hash is not None and not algorithm.incremental:
        raise ConfigError(f"content hash {algorithm.name} cannot prove a tensor stored in pieces")
    parsed, changed = _changed_pieces(entries, objects, specs)
    proven = ProvenPatches([], {}, {})
    for entry, pieces in changed:
        held = base(entry.name)
        if not held.is_contiguous():
            raise MismatchError(f"tensor {entry.name}: held copy is not contiguous")
        flat = int_view(held.detach()).view(-1)
        digest = held_hash(entry.name) if held_hash is not None else ""
        where: list[torch.Tensor] = []
        olds: list[torch.Tensor] = []
        news: list[torch.Tensor] = []
        walks = _walks(entry, pieces, parsed, held) if not keep_patches and held_hash else None
        counted = 0
        for piece in pieces:
            delta = parsed[piece.object]
            part = _slice(held, entry, piece)
            region = entry.region(piece)
            walked = found = None
            if held_hash is not None:
                walked = guarded(delta.gathered, entry, part)
                if walked is None:
                    found = guarded(delta.differences, entry, part)
            if walked is not None:
                # One walk of the streams over the piece (CPU), read at its changed
                # elements only: positions, new and old contents, then the hash update.
                local, new, old = walked
                at = region.positions(local)
                digest = algorithm.updated(digest, at, old, new, held.element_size())
            elif found is not None:
                # From the streams alone, then one pass over the changed elements of the
                # piece: old contents gathered, new ones formed, hash updated.
                try:
                    digest, at, old, new = algorithm.gathered(
                        digest, int_view(part).view(-1), *found, region
                    )
                except CorruptObjectError as exc:
                    raise CorruptObjectError(f"{_where(entry, piece)}: {exc}") from None
                at = region.positions(at.to(flat.device))
                old, new = old.to(flat.device), new.to(flat.device)
            else:
                # Level 3's chunked positions depend on the base: decoded against it.
                patch = guarded(delta.decode, entry, part)
                at = patch.positions.to(flat.device)
                if at.numel() and (int(at[0]) < 0 or int(at[-1]) >= piece.numel):
                    raise CorruptObjectError(
                        f"{_where(entry, piece)}: decoded position out of range"
                    )
                at = region.positions(at)
                old = flat.index_select(0, at)
                new = patch.values.to(flat.device).view(flat.dtype)
                if held_hash is not None:
                    digest = algorithm.updated(digest, at, old, new, held.element_size())
            if walks is not None:
                counted += int(at.numel())  # proven; its patch is not kept
                continue
            where.append(at)
            olds.append(old)
            news.append(new)
        if walks is not None:
            if counted != entry.changed:
                raise CorruptObjectError(
                    f"tensor {entry.name}: decoded {counted} positions, manifest says "
                    f"{entry.changed}"
                )
            if digest != entry.hash:
                raise hash_mismatch(entry.name, digest, entry.hash)
            proven.hashes[entry.name] = digest
            proven.walks.extend(walks)
            continue
        at, new_all, old_all = torch.cat(where), torch.cat(news), torch.cat(olds)
        if any(p.is_box for p in pieces):
            # Boxes interleave in flat order: their disjoint positions sorted into one patch.
            order = torch.argsort(at)
            at, new_all, old_all = at[order], new_all[order], old_all[order]
        whole = TensorPatch(entry.name, held.dtype, tuple(held.shape), at, new_all)
        check_patch(whole, entry, specs[entry.name])
        if held_hash is not None:
            if digest != entry.hash:
                raise hash_mismatch(entry.name, digest, entry.hash)
            proven.hashes[entry.name] = digest
        proven.patches.append(whole)
        proven.old_values[entry.name] = old_all
    return proven


def _walks(
    entry: TensorEntry,
    pieces: Sequence[Piece],
    parsed: Mapping[str, DeltaObject],
    held: torch.Tensor,
) -> list[Walk] | None:
    """One walk per piece of ``entry`` if every piece can be written by walking its
    record into a view of the held tensor (CPU, flat runs, the walk's encodings), else
    None (its patch is kept)."""
    walks = []
    for piece in pieces:
        region = entry.region(piece)
        if not region.is_contiguous:
            return None
        delta = parsed[piece.object]
        span = (region.start, region.stop) if entry.pieces else None
        walk = Walk(entry.name, delta, delta.info(entry.name).changed, span)
        if not delta.walks(entry.name, walk.target(held)):
            return None
        walks.append(walk)
    return walks


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
