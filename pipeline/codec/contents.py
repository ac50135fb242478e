"""Contents of changed elements: bit-pattern differences new - base.

Realistic updates move a bf16 element by one or two units in the last place, so
the difference of the integer views is tiny. Two methods; the encoder picks by the
share of +-1 differences (:func:`signmag_pays`), where the smaller one lies:

- ``signmag``: the sign of each difference as one raw bit (signs are close to
  fair coins, nothing compresses them); which magnitudes exceed one as
  Rice-coded gaps; those magnitudes minus two as zstd byte planes.
- ``planes``: zigzagged differences split into byte planes, one zstd frame.
  Better when differences are large (fp32 contents, dense rewrites).
"""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import zstandard

from pipeline.codec import rice
from pipeline.codec.compiled import fused

ZSTD_LEVEL = 3
METHODS = ("planes", "signmag")
ROLES = {"planes": ("values",), "signmag": ("sign", "big_unary", "big_fixed", "mags")}

AnyUInt = npt.NDArray[np.unsignedinteger]
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
Frame = bytes | memoryview | U8


class ContentsError(Exception):
    """Contents streams do not decode to what the record promises."""


def _buffer(data: Frame) -> memoryview:
    return memoryview(data.data if isinstance(data, np.ndarray) else data)


_local = threading.local()


