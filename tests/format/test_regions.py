"""Regions: where a piece (a flat range or a box) lies in its tensor, and its hash."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import CorruptObjectError, MismatchError
from pipeline.format import manifest as m
from pipeline.format.checkpoints.shards import RankLayout, RankPiece, read_layout, write_layout
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.regions import Region, tiling_error
from tests.format.test_manifest_pieces import pieced_anchor

ALG = content_hashes.get(content_hashes.MIXSUM)


def _random_boxes(seed: int, count: int) -> list[Region]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        shape = tuple(int(n) for n in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        offset = tuple(int(rng.integers(0, n)) for n in shape)
        size = tuple(int(rng.integers(1, n - o + 1)) for n, o in zip(shape, offset, strict=True))
        out.append(Region(shape, offset, size))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_box_places_its_elements_where_indexing_the_whole_tensor_does(seed: int) -> None:
    for region in _random_boxes(seed, 50):
        whole = torch.arange(math.prod(region.shape), dtype=torch.int64).reshape(region.shape)
        expected = whole[region.slices()].reshape(-1)  # flat positions, by construction
        local = torch.arange(region.numel, dtype=torch.int64)
        assert torch.equal(region.positions(local), expected)
        assert np.array_equal(region.positions(local.numpy()), expected.numpy())
        assert torch.equal(region.take(whole), expected)
        target = torch.zeros_like(whole)
        region.put(target, -1 - local)
        assert torch.equal(target.reshape(-1)[expected], -1 - local)
        assert int((target != 0).sum()) == region.numel  # nothing written outside
        assert (region.start, region.stop) == (int(expected[0]), int(expected[-1]) + 1)
        assert region.is_contiguous == (region.stop - region.start == region.numel)


def test_a_flat_range_is_the_box_of_the_1d_view() -> None:
    flat = Region.flat(70, 31, 70)
    assert flat.is_flat and flat.is_contiguous and flat.runs[0] == 39
    assert torch.equal(flat.positions(torch.tensor([0, 38])), torch.tensor([31, 69]))


@pytest.mark.parametrize(
    ("shape", "offset", "size"),
    [((4, 4), (0, 0), (0, 4)), ((4, 4), (3, 0), (2, 4)), ((4, 4), (0,), (4,)), ((4,), (-1,), (2,))],
)
def test_a_box_outside_its_tensor_is_refused(
    shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...]
) -> None:
    with pytest.raises(MismatchError):
        Region(shape, offset, size)


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Region]:
    """The boxes of a grid cutting dimension d at ``cuts[d]``."""
    spans = [list(zip([0, *c], [*c, n], strict=True)) for c, n in zip(cuts, shape, strict=True)]
    boxes = [()]  # type: list[tuple[tuple[int, int], ...]]
    for dim in spans:
        boxes = [(*b, s) for b in boxes for s in dim]
    return [Region(shape, tuple(a for a, _ in b), tuple(z - a for a, z in b)) for b in boxes]


def test_boxes_must_form_a_grid_each_cell_once() -> None:
    shape = (7, 5, 6)
    grid = _grid(shape, [[4], [], [2, 3]])  # uneven, as torch.chunk leaves them
    assert tiling_error(math.prod(shape), grid) is None
    assert tiling_error(math.prod(shape), grid[::-1]) is None  # any order
    assert "once" in str(tiling_error(math.prod(shape), [*grid[:-1], grid[0]]))
    assert "cells once" in str(tiling_error(math.prod(shape), grid[:-1]))
    # A whole grid of another tensor's shape: its cells are all there, its size is not.
    assert "not 211" in str(tiling_error(211, grid))
    # An L-shaped split covers every element once but is no grid: refused by design
    # (DTensor chunks always form one, and a grid is checked in O(pieces)).
    l_shape = [
        Region((4, 4), (0, 0), (2, 4)),
        Region((4, 4), (2, 0), (2, 2)),
        Region((4, 4), (2, 2), (2, 2)),
    ]
    assert tiling_error(16, l_shape) is not None
    mixed = [Region.flat(16, 0, 8), Region((4, 4), (2, 0), (2, 4))]
    assert "mix" in str(tiling_error(16, mixed))
    assert "held twice" in str(tiling_error(10, [Region.flat(10, 0, 6), Region.flat(10, 5, 10)]))


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]  # fmt: skip


def _values(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        flat = t.view(-1)
        flat[:4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")]).to(dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_box_piece_hashes_sum_to_the_whole_on_both_paths(dtype: torch.dtype) -> None:
    shape = (6, 5, 9)
    whole = _values(dtype, shape)
    boxes = _grid(shape, [[3], [2], [4]])
    digests = [ALG.piece(b.take(whole), b) for b in boxes]
    assert ALG.combine(digests) == ALG.full(whole)
    mixsum.COMPILED = False
    try:
        assert [ALG.piece(b.take(whole), b) for b in boxes] == digests
    finally:
        mixsum.COMPILED = True
    # A box at another place of the same tensor hashes differently.
    moved = Region(shape, (0, 2, 0), (3, 2, 4))
    assert ALG.piece(boxes[0].take(whole), moved) != digests[0]
    with pytest.raises(CorruptObjectError, match="elements"):
        ALG.piece(boxes[0].take(whole)[1:], boxes[0])


@pytest.mark.parametrize("compiled", [True, False])
def test_a_box_pieces_update_equals_hashing_it_again(compiled: bool) -> None:
    shape = (8, 12)
    whole = mixsum.int_flat(_values(torch.bfloat16, shape)).reshape(shape)
    box = Region(shape, (2, 5), (4, 6))
    piece = box.take(whole).clone()
    held = ALG.piece(piece, box)
    positions = np.array([0, 7, 23], np.int64)
    diffs = np.array([1, -3, 300], np.int16)
    mixsum.COMPILED = compiled
    try:
        after, at, _, new = ALG.gathered(held, piece, positions, diffs, box)
        with pytest.raises(CorruptObjectError, match="out of range"):
            ALG.gathered(held, piece, np.array([24], np.int64), diffs[:1], box)
    finally:
        mixsum.COMPILED = True
    assert torch.equal(at, torch.from_numpy(positions))
    changed = piece.clone()
    changed[torch.from_numpy(positions)] += torch.from_numpy(diffs)
    assert torch.equal(new, changed[torch.from_numpy(positions)])
    assert after == ALG.piece(changed, box)
    # And as the whole tensor's update: the same change at the box's flat positions.
    flat = whole.reshape(-1)
    global_at = box.positions(positions)
    assert ALG.gathered(ALG.full(flat), flat, global_at, diffs)[0] != ALG.full(flat)
    changed_whole = flat.clone()
    changed_whole[torch.from_numpy(global_at)] += torch.from_numpy(diffs)
    assert ALG.gathered(ALG.full(flat), flat, global_at, diffs)[0] == ALG.full(changed_whole)


def _box_manifest() -> m.Manifest:
    shape = (6, 8)
    whole = _values(torch.bfloat16, shape)
    boxes = _grid(shape, [[3], [5]])
    objects = tuple(
        m.ObjectEntry(f"part-r{i:05d}-00000.safetensors", 1, "0" * 64) for i in range(4)
    )
    pieces = tuple(
        m.Piece.at(objects[i].key, b, ALG.piece(b.take(whole), b)) for i, b in enumerate(boxes)
    )
    entry = m.TensorEntry("w", "bfloat16", shape, ALG.full(whole), objects[0].key, 0, pieces)
    return pieced_anchor(objects, entry)


def test_a_box_pieced_manifest_round_trips() -> None:
    manifest = _box_manifest()
    doc = m.to_json(manifest)
    assert b'"offset":[3,5]' in doc and b'"size":[3,3]' in doc
    parsed = parse_manifest(doc)
    assert parsed == manifest
    assert all(p.is_box for p in parsed.tensors[0].pieces)


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (b'"offset":[3,5]', b'"offset":[3,6]', "not inside"),
        (b'"size":[3,3]', b'"size":[3,0]', "not inside"),
        (b'"offset":[3,5]', b'"offset":[3]', "one offset and size per dimension"),
        (b'"offset":[3,5]', b'"offset":[2,5]', "in order"),
        (b'"offset":[0,5],"size":[3,3]', b'"offset":[0,4],"size":[3,4]', "grid"),
        (b'"offset":[3,5],"size":[3,3]', b'"start":29,"stop":32', "mix"),
    ],
)
def test_malformed_boxes_are_refused_in_one_line(old: bytes, new: bytes, why: str) -> None:
    doc = m.to_json(_box_manifest())
    assert old in doc
    with pytest.raises(CorruptObjectError, match=why) as info:
        parse_manifest(doc.replace(old, new, 1))
    assert "\n" not in str(info.value)


def test_a_rank_sidecar_with_boxes_round_trips(tmp_path: Path) -> None:
    piece = RankPiece.at("w", "bfloat16", (6, 8), Region((6, 8), (3, 5), (3, 3)))
    layout = RankLayout("r", 1, 3, 4, "h0", (piece, RankPiece("b", "float32", (8,), 0, 8)))
    write_layout(tmp_path, layout)
    assert read_layout(tmp_path) == layout
    bad = dataclasses.replace(piece, offset=(4, 5))
    with pytest.raises(Exception, match="not inside"):
        write_layout(tmp_path, dataclasses.replace(layout, pieces=(bad,)))
