"""Positions of changed elements: Rice-coded gaps or a bitmap."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, rice

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
ROLES = {"sparse": ("unary", "fixed"), "bitmap": ("mask",)}


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


# ----------------------------------------------------------------------------- checks


def check_positions(
    encoding: str,
    streams: dict[str, U8],
    params: dict[str, Any],
    *,
    changed: int,
    numel: int,
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