def scratch(role: str, size: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A per-thread buffer of at least ``size`` elements, reused across calls (fresh
    large arrays cost a page fault per 4 KiB on first touch). The returned view is
    valid until the next call for the same role on the same thread."""
    buffers: dict[str, npt.NDArray[Any]] | None = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    key = f"{role}:{np.dtype(dtype).str}"
    buffer = buffers.get(key)
    if buffer is None or buffer.size < size:
        buffer = buffers[key] = np.empty(max(size, 1 << 12), dtype)
    return buffer[:size]


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """Per-thread zstd contexts: creating one per frame costs more than a small frame.
    Reuse does not change the output."""
    pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
        _local, "zstd", None
    )
    if pair is None:
        pair = _local.zstd = (
            zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True),
            zstandard.ZstdDecompressor(),
        )
    return pair


def compress(data: Frame) -> U8:
    return np.frombuffer(_zstd()[0].compress(_buffer(data)), np.uint8)


def frame_content_size(frame: Frame) -> int:
    """Declared decompressed size of a zstd frame, or -1 when unreadable or absent."""
    try:
        size = zstandard.frame_content_size(_buffer(frame))
    except zstandard.ZstdError:
        return -1
    return int(size)


def decompress(frame: Frame, expected: int) -> bytes | None:
    """Decompress exactly ``expected`` bytes; None when the frame is damaged."""
    if frame_content_size(frame) != expected:
        return None
    try:
        out = _zstd()[1].decompress(_buffer(frame), max_output_size=expected)
    except zstandard.ZstdError:
        return None
    return out if len(out) == expected else None


def zigzag(diff: AnyUInt) -> AnyUInt:
    """Two's-complement differences (as unsigned) -> small unsigned numbers."""
    top = diff.dtype.itemsize * 8 - 1
    sign = (diff >> top).astype(diff.dtype)
    return cast(AnyUInt, (diff << 1) ^ (np.zeros_like(sign) - sign))


def unzigzag(code: AnyUInt) -> AnyUInt:
    low = (code & 1).astype(code.dtype)
    return cast(AnyUInt, (code >> 1) ^ (np.zeros_like(low) - low))


def encode_planes(codes: AnyUInt) -> U8:
    """Unsigned numbers -> byte planes (least significant first) -> one zstd frame."""
    width = codes.dtype.itemsize
    if width == 1:
        return compress(codes.view(np.uint8))
    return compress(np.ascontiguousarray(codes.view(np.uint8).reshape(-1, width).T))


def decode_planes(frame: Frame, count: int, unsigned: type[np.unsignedinteger]) -> AnyUInt:
    width = np.dtype(unsigned).itemsize
    raw = decompress(frame, count * width)
    if raw is None:
        raise ContentsError("contents frame does not decompress to the recorded size")
    planes = np.frombuffer(raw, np.uint8).reshape(width, count)
    return np.ascontiguousarray(planes.T).view(unsigned).reshape(count)


def signmag_pays(ones: int, count: int) -> bool:
    """Sign-magnitude contents are smaller than byte planes: at least 2 in 5 of the
    ``count`` differences are +-1 (fused.SIGNMAG_ONES / SIGNMAG_OF). Below that they
    may not be: large differences cost their sign twice and their index."""
    return fused.SIGNMAG_OF * ones >= fused.SIGNMAG_ONES * count


def encode_contents(diff: AnyUInt) -> tuple[dict[str, U8], dict[str, Any]]:
    """Streams and params for the differences new - base (unsigned, wrapping) of
    the changed elements.

    Sign-magnitude where it pays (:func:`signmag_pays`), byte planes otherwise;
    elements of up to 4 bytes in one compiled pass, wider ones in numpy."""
    count = diff.size
    if diff.itemsize <= 4:
        signs = np.empty((count + 7) // 8, np.uint8)
        big_buf = scratch("big", count, np.int64)
        mags_buf = scratch("mags", count, diff.dtype)
        top = (1 << (8 * diff.itemsize)) - 1
        ones, nbig = fused.get().signmag_diffs(diff, top, signs, big_buf, mags_buf)
        if signmag_pays(ones, count):
            return _signmag_streams(signs, big_buf[:nbig], mags_buf[:nbig])
        return {"values": encode_planes(zigzag(diff))}, {"contents": "planes"}
    minus_one = np.iinfo(diff.dtype).max
    ones = int(np.count_nonzero((diff == 1) | (diff == minus_one)))
    if not signmag_pays(ones, count):
        return {"values": encode_planes(zigzag(diff))}, {"contents": "planes"}
    negative = (diff >> (diff.dtype.itemsize * 8 - 1)).astype(np.uint8)
    magnitude = np.where(negative.astype(bool), np.zeros_like(diff) - diff, diff)
    big = np.flatnonzero(magnitude > 1)
    return _signmag_streams(np.packbits(negative), big, magnitude[big] - 2)


def _signmag_streams(signs: U8, big: I64, mags: AnyUInt) -> tuple[dict[str, U8], dict[str, Any]]:
    big_unary, big_fixed, param = rice.encode_positions(big)
    streams = {
        "sign": signs,
        "big_unary": big_unary,
        "big_fixed": big_fixed,
        "mags": encode_planes(mags) if big.size else np.zeros(0, np.uint8),
    }
    return streams, {"contents": "signmag", "big": int(big.size), "big_rice": param}


def check_contents(
    streams: dict[str, U8], params: dict[str, Any], count: int, width: int
) -> str | None:
    """Cheap consistency checks before decoding; a reason string when inconsistent."""
    method = params.get("contents")
    if method == "planes":
        if frame_content_size(streams["values"]) != count * width:
            return f"contents frame does not declare {count * width} bytes"
        return None
    big, param = params.get("big"), params.get("big_rice")
    if type(big) is not int or not 0 <= big <= count:
        return f"count of large differences {big!r} not within 0..{count}"
    if type(param) is not int or not 0 <= param <= rice.MAX_PARAM:
        return f"Rice parameter {param!r} out of range"
    if streams["sign"].size != (count + 7) // 8:
        return "sign stream has the wrong size"
    if streams["big_fixed"].size != rice.fixed_nbytes(big, param):
        return "fixed-width stream of large differences has the wrong size"
    if streams["big_unary"].size > (big + (count >> param) + 7) // 8:
        return "unary stream of large differences is too long"
    mags = streams["mags"]
    if (mags.size > 0) != (big > 0) or (big and frame_content_size(mags) != big * width):
        return "magnitude frame does not match the count of large differences"
    return None


def signmag_parts(
    streams: dict[str, U8], params: dict[str, Any], count: int, unsigned: type[np.unsignedinteger]
) -> tuple[U8, I64, AnyUInt]:
    """Packed sign bits, indices of magnitudes above one, and those magnitudes - 2."""
    big_count, param = int(params["big"]), int(params["big_rice"])
    big = rice.decode_positions(streams["big_unary"], streams["big_fixed"], big_count, param, count)
    if big is None:
        raise ContentsError("large-difference streams do not hold the recorded count")
    mags = decode_planes(streams["mags"], big.size, unsigned) if big.size else np.zeros(0, unsigned)
    return streams["sign"], big, mags


def decode_contents(
    streams: dict[str, U8], params: dict[str, Any], count: int, unsigned: type[np.unsignedinteger]
) -> AnyUInt:
    """The non-zero differences (unsigned, wrapping) of ``count`` changed elements."""
    if params["contents"] == "planes":
        diff = unzigzag(decode_planes(streams["values"], count, unsigned))
    else:
        signs, big, mags = signmag_parts(streams, params, count, unsigned)
        magnitude = np.ones(count, unsigned)
        magnitude[big] = mags + unsigned(2)
        negative = np.unpackbits(signs, count=count).astype(bool)
        diff = np.where(negative, np.zeros_like(magnitude) - magnitude, magnitude)
    if not diff.all():
        raise ContentsError("contents hold a zero difference for a changed element")
    return diff
