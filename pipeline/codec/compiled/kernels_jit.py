"""The compiled loops of kernels.py, imported only where numba is installed.

Every function is defined at module level so that numba's disk cache
(``cache=True``) serves it to the next process instead of compiling again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline import kernel_cache

jit = kernel_cache.jit  # numba.njit(cache=True, nogil=True), cached in the kernels folder


@jit  # type: ignore[untyped-decorator,misc]
def rice_costs(positions: Any, first_param: int, count: int) -> Any:
    """Bits needed for the gaps of ``positions`` with parameters
    first_param .. first_param + count - 1 (count <= 3)."""
    shift0 = first_param
    shift1 = min(first_param + 1, 63)
    shift2 = min(first_param + 2, 63)
    sum0 = sum1 = sum2 = 0
    # Gaps from neighbours, three independent sums: the loop vectorises.
    if positions.size:
        sum0 = positions[0] >> shift0
        sum1 = positions[0] >> shift1
        sum2 = positions[0] >> shift2
    for i in range(1, positions.size):
        gap = positions[i] - positions[i - 1] - 1
        sum0 += gap >> shift0
        sum1 += gap >> shift1
        sum2 += gap >> shift2
    sums = (sum0, sum1, sum2)
    costs = np.zeros(count, np.int64)
    for c in range(count):
        costs[c] = sums[c] + positions.size * (1 + first_param + c)
    return costs


@jit  # type: ignore[untyped-decorator,misc]
def gather_add(base: Any, positions: Any, diff: Any, out: Any) -> None:
    """out = base[positions] + diff, wrapping in the unsigned width."""
    for i in range(positions.size):
        out[i] = base[positions[i]] + diff[i]


@jit  # type: ignore[untyped-decorator,misc]
def signmag_values(
    signs: Any, big: Any, mags: Any, base: Any, positions: Any, out: Any, top: int
) -> int:
    """out = base[positions] -+ magnitude, magnitudes 1 except at ``big`` where
    they are mags + 2, all modulo top + 1 (elements of at most 4 bytes); -1
    when a magnitude wraps to zero."""
    j = 0
    for i in range(positions.size):
        magnitude = np.int64(1)
        if j < big.size and big[j] == i:
            magnitude = (np.int64(mags[j]) + 2) & top
            if magnitude == 0:
                return -1
            j += 1
        value = np.int64(base[positions[i]])
        if (signs[i >> 3] >> (7 - (i & 7))) & 1:
            value -= magnitude
        else:
            value += magnitude
        out[i] = value & top
    return 0


@jit  # type: ignore[untyped-decorator,misc]
def scatter(target: Any, positions: Any, values: Any) -> int:
    """target[positions] = values; -1 and nothing written when a position is
    out of range (compiled code does not check bounds by itself)."""
    for i in range(positions.size):
        if positions[i] < 0 or positions[i] >= target.size:
            return -1
    for i in range(positions.size):
        target[positions[i]] = values[i]
    return 0


@jit  # type: ignore[untyped-decorator,misc]
def first_difference(target: Any, positions: Any, values: Any) -> int:
    """The first ``i`` whose ``target[positions[i]]`` is not ``values[i]`` (or whose
    position is out of range), -1 when all hold: a read-back of written positions."""
    for i in range(positions.size):
        p = positions[i]
        if p < 0 or p >= target.size or target[p] != values[i]:
            return i
    return -1
