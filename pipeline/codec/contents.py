"""Contents of changed elements: bit-pattern differences, zigzagged, byte planes, zstd.

Realistic updates move a bf16 element by one or two units in the last place, so
the difference new - base of the integer views is tiny; zigzag maps it to a
small unsigned number and splitting it into byte planes leaves the high planes
all zero, which zstd squeezes to almost nothing.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt
import zstandard

ZSTD_LEVEL = 3

AnyUInt = npt.NDArray[np.unsignedinteger]
U8 = npt.NDArray[np.uint8]
Frame = bytes | memoryview | U8


def zigzag(diff: AnyUInt) -> AnyUInt:
    """Two's-complement differences (as unsigned) -> small unsigned numbers."""
    top = diff.dtype.itemsize * 8 - 1
    sign = (diff >> top).astype(diff.dtype)
    return cast(AnyUInt, (diff << 1) ^ (np.zeros_like(sign) - sign))


def unzigzag(code: AnyUInt) -> AnyUInt:
    low = (code & 1).astype(code.dtype)
    return cast(AnyUInt, (code >> 1) ^ (np.zeros_like(low) - low))


def _buffer(data: Frame) -> memoryview:
    return memoryview(data.data if isinstance(data, np.ndarray) else data)


def compress(data: Frame) -> bytes:
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return compressor.compress(_buffer(data))


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
        out = zstandard.ZstdDecompressor().decompress(_buffer(frame), max_output_size=expected)
    except zstandard.ZstdError:
        return None
    return out if len(out) == expected else None


def encode_codes(codes: AnyUInt) -> bytes:
    """Zigzag codes -> byte planes (least significant first) -> one zstd frame."""
    width = codes.dtype.itemsize
    planes = codes.view(np.uint8).reshape(-1, width).T if width > 1 else codes.view(np.uint8)
    return compress(np.ascontiguousarray(planes))


def decode_codes(frame: Frame, count: int, unsigned: type[np.unsignedinteger]) -> AnyUInt | None:
    width = np.dtype(unsigned).itemsize
    raw = decompress(frame, count * width)
    if raw is None:
        return None
    planes = np.frombuffer(raw, np.uint8).reshape(width, count)
    return np.ascontiguousarray(planes.T).view(unsigned).reshape(count)
