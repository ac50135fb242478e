"""Rice coding of strictly increasing positions as gaps.

Each gap g (slots skipped since the previous position) is split into
q = g >> r and its r low bits. The quotients go to a unary stream (q zeros then
a one, MSB first) and the low bits to a fixed-width stream. Keeping the two
streams apart makes the numpy path a handful of whole-array passes (cumsum,
packbits / unpackbits, flatnonzero); the compiled path (fused.py) writes the
same bytes in one loop. The parameter r is chosen per call for the fewest bits.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeline.codec.compiled import fused, kernels

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

MAX_PARAM = fused.MAX_PARAM


def rice_cost_bits(gaps: I64, param: int) -> int:
    return int((gaps >> param).sum()) + gaps.size * (1 + param)


def best_param(gaps: I64) -> tuple[int, int]:
    """The Rice parameter with the fewest bits for these gaps, and that size."""
    if gaps.size == 0:
        return 0, 0
    first = max(0, _guess_param(gaps.size, int(gaps.sum())) - 1)
    best = (-1, -1)
    for param in range(first, min(MAX_PARAM, first + 2) + 1):
        cost = rice_cost_bits(gaps, param)
        if best[0] < 0 or cost < best[1]:
            best = (param, cost)
    return best


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
    if width == 8:
        return values.astype(np.uint8)
    if width == 16:
        return values.astype(">u2").view(np.uint8)
    if width < 8:
        # Eight values make exactly ``width`` bytes: assemble them in one uint64.
        groups = -(-values.size // 8)
        padded = np.zeros(groups * 8, np.uint64)
        padded[: values.size] = values
        shifts = (width * np.arange(7, -1, -1)).astype(np.uint64)
        combined = np.bitwise_or.reduce(padded.reshape(groups, 8) << shifts, axis=1)
        packed = combined.astype(">u8").view(np.uint8).reshape(groups, 8)[:, 8 - width :]
        out: U8 = packed.reshape(-1)[: fixed_nbytes(values.size, width)]
        return out
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((values[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1))


def unpack_fixed(stream: U8, count: int, width: int) -> I64:
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    if width == 8:
        return stream[:count].astype(np.int64)
    if width == 16:
        return stream[: 2 * count].view(">u2").astype(np.int64)
    if width < 8:
        groups = -(-count // 8)
        buf = np.zeros((groups, 8), np.uint8)
        body = np.zeros(groups * width, np.uint8)
        used = min(stream.size, body.size)
        body[:used] = stream[:used]
        buf[:, 8 - width :] = body.reshape(groups, width)
        combined = buf.view(">u8").reshape(groups).astype(np.uint64)
        shifts = (width * np.arange(7, -1, -1)).astype(np.uint64)
        parts = (combined[:, None] >> shifts) & np.uint64((1 << width) - 1)
        out8: I64 = parts.reshape(-1)[:count].astype(np.int64)
        return out8
    bits = np.unpackbits(stream, count=count * width).reshape(count, width)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    out: I64 = (bits.astype(np.int64) << shifts).sum(axis=1)
    return out


def fixed_nbytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


def encode_gaps(gaps: I64, param: int) -> tuple[U8, U8]:
    return pack_unary(gaps >> param), pack_fixed(gaps & ((1 << param) - 1), param)


def positions_to_gaps(positions: I64) -> I64:
    """Strictly increasing positions -> gaps (number of skipped slots before each)."""
    return np.diff(positions, prepend=-1) - 1


def gaps_to_positions(gaps: I64) -> I64:
    return np.cumsum(gaps + 1) - 1


def _guess_param(count: int, span: int) -> int:
    """Rice parameter near the optimum for ``count`` gaps summing to ``span``."""
    mean = span / max(count, 1)
    return max(0, min(MAX_PARAM, int(np.log2(mean * 0.69 + 1.0))))


def encode_positions(positions: I64) -> tuple[U8, U8, int]:
    """Strictly increasing non-negative positions -> (unary, fixed, parameter),
    with the parameter that gives the fewest bits."""
    if positions.size == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint8), 0
    compiled, writer = kernels.get(), fused.get()
    if compiled is None or writer is None:
        gaps = positions_to_gaps(positions)
        param, _ = best_param(gaps)
        unary, fixed = encode_gaps(gaps, param)
        return unary, fixed, param
    count = positions.size
    first = max(0, _guess_param(count, int(positions[-1]) + 1 - count) - 1)
    costs = compiled.rice_costs(positions, first, min(3, MAX_PARAM + 1 - first))
    param = first + int(np.argmin(costs))
    unary_n = (int(costs[param - first]) - count * param + 7) // 8
    # One buffer, the two streams back to back (as the one-call encoder writes them).
    out = np.empty(unary_n + fixed_nbytes(count, param), np.uint8)
    writer.rice_write(positions, count, param, out, 0, unary_n)
    return out[:unary_n], out[unary_n:], param


def decode_positions(
    unary: U8, fixed: U8, count: int, param: int, limit: int, out: I64 | None = None
) -> I64 | None:
    """Positions from ``encode_positions``' streams (into ``out`` when given: ``count``
    int64), or None when the streams do not hold exactly ``count`` codes (with zero
    padding) or a position reaches ``limit``."""
    if count == 0:
        return np.zeros(0, np.int64) if unary.size == 0 and fixed.size == 0 else None
    if fixed.size != fixed_nbytes(count, param):
        return None
    compiled = fused.get()
    if compiled is None:
        quotients = unpack_unary(unary, count)
        if quotients is None or int(quotients.max()) > (limit >> param):
            return None
        decoded = gaps_to_positions((quotients << param) | unpack_fixed(fixed, count, param))
        if out is None:
            out = decoded
        else:
            out[:] = decoded
    else:
        if out is None:
            out = np.empty(count, np.int64)
        # The reader loads 8 bytes at a time from the streams' memory: no strides.
        unary, fixed = np.ascontiguousarray(unary), np.ascontiguousarray(fixed)
        return out if compiled.read_positions(unary, fixed, param, limit, out) else None
    if int(out[-1]) >= limit:
        return None
    return out
