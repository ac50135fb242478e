"""Rice coding of strictly increasing positions as gaps.

Each gap g (slots skipped since the previous position) is split into
q = g >> r and its r low bits. The quotients go to a unary stream (q zeros then
a one, MSB first) and the low bits to a fixed-width stream. The compiled kernels
(fused.py) write both in one loop and read them a word at a time
(tests/codec_reference.py has the same coding in whole-array numpy passes). The
parameter r is chosen per call for the fewest bits.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeline.codec.compiled import fused, kernels

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

MAX_PARAM = fused.MAX_PARAM


def fixed_nbytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


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
    if out is None:
        out = np.empty(count, np.int64)
    # The reader loads 8 bytes at a time from the streams' memory: no strides.
    unary, fixed = np.ascontiguousarray(unary), np.ascontiguousarray(fixed)
    return out if fused.get().read_positions(unary, fixed, param, limit, out) else None
