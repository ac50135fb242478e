"""Schema 3: tensors of a sharded run stored in pieces, hashed piece by piece."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format import manifest as m
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.pieces import StoredPiece, join_pieces
from pipeline.format.regions import Region

ALG = content_hashes.get(content_hashes.MIXSUM)
RANGES = [(0, 30), (30, 31), (31, 70)]


def _tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(10, 7, generator=g).to(torch.bfloat16)


def _manifest() -> m.Manifest:
    flat = _tensor().reshape(-1)
    objects = tuple(
        m.ObjectEntry(f"part-r{i:05d}-00000.safetensors", 1, "0" * 64) for i in range(3)
    )
    pieces = tuple(
        m.Piece(objects[i].key, a, b, ALG.piece(flat[a:b], Region.flat(70, a, b)))
        for i, (a, b) in enumerate(RANGES)
    )
    entry = m.TensorEntry("w", "bfloat16", (10, 7), ALG.full(flat), objects[0].key, 0, pieces)
    return pieced_anchor(objects, entry)


def pieced_anchor(objects: tuple[m.ObjectEntry, ...], entry: m.TensorEntry) -> m.Manifest:
    """Anchor 0 of run ``r``: the one tensor ``entry``, in pieces over ``objects``."""
    return m.Manifest(
        run="r",
        version=0,
        kind="anchor",
        parent=None,
        anchor=0,
        codec=m.CodecInfo("safetensors", 1),
        objects=objects,
        tensors=(entry,),
        state_hash=m.compute_state_hash([entry]),
        created=m.now_iso(),
        schema=m.PIECES_SCHEMA,
        content_hash=content_hashes.MIXSUM,
    )


def test_piece_hashes_combine_to_the_whole() -> None:
    flat = _tensor().reshape(-1)
    digests = [ALG.piece(flat[a:b], Region.flat(70, a, b)) for a, b in RANGES]
    assert ALG.combine(digests) == ALG.full(flat)
    assert mixsum.COMPILED
    mixsum.COMPILED = False  # the torch-ops path agrees
    try:
        assert [ALG.piece(flat[a:b], Region.flat(70, a, b)) for a, b in RANGES] == digests
    finally:
        mixsum.COMPILED = True


def test_a_piece_update_equals_the_whole_tensor_update() -> None:
    flat = mixsum.int_flat(_tensor())
    start = 31
    where = Region.flat(70, start, 70)
    held = ALG.piece(flat[start:], where)
    positions = np.array([0, 5, 38], np.int64)
    diffs = np.array([1, -1, 300], np.int16)
    piece_after = ALG.gathered(held, flat[start:], positions, diffs, where)[0]
    mixsum.COMPILED = False  # the torch-ops path agrees
    try:
        assert ALG.gathered(held, flat[start:], positions, diffs, where)[0] == piece_after
    finally:
        mixsum.COMPILED = True
    new = flat.clone()
    new[torch.from_numpy(positions + start)] += torch.from_numpy(diffs)
    assert piece_after == ALG.piece(new[start:], where)
    whole_after = ALG.gathered(ALG.full(flat), flat, positions + start, diffs)[0]
    assert whole_after == ALG.full(new)


def test_pieced_manifest_round_trips_and_lays_out_by_object() -> None:
    manifest = _manifest()
    parsed = parse_manifest(m.to_json(manifest))
    assert parsed == manifest
    layout = parsed.layout()
    assert [key for key, _ in layout] == [o.key for o in manifest.objects]
    assert [(p.start, p.stop) for _, held in layout for _, p in held] == RANGES
    assert parsed.parts() == [(o.key, ["w"]) for o in manifest.objects]


def test_pieces_need_schema_3() -> None:
    with pytest.raises(ConfigError, match="schema 3"):
        m.to_json(dataclasses.replace(_manifest(), schema=2))
    doc = m.to_json(_manifest()).replace(b'"schema":3', b'"schema":2')
    with pytest.raises(CorruptObjectError, match="pieces"):
        parse_manifest(doc)


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (b'"stop":31', b'"stop":32', "elements from 31 are held twice"),
        (b'"start":31', b'"start":32', "elements from 31 are missing"),
        (b'"stop":70', b'"stop":69', "cover 69 of its 70"),
        (b'"changed":0,"hash"', b'"changed":1,"hash"', "do not add up"),
    ],
)
def test_malformed_pieces_are_refused(old: bytes, new: bytes, why: str) -> None:
    doc = m.to_json(_manifest())
    assert old in doc
    with pytest.raises(CorruptObjectError, match=why):
        parse_manifest(doc.replace(old, new, 1))


def test_piece_hashes_that_do_not_sum_are_refused() -> None:
    manifest = _manifest()
    entry = manifest.tensors[0]
    wrong = dataclasses.replace(entry.pieces[1], hash="0" * 32)
    entry = dataclasses.replace(entry, pieces=(entry.pieces[0], wrong, entry.pieces[2]))
    doc = m.to_json(
        dataclasses.replace(manifest, tensors=(entry,), state_hash=m.compute_state_hash([entry]))
    )
    with pytest.raises(CorruptObjectError, match="do not sum"):
        parse_manifest(doc)


def test_join_pieces_builds_the_entries_and_refuses_gaps() -> None:
    manifest = _manifest()
    entry = manifest.tensors[0]
    e = entry
    stored = [
        StoredPiece.at(e.name, e.dtype, e.region(p), e.shape, p.object, p.hash, p.changed)
        for p in e.stored
    ]
    assert join_pieces(reversed(stored), ["w"], ALG) == [entry]
    with pytest.raises(MismatchError, match="missing"):
        join_pieces([stored[0], stored[2]], ["w"], ALG)
    with pytest.raises(MismatchError, match="held twice"):
        join_pieces([stored[0], stored[0], *stored[1:]], ["w"], ALG)
    with pytest.raises(MismatchError, match="no piece"):
        join_pieces(stored, ["w", "b"], ALG)
