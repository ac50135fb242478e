"""Positions of changed elements: Rice-coded gaps, per exponent class, or a bitmap.

``classed`` (level 2) uses what the receiver already holds: the chance that an
element changes depends strongly on the exponent of its base value (an update
of fixed size crosses a rounding boundary far more often where the unit in the
last place is small). Elements are grouped by the exponent of the base value;
each class codes the gaps between its changed elements in class-local
coordinates with its own Rice parameter, or the gaps between its unchanged
elements when most of the class changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, rice
from pipeline.codec.dtypes import DtypeInfo

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
ROLES = {"sparse": ("unary", "fixed"), "classed": ("unary", "fixed"), "bitmap": ("mask",)}


class PositionsError(Exception):
    """Position streams do not decode to what the record promises."""


def to_numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()


# ----------------------------------------------------------------------------- sparse


def encode_sparse(positions: I64) -> tuple[dict[str, U8], dict[str, Any]]:
    unary, fixed, param = rice.encode_positions(positions)
    return {"unary": unary, "fixed": fixed}, {"rice": param}


def decode_sparse(streams: dict[str, U8], params: dict[str, Any], changed: int, numel: int) -> I64:
    out = rice.decode_positions(
        streams["unary"], streams["fixed"], changed, int(params["rice"]), numel
    )
    if out is None:
        raise PositionsError("position streams do not hold the recorded gaps within the tensor")
    return out


# ----------------------------------------------------------------------------- bitmap


def encode_bitmap(mask: npt.NDArray[np.bool_]) -> dict[str, U8]:
    return {"mask": contents.compress(np.packbits(mask))}


def decode_bitmap(streams: dict[str, U8], changed: int, numel: int) -> I64:
    raw = contents.decompress(streams["mask"], (numel + 7) // 8)
    if raw is None:
        raise PositionsError("change mask does not decompress to the tensor's size")
    bits = np.unpackbits(np.frombuffer(raw, np.uint8))
    if bits[numel:].any():
        raise PositionsError("change mask has bits set past the end of the tensor")
    positions = np.flatnonzero(bits).astype(np.int64)
    if positions.size != changed:
        raise PositionsError(f"change mask marks {positions.size} elements, record says {changed}")
    return positions


# ----------------------------------------------------------------------------- classed


@dataclass(frozen=True)
class ClassIndex:
    """Elements grouped by exponent class: ``order[start[c]:start[c + 1]]`` are the
    flat positions of class c, ascending."""

    order: I64
    start: I64

    @staticmethod
    def build(base_flat: torch.Tensor, info: DtypeInfo) -> ClassIndex:
        assert info.exponent is not None
        shift, top = info.exponent
        small = np.uint8 if top < 256 else np.uint16
        classes = ((to_numpy(base_flat).view(info.unsigned) >> shift) & top).astype(small)
        # A stable sort of 8- or 16-bit keys is a radix sort in numpy: linear time.
        order = np.argsort(classes, kind="stable")
        start = np.zeros(top + 2, np.int64)
        np.cumsum(np.bincount(classes, minlength=top + 1), out=start[1:])
        return ClassIndex(order=order.astype(np.int64, copy=False), start=start)

    def members(self, cls: int) -> I64:
        return self.order[self.start[cls] : self.start[cls + 1]]


def encode_classed(
    positions: I64, pos_classes: I64, index: ClassIndex
) -> tuple[dict[str, U8], dict[str, Any]]:
    group = np.argsort(pos_classes, kind="stable")
    per_class = np.bincount(pos_classes, minlength=index.start.size - 1)
    unary_parts: list[U8] = []
    fixed_parts: list[U8] = []
    table: list[list[int]] = []
    offset = 0
    for cls in np.flatnonzero(per_class).tolist():  # over classes, at most 2048
        k_c = int(per_class[cls])
        members = index.members(cls)
        local = np.searchsorted(members, positions[group[offset : offset + k_c]])
        offset += k_c
        inverted = 2 * k_c > members.size
        if inverted:
            keep = np.ones(members.size, bool)
            keep[local] = False
            local = np.flatnonzero(keep)
        gaps = rice.positions_to_gaps(local)
        param, _ = rice.best_param(gaps)
        unary_parts.append(rice.unary_bits(gaps >> param))
        fixed_parts.append(rice.fixed_bits(gaps & ((1 << param) - 1), param))
        table.append([cls, k_c, param, int(inverted)])
    streams = {
        "unary": np.packbits(np.concatenate(unary_parts)),
        "fixed": np.packbits(np.concatenate(fixed_parts)),
    }
    return streams, {"classes": table}


def decode_classed(
    streams: dict[str, U8], params: dict[str, Any], changed: int, index: ClassIndex
) -> I64:
    table: list[list[int]] = params["classes"]
    coded: list[int] = []
    for cls, k_c, _, inverted in table:
        n_c = int(index.start[cls + 1] - index.start[cls])
        if k_c > n_c:
            raise PositionsError(
                f"exponent class {cls} has {n_c} elements in the base, record says {k_c} changed"
            )
        coded.append(n_c - k_c if inverted else k_c)
    quotients = rice.unpack_unary(streams["unary"], sum(coded))
    if quotients is None:
        raise PositionsError("position stream does not hold the recorded number of gaps")
    fixed_total = sum(m * entry[2] for m, entry in zip(coded, table, strict=True))
    if streams["fixed"].size != (fixed_total + 7) // 8:
        raise PositionsError("fixed-width position stream has the wrong size")
    fixed_bits = np.unpackbits(streams["fixed"])
    parts: list[I64] = []
    q_off = f_off = 0
    for (cls, _, param, inverted), m in zip(table, coded, strict=True):
        members = index.members(cls)
        q = quotients[q_off : q_off + m]
        if m and int(q.max()) > (members.size >> param):
            raise PositionsError(f"exponent class {cls}: gap out of range")
        rem = rice.bits_to_ints(fixed_bits[f_off : f_off + m * param], m, param)
        local = rice.gaps_to_positions((q << param) | rem)
        q_off += m
        f_off += m * param
        if local.size and int(local[-1]) >= members.size:
            raise PositionsError(f"exponent class {cls}: position out of range")
        if inverted:
            keep = np.ones(members.size, bool)
            keep[local] = False
            local = np.flatnonzero(keep)
        parts.append(members[local])
    positions = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    if positions.size != changed:
        raise PositionsError(f"classes decode to {positions.size} positions, record says {changed}")
    return positions


# ----------------------------------------------------------------------------- checks


def check_positions(
    encoding: str,
    streams: dict[str, U8],
    params: dict[str, Any],
    *,
    changed: int,
    numel: int,
    exponent_top: int | None,
) -> str | None:
    """Cheap consistency checks before decoding; a reason string when inconsistent."""
    if encoding == "bitmap":
        if contents.frame_content_size(streams["mask"]) != (numel + 7) // 8:
            return "change mask does not declare the tensor's size"
        return None
    if encoding == "sparse":
        param = params.get("rice")
        if type(param) is not int or not 0 <= param <= rice.MAX_PARAM:
            return f"Rice parameter {param!r} out of range"
        if streams["fixed"].size != rice.fixed_nbytes(changed, param):
            return "fixed-width position stream has the wrong size"
        max_bits = changed + ((numel - changed) >> param)
        if not (changed + 7) // 8 <= streams["unary"].size <= (max_bits + 7) // 8:
            return "unary position stream has an impossible size"
        return None
    if encoding == "classed":
        return _check_classes(streams, params, changed, numel, exponent_top)
    return None


def _check_classes(
    streams: dict[str, U8],
    params: dict[str, Any],
    changed: int,
    numel: int,
    exponent_top: int | None,
) -> str | None:
    if exponent_top is None:
        return "positions coded by exponent class for a dtype without exponent"
    table = params.get("classes")
    if not isinstance(table, list) or not table:
        return "exponent class table missing"
    seen: set[int] = set()
    total = 0
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 4 and all(type(x) is int for x in entry)):
            return "exponent class table entry malformed"
        cls, k_c, param, inverted = entry
        if not (
            0 <= cls <= exponent_top
            and cls not in seen
            and k_c >= 1
            and 0 <= param <= rice.MAX_PARAM
            and inverted in (0, 1)
        ):
            return f"exponent class table entry {entry} invalid"
        seen.add(cls)
        total += k_c
    if total != changed:
        return f"exponent class counts sum to {total}, record says {changed}"
    if streams["unary"].size > (2 * numel + 7) // 8:
        return "unary position stream has an impossible size"
    if streams["fixed"].size > rice.fixed_nbytes(numel, rice.MAX_PARAM):
        return "fixed-width position stream has an impossible size"
    return None
