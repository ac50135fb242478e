"""The codec's reference: level 1 written and read by whole-array numpy passes.

The library encodes and decodes with compiled kernels (numba) that walk the data
once; this is the plain form of the same format, kept beside the tests that hold
the kernels to it: the objects it writes are the library's byte for byte, and what
it reads from an object is what the library decodes. The pieces with one
implementation only are shared (zstd byte planes, the change mask, the container,
level 3's chunk encoder, whose level-1 alternative is this module's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, positions
from pipeline.codec.api import DeltaObject, pack_object
from pipeline.codec.compiled import fused
from pipeline.codec.dtypes import DtypeInfo, info_for, int_view_flat
from pipeline.codec.level3 import chunked, chunked_torch
from pipeline.codec.records import TensorRecord
from pipeline.codec.tensorcodec import BITMAP_MIN_DENSITY, DENSE_MIN_DENSITY, Encoded

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
AnyUInt = npt.NDArray[np.unsignedinteger]

MAX_PARAM = fused.MAX_PARAM
# Sign-magnitude contents where at least ONES in OF of the differences are +-1.
SIGNMAG_RULE = (fused.SIGNMAG_ONES, fused.SIGNMAG_OF)


class DamagedError(Exception):
    """The streams do not decode to what the record promises."""


# ----------------------------------------------------------------------------- Rice


def rice_cost_bits(gaps: I64, param: int) -> int:
    return int((gaps >> param).sum()) + gaps.size * (1 + param)


def guess_param(count: int, span: int) -> int:
    """Rice parameter near the optimum for ``count`` gaps summing to ``span``."""
    mean = span / max(count, 1)
    return max(0, min(MAX_PARAM, int(np.log2(mean * 0.69 + 1.0))))


def best_param(gaps: I64) -> int:
    """The Rice parameter with the fewest bits for these gaps (of the three around
    the guess, the lowest on a tie)."""
    if gaps.size == 0:
        return 0
    first = max(0, guess_param(gaps.size, int(gaps.sum())) - 1)
    costs = [rice_cost_bits(gaps, p) for p in range(first, min(MAX_PARAM, first + 2) + 1)]
    return first + int(np.argmin(costs))


def pack_unary(quotients: I64) -> U8:
    """q zeros followed by a one for each quotient, packed MSB first."""
    if quotients.size == 0:
        return np.zeros(0, np.uint8)
    ends = np.cumsum(quotients + 1) - 1
    bits = np.zeros(int(ends[-1]) + 1, np.uint8)
    bits[ends] = 1
    return np.packbits(bits)


def unpack_unary(stream: U8, count: int) -> I64 | None:
    """The quotients of a unary stream, or None when the stream does not hold
    exactly ``count`` codes followed by zero padding."""
    if count == 0:
        return np.zeros(0, np.int64) if stream.size == 0 else None
    ends = np.flatnonzero(np.unpackbits(stream))
    if ends.size != count or (int(ends[-1]) >> 3) != stream.size - 1:
        return None
    return np.diff(ends, prepend=-1).astype(np.int64) - 1


def pack_fixed(values: I64, width: int) -> U8:
    """``width`` low bits of each value, MSB first, concatenated and packed."""
    if width == 0 or values.size == 0:
        return np.zeros(0, np.uint8)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    return np.packbits(((values[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1))


def unpack_fixed(stream: U8, count: int, width: int) -> I64:
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    bits = np.unpackbits(stream, count=count * width).reshape(count, width)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    out: I64 = (bits.astype(np.int64) << shifts).sum(axis=1)
    return out


def encode_gaps(gaps: I64, param: int) -> tuple[U8, U8]:
    return pack_unary(gaps >> param), pack_fixed(gaps & ((1 << param) - 1), param)


def positions_to_gaps(where: I64) -> I64:
    """Strictly increasing positions -> gaps (number of skipped slots before each)."""
    return np.diff(where, prepend=-1) - 1


def gaps_to_positions(gaps: I64) -> I64:
    return np.cumsum(gaps + 1) - 1


def encode_positions(where: I64) -> tuple[U8, U8, int]:
    """Strictly increasing positions -> (unary, fixed, parameter)."""
    gaps = positions_to_gaps(where)
    param = best_param(gaps)
    unary, fixed = encode_gaps(gaps, param)
    return unary, fixed, param


def decode_positions(unary: U8, fixed: U8, count: int, param: int, limit: int) -> I64 | None:
    """Positions from ``encode_positions``' streams, or None when they do not hold
    exactly ``count`` codes (with zero padding) or a position reaches ``limit``."""
    if count == 0:
        return np.zeros(0, np.int64) if unary.size == 0 and fixed.size == 0 else None
    if fixed.size != (count * param + 7) // 8:
        return None
    quotients = unpack_unary(unary, count)
    if quotients is None or int(quotients.max()) > (limit >> param):
        return None
    where = gaps_to_positions((quotients << param) | unpack_fixed(fixed, count, param))
    return None if int(where[-1]) >= limit else where


# ----------------------------------------------------------------------------- changes


def find_changes(base: AnyUInt, new: AnyUInt) -> tuple[I64, AnyUInt, AnyUInt]:
    """Positions where two flat arrays differ, the differences new - base there
    (wrapping) and the base contents there."""
    where = np.flatnonzero(base != new).astype(np.int64)
    return where, new[where] - base[where], base[where]


# ----------------------------------------------------------------------------- contents


def encode_contents(
    diff: AnyUInt, rule: tuple[int, int] = SIGNMAG_RULE
) -> tuple[dict[str, U8], dict[str, Any]]:
    """Sign-magnitude streams where at least ``rule`` of the differences are +-1,
    else zigzagged byte planes."""
    count = diff.size
    minus_one = np.iinfo(diff.dtype).max
    ones = int(np.count_nonzero((diff == 1) | (diff == minus_one)))
    if rule[1] * ones < rule[0] * count:
        return {"values": contents.encode_planes(contents.zigzag(diff))}, {"contents": "planes"}
    negative = (diff >> (diff.dtype.itemsize * 8 - 1)).astype(np.uint8)
    magnitude = np.where(negative.astype(bool), np.zeros_like(diff) - diff, diff)
    big = np.flatnonzero(magnitude > 1).astype(np.int64)
    big_unary, big_fixed, param = encode_positions(big)
    streams = {
        "sign": np.packbits(negative),
        "big_unary": big_unary,
        "big_fixed": big_fixed,
        "mags": contents.encode_planes(magnitude[big] - 2) if big.size else np.zeros(0, np.uint8),
    }
    return streams, {"contents": "signmag", "big": int(big.size), "big_rice": param}


def decode_contents(
    streams: dict[str, U8], params: dict[str, Any], count: int, unsigned: Any
) -> AnyUInt:
    """The non-zero differences (unsigned, wrapping) of ``count`` changed elements."""
    try:
        if params["contents"] == "planes":
            diff = contents.unzigzag(contents.decode_planes(streams["values"], count, unsigned))
        else:
            nbig = int(params["big"])
            big = decode_positions(
                streams["big_unary"], streams["big_fixed"], nbig, int(params["big_rice"]), count
            )
            if big is None:
                raise DamagedError("large-difference streams do not hold the recorded count")
            magnitude = np.ones(count, unsigned)
            if nbig:
                mags = contents.decode_planes(streams["mags"], nbig, unsigned)
                magnitude[big] = mags + unsigned(2)
            negative = np.unpackbits(streams["sign"], count=count).astype(bool)
            diff = np.where(negative, np.zeros_like(magnitude) - magnitude, magnitude)
    except contents.ContentsError as exc:
        raise DamagedError(str(exc)) from None
    if not diff.all():
        raise DamagedError("contents hold a zero difference for a changed element")
    return diff


# ----------------------------------------------------------------------------- tensors


def encode_tensor(
    base_flat: torch.Tensor,
    new_flat: torch.Tensor,
    info: DtypeInfo,
    rule: tuple[int, int] = SIGNMAG_RULE,
) -> Encoded:
    """Level 1: the smallest of the encodings of the change (flat integer views)."""
    numel = base_flat.numel()
    base = base_flat.numpy().view(info.unsigned)
    new = new_flat.numpy().view(info.unsigned)
    where, diff, _ = find_changes(base, new)
    changed = where.size
    if changed == 0:
        return Encoded("same", 0)
    content_streams, content_params = encode_contents(diff, rule)
    candidates = []
    if changed < numel:
        unary, fixed, param = encode_positions(where)
        streams = {"unary": unary, "fixed": fixed}
        candidates.append(Encoded("sparse", changed, streams, {"rice": param}))
    if changed >= numel * BITMAP_MIN_DENSITY:
        mask = np.zeros(numel, bool)
        mask[where] = True
        candidates.append(Encoded("bitmap", changed, positions.encode_bitmap(mask)))
    best = min(candidates, key=lambda e: e.nbytes) if candidates else None
    if best is not None:
        best.streams.update(content_streams)
        best.params.update(content_params)
    if changed >= numel * DENSE_MIN_DENSITY:
        planes = contents.encode_planes(contents.zigzag(new - base))
        dense = Encoded("dense", changed, {"values": planes})
        if best is None or dense.nbytes < best.nbytes:
            best = dense
    assert best is not None
    return best


def encode_chunked(
    base_flat: torch.Tensor,
    new_flat: torch.Tensor,
    info: DtypeInfo,
    rule: tuple[int, int] = SIGNMAG_RULE,
) -> Encoded:
    """Level 3: the library's chunked encoding, or level 1 (this module's) where the
    library tries it and it is smaller."""
    walker = chunked.compiled()
    numel = base_flat.numel()
    base = base_flat.numpy().view(info.unsigned)
    scanned = chunked.scan(walker, base, new_flat.numpy().view(info.unsigned), info)
    changed = scanned.where.size
    if changed == 0:
        return Encoded("same", 0)
    found = chunked.encode(walker, base, scanned)
    best = Encoded("chunked", changed, found.streams, found.params)
    if (
        3 * int(found.params["big"]) > changed
        or changed >= numel * DENSE_MIN_DENSITY
        or (not found.params["bounds"] and changed >= numel * BITMAP_MIN_DENSITY)
    ):
        other = encode_tensor(base_flat, new_flat, info, rule)
        if other.nbytes < best.nbytes:
            best = other
    return best


def encode_delta(
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]],
    level: int = 1,
    rule: tuple[int, int] = SIGNMAG_RULE,
) -> bytes:
    """The delta object of (name, base, new) pairs of CPU tensors, at level 1 or 3."""
    records: list[TensorRecord] = []
    entries: dict[str, U8] = {}
    for name, base, new in pairs:
        info = info_for(base.dtype, name)
        base_flat, new_flat = int_view_flat(base, info), int_view_flat(new, info)
        if base_flat.numel() == 0:
            encoded = Encoded("same", 0)
        elif level == 3:
            encoded = encode_chunked(base_flat, new_flat, info, rule)
        else:
            encoded = encode_tensor(base_flat, new_flat, info, rule)
        if encoded.streams:
            entries[name] = np.concatenate(list(encoded.streams.values()))
        sizes = {role: int(stream.size) for role, stream in encoded.streams.items()}
        records.append(
            TensorRecord(
                name,
                info,
                tuple(base.shape),
                encoded.encoding,
                encoded.changed,
                sizes,
                encoded.params,
            )
        )
    return pack_object(records, entries, level)


def decode(obj: DeltaObject, name: str, base: torch.Tensor) -> tuple[I64, AnyUInt]:
    """(positions, new contents as unsigned integers) of tensor ``name``'s changed
    elements over ``base`` (CPU); DamagedError where its streams are. ``chunked``
    records are read by the library's torch-ops decoder."""
    record = obj._records[name]
    info = record.info
    streams = record.split(obj._entries.get(name, np.zeros(0, np.uint8)))
    base_np = int_view_flat(base, info).numpy().view(info.unsigned)
    numel, changed = base_np.size, record.changed
    if record.encoding == "same":
        return np.zeros(0, np.int64), np.zeros(0, info.unsigned)
    if record.encoding == "chunked":
        assert record.layout is not None
        try:
            where_t, new_t = chunked_torch.decode(
                streams, record.layout, changed, int_view_flat(base, info), info
            )
        except chunked.ChunkedError as exc:
            raise DamagedError(str(exc)) from None
        return where_t.numpy(), new_t.numpy().view(info.unsigned)
    if record.encoding == "dense":
        try:
            planes = contents.decode_planes(streams["values"], numel, info.unsigned)
            diff = contents.unzigzag(planes)
        except contents.ContentsError as exc:
            raise DamagedError(str(exc)) from None
        where = np.flatnonzero(diff).astype(np.int64)
        if where.size != changed:
            raise DamagedError(f"contents change {where.size} elements, record says {changed}")
        return where, base_np[where] + diff[where]
    if record.encoding == "sparse":
        found = decode_positions(
            streams["unary"], streams["fixed"], changed, int(record.params["rice"]), numel
        )
        if found is None:
            raise DamagedError("position streams do not hold the recorded gaps within the tensor")
        where = found
    else:
        try:
            where = positions.decode_bitmap(streams, changed, numel)
        except positions.PositionsError as exc:
            raise DamagedError(str(exc)) from None
    diff = decode_contents(streams, record.params, changed, info.unsigned)
    return where, base_np[where] + diff
