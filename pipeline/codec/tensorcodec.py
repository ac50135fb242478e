"""Encode and decode one tensor's change.

Encodings (the smallest wins per tensor):
- ``same``: nothing changed, no streams.
- ``sparse``: positions as Rice-coded gaps, then contents.
- ``classed`` (level 2): positions coded per exponent class of the base value.
- ``bitmap``: zstd of the packed change mask, then contents.
- ``dense``: zigzagged difference of every element as zstd byte planes.
Contents are bit-pattern differences new - base in the integer view
(contents.py); decoding adds them to the receiver's base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, positions
from pipeline.codec.dtypes import DtypeInfo
from pipeline.codec.positions import ClassIndex, to_numpy

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
AnyUInt = npt.NDArray[np.unsignedinteger]

ENCODINGS = ("same", "sparse", "classed", "bitmap", "dense")
BITMAP_MIN_DENSITY = 1 / 32
DENSE_MIN_DENSITY = 1 / 4


class DamagedStreamError(Exception):
    """A stream does not decode to what its record promises (reason in the message)."""


@dataclass
class Encoded:
    encoding: str
    changed: int
    streams: dict[str, U8] = field(default_factory=dict)  # role -> bytes, in stored order
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(int(s.size) for s in self.streams.values())


def roles(encoding: str, params: dict[str, Any]) -> tuple[str, ...] | None:
    """The stream roles a record must have, in order; None when params are unusable."""
    if encoding == "same":
        return ()
    if encoding == "dense":
        return contents.ROLES["planes"]
    method = params.get("contents")
    if encoding not in positions.ROLES or method not in contents.ROLES:
        return None
    return positions.ROLES[encoding] + contents.ROLES[method]


def _changes(
    base_flat: torch.Tensor, new_flat: torch.Tensor, info: DtypeInfo
) -> tuple[I64, AnyUInt, AnyUInt, npt.NDArray[np.bool_]]:
    """Positions of changed elements, base and new contents there, and the mask."""
    unsigned = info.unsigned
    mask_t = torch.ne(base_flat, new_flat)
    if base_flat.device.type == "cpu":
        mask = mask_t.numpy()
        where = np.flatnonzero(mask)
        base_vals = base_flat.numpy().view(unsigned)[where]
        new_vals = new_flat.numpy().view(unsigned)[where]
        return where, base_vals, new_vals, mask
    where_t = torch.nonzero(mask_t).view(-1)
    return (
        to_numpy(where_t),
        to_numpy(base_flat[where_t]).view(unsigned),
        to_numpy(new_flat[where_t]).view(unsigned),
        to_numpy(mask_t),
    )


def encode_tensor(
    base_flat: torch.Tensor, new_flat: torch.Tensor, info: DtypeInfo, level: int
) -> Encoded:
    numel = base_flat.numel()
    if numel == 0:
        return Encoded("same", 0)
    where, base_vals, new_vals, mask = _changes(base_flat, new_flat, info)
    changed = where.size
    if changed == 0:
        return Encoded("same", 0)
    content_streams, content_params = contents.encode_contents(new_vals - base_vals)

    candidates: list[Encoded] = []
    if changed < numel:
        streams, params = positions.encode_sparse(where)
        candidates.append(Encoded("sparse", changed, streams, params))
        if level >= 2 and info.exponent is not None:
            index = ClassIndex.build(base_flat, info)
            assert info.exponent is not None
            shift, top = info.exponent
            classes = ((base_vals >> shift) & top).astype(np.int64)
            streams, params = positions.encode_classed(where, classes, index)
            candidates.append(Encoded("classed", changed, streams, params))
    if changed >= numel * BITMAP_MIN_DENSITY:
        candidates.append(Encoded("bitmap", changed, positions.encode_bitmap(mask)))
    best = min(candidates, key=lambda e: e.nbytes) if candidates else None
    if best is not None:
        best.streams.update(content_streams)
        best.params.update(content_params)
    if changed >= numel * DENSE_MIN_DENSITY:
        unsigned = info.unsigned
        all_diff = to_numpy(new_flat).view(unsigned) - to_numpy(base_flat).view(unsigned)
        dense = Encoded(
            "dense", changed, {"values": contents.encode_planes(contents.zigzag(all_diff))}
        )
        if best is None or dense.nbytes < best.nbytes:
            best = dense
    assert best is not None
    return best


def decode_tensor(
    encoding: str,
    changed: int,
    streams: dict[str, U8],
    params: dict[str, Any],
    *,
    base_flat: torch.Tensor,
    info: DtypeInfo,
) -> tuple[I64, AnyUInt]:
    """(positions, new contents as unsigned integers) of the changed elements."""
    numel = base_flat.numel()
    unsigned = info.unsigned
    try:
        if encoding == "same":
            return np.zeros(0, np.int64), np.zeros(0, unsigned)
        if encoding == "dense":
            diff = contents.unzigzag(contents.decode_planes(streams["values"], numel, unsigned))
            where = np.flatnonzero(diff).astype(np.int64)
            if where.size != changed:
                raise DamagedStreamError(
                    f"contents change {where.size} elements, record says {changed}"
                )
            diff = diff[where]
        else:
            if encoding == "sparse":
                where = positions.decode_sparse(streams, params, changed)
            elif encoding == "bitmap":
                where = positions.decode_bitmap(streams, changed, numel)
            else:
                index = ClassIndex.build(base_flat, info)
                where = positions.decode_classed(streams, params, changed, index)
            if where.size and int(where[-1]) >= numel:
                raise DamagedStreamError(
                    f"position {int(where[-1])} is out of range for {numel} elements"
                )
            diff = contents.decode_contents(streams, params, changed, unsigned)
    except (positions.PositionsError, contents.ContentsError) as exc:
        raise DamagedStreamError(str(exc)) from None
    if base_flat.device.type == "cpu":
        base_vals = base_flat.numpy().view(unsigned)[where]
    else:
        base_vals = to_numpy(base_flat[torch.from_numpy(where).to(base_flat.device)]).view(unsigned)
    return where, base_vals + diff
