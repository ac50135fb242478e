"""Encode and decode one tensor's change.

Encodings (the smallest wins per tensor):
- ``same``: nothing changed, no streams.
- ``sparse``: positions as Rice-coded gaps (unary + fixed streams), contents.
- ``classed`` (level 2): positions grouped by the exponent class of the base
  element, which the receiver knows; each class codes its own gaps in
  class-local coordinates with its own Rice parameter, or the gaps of its
  unchanged elements when most of the class changed.
- ``bitmap``: zstd of the packed change mask, contents.
- ``dense``: the zigzagged difference of every element, no positions.
Contents are always zigzagged bit-pattern differences new - base (see contents.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, rice
from pipeline.codec.dtypes import DtypeInfo
from pipeline.codec.records import TensorRecord

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
AnyUInt = npt.NDArray[np.unsignedinteger]

ENCODINGS = ("same", "sparse", "classed", "bitmap", "dense")
BITMAP_MIN_DENSITY = 1 / 32
DENSE_MIN_DENSITY = 1 / 4


@dataclass
class Encoded:
    encoding: str
    changed: int
    streams: dict[str, U8] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(int(s.size) for s in self.streams.values())


def _to_numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


def _as_bytes(frame: bytes) -> U8:
    return np.frombuffer(frame, np.uint8)


def exponent_classes(base_flat: torch.Tensor, info: DtypeInfo) -> torch.Tensor:
    """Exponent field of every base element (int64 for bincount and sort)."""
    assert info.exponent is not None
    shift, mask = info.exponent
    return (
        ((base_flat.to(torch.int64) >> shift) & mask)
        if base_flat.numel()
        else (torch.zeros(0, dtype=torch.int64, device=base_flat.device))
    )


@dataclass(frozen=True)
class ClassIndex:
    """Elements of a tensor grouped by exponent class: ``order[start[c]:start[c+1]]``
    are the flat positions of class c in ascending order."""

    order: I64
    start: I64

    @staticmethod
    def build(base_flat: torch.Tensor, info: DtypeInfo) -> ClassIndex:
        assert info.exponent is not None
        classes = exponent_classes(base_flat, info)
        _, order = torch.sort(classes, stable=True)
        counts = torch.bincount(classes, minlength=info.exponent[1] + 1)
        start = np.zeros(counts.numel() + 1, np.int64)
        np.cumsum(_to_numpy(counts), out=start[1:])
        return ClassIndex(order=_to_numpy(order), start=start)


def encode_tensor(
    base_flat: torch.Tensor, new_flat: torch.Tensor, info: DtypeInfo, level: int
) -> Encoded:
    numel = base_flat.numel()
    if numel == 0:
        return Encoded("same", 0)
    mask = torch.ne(base_flat, new_flat)
    positions_t = torch.nonzero(mask).view(-1)
    changed = positions_t.numel()
    if changed == 0:
        return Encoded("same", 0)
    unsigned = info.unsigned
    base_vals = _to_numpy(base_flat[positions_t]).view(unsigned)
    new_vals = _to_numpy(new_flat[positions_t]).view(unsigned)
    codes = contents.zigzag(new_vals - base_vals)
    values = _as_bytes(contents.encode_codes(codes))
    positions = _to_numpy(positions_t)

    candidates: list[Encoded] = []
    if changed < numel:
        candidates.append(_sparse(positions, values, changed))
        if level >= 2 and info.exponent is not None:
            index = ClassIndex.build(base_flat, info)
            pos_classes = _to_numpy(exponent_classes(base_flat[positions_t], info))
            candidates.append(_classed(positions, pos_classes, values, changed, index))
    if changed >= numel * BITMAP_MIN_DENSITY:
        packed = np.packbits(_to_numpy(mask))
        bitmap = _as_bytes(contents.compress(packed))
        candidates.append(Encoded("bitmap", changed, {"mask": bitmap, "values": values}))
    if changed >= numel * DENSE_MIN_DENSITY:
        all_codes = contents.zigzag(
            _to_numpy(new_flat).view(unsigned) - _to_numpy(base_flat).view(unsigned)
        )
        dense = _as_bytes(contents.encode_codes(all_codes))
        candidates.append(Encoded("dense", changed, {"values": dense}))
    return min(candidates, key=lambda e: e.nbytes)


def _sparse(positions: I64, values: U8, changed: int) -> Encoded:
    gaps = rice.positions_to_gaps(positions)
    param, _ = rice.best_param(gaps)
    unary, fixed = rice.encode_gaps(gaps, param)
    return Encoded(
        "sparse", changed, {"unary": unary, "fixed": fixed, "values": values}, {"rice": param}
    )


def _classed(
    positions: I64, pos_classes: I64, values: U8, changed: int, index: ClassIndex
) -> Encoded:
    ncls = index.start.size - 1
    group = np.argsort(pos_classes, kind="stable")
    per_class = np.bincount(pos_classes, minlength=ncls)
    unary_parts: list[U8] = []
    fixed_parts: list[U8] = []
    table: list[list[int]] = []
    offset = 0
    for cls in np.flatnonzero(per_class):
        k_c = int(per_class[cls])
        members = index.order[index.start[cls] : index.start[cls + 1]]
        mine = positions[group[offset : offset + k_c]]
        offset += k_c
        local = np.searchsorted(members, mine)
        n_c = members.size
        inverted = 2 * k_c > n_c
        if inverted:
            keep = np.ones(n_c, bool)
            keep[local] = False
            local = np.flatnonzero(keep)
        gaps = rice.positions_to_gaps(local)
        param, _ = rice.best_param(gaps)
        unary_parts.append(rice.unary_bits(gaps >> param))
        fixed_parts.append(rice.fixed_bits(gaps & ((1 << param) - 1), param))
        table.append([int(cls), k_c, param, int(inverted)])
    unary = np.packbits(np.concatenate(unary_parts))
    fixed = np.packbits(np.concatenate(fixed_parts))
    return Encoded(
        "classed", changed, {"unary": unary, "fixed": fixed, "values": values}, {"classes": table}
    )


# ----------------------------------------------------------------------------- decoding


class DamagedStreamError(Exception):
    """A stream does not decode to what its record promises (reason in the message)."""


def decode_positions(rec: TensorRecord, streams: dict[str, U8], base_flat: torch.Tensor) -> I64:
    """Flat positions of the changed elements, strictly increasing and in range."""
    encoding, changed, numel, params = rec.encoding, rec.changed, rec.numel, rec.params
    if encoding == "same":
        return np.zeros(0, np.int64)
    if encoding == "sparse":
        param = int(params["rice"])
        gaps = rice.decode_gaps(streams["unary"], streams["fixed"], changed, param)
        if gaps is None:
            raise DamagedStreamError("position stream does not hold the recorded number of gaps")
        positions = rice.gaps_to_positions(gaps)
    elif encoding == "classed":
        positions = _decode_classed(changed, streams, params["classes"], base_flat, rec.info)
    elif encoding == "bitmap":
        raw = contents.decompress(streams["mask"], (numel + 7) // 8)
        if raw is None:
            raise DamagedStreamError("change mask does not decompress to the tensor's size")
        bits = np.unpackbits(np.frombuffer(raw, np.uint8))
        if bits[numel:].any():
            raise DamagedStreamError("change mask has bits set past the end of the tensor")
        positions = np.flatnonzero(bits).astype(np.int64)
        if positions.size != changed:
            raise DamagedStreamError(
                f"change mask marks {positions.size} elements, record says {changed}"
            )
    else:
        raise DamagedStreamError(f"unknown encoding {encoding!r}")
    if positions.size and int(positions[-1]) >= numel:
        raise DamagedStreamError(
            f"position {int(positions[-1])} is out of range for {numel} elements"
        )
    return positions


def _decode_classed(
    changed: int,
    streams: dict[str, U8],
    table: list[list[int]],
    base_flat: torch.Tensor,
    info: DtypeInfo,
) -> I64:
    index = ClassIndex.build(base_flat, info)
    coded_counts: list[int] = []
    for cls, k_c, _, inverted in table:
        n_c = int(index.start[cls + 1] - index.start[cls])
        if k_c > n_c:
            raise DamagedStreamError(
                f"class {cls} has {n_c} elements in the base, record says {k_c} changed"
            )
        coded_counts.append(n_c - k_c if inverted else k_c)
    total = sum(coded_counts)
    quotients = rice.unpack_unary(streams["unary"], total)
    if quotients is None:
        raise DamagedStreamError("position stream does not hold the recorded number of gaps")
    fixed_total = sum(m * entry[2] for m, entry in zip(coded_counts, table, strict=True))
    fixed = streams["fixed"]
    if fixed.size != (fixed_total + 7) // 8:
        raise DamagedStreamError("fixed-width position stream has the wrong size")
    fixed_bits = np.unpackbits(fixed)
    parts: list[I64] = []
    q_off = 0
    f_off = 0
    for (cls, _, param, inverted), m in zip(table, coded_counts, strict=True):
        q = quotients[q_off : q_off + m]
        rem = rice.bits_to_ints(fixed_bits[f_off : f_off + m * param], m, param)
        q_off += m
        f_off += m * param
        local = rice.gaps_to_positions((q << param) | rem)
        members = index.order[index.start[cls] : index.start[cls + 1]]
        if local.size and int(local[-1]) >= members.size:
            raise DamagedStreamError(f"class {cls} position out of range")
        if inverted:
            keep = np.ones(members.size, bool)
            keep[local] = False
            local = np.flatnonzero(keep)
        parts.append(members[local])
    positions = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    if positions.size != changed:
        raise DamagedStreamError(
            f"classes decode to {positions.size} positions, record says {changed}"
        )
    return positions


def decode_values(
    rec: TensorRecord, streams: dict[str, U8], base_flat: torch.Tensor
) -> tuple[I64, AnyUInt]:
    """(positions, new contents as unsigned integers) of the changed elements."""
    encoding, changed, numel = rec.encoding, rec.changed, rec.numel
    unsigned = rec.info.unsigned
    if encoding == "dense":
        codes = contents.decode_codes(streams["values"], numel, unsigned)
        if codes is None:
            raise DamagedStreamError("contents do not decompress to the tensor's size")
        diff = contents.unzigzag(codes)
        positions = np.flatnonzero(diff).astype(np.int64)
        if positions.size != changed:
            raise DamagedStreamError(
                f"contents change {positions.size} elements, record says {changed}"
            )
        diff = diff[positions]
    else:
        positions = decode_positions(rec, streams, base_flat)
        if encoding == "same":
            return positions, np.zeros(0, unsigned)
        codes = contents.decode_codes(streams["values"], changed, unsigned)
        if codes is None:
            raise DamagedStreamError("contents do not decompress to the recorded count")
        diff = contents.unzigzag(codes)
        if not diff.all():
            raise DamagedStreamError("contents hold a zero difference for a changed element")
    index_t = torch.from_numpy(positions).to(base_flat.device)
    base_vals = _to_numpy(base_flat[index_t]).view(unsigned)
    return positions, base_vals + diff
