"""The compiled loop of confirmed.py, imported only where numba is installed.

A module-level function, so that numba's disk cache (``cache=True``) serves it to the
next process instead of compiling again.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped]
import numpy as np

from pipeline import kernel_cache
from pipeline.intrinsics_jit import pointer_like

jit = kernel_cache.jit  # numba.njit(cache=True, nogil=True), cached in the kernels folder

# Elements written, then read back, per block: the block's cache lines (at most one
# per element, 64 KiB at 1024) are still in L1/L2 when read back, so the read-back
# costs no second round of misses over the cold weights.
BLOCK = 1024

UNSORTED = -2


@jit  # type: ignore[untyped-decorator,misc]
def write_confirmed(target: Any, positions: Any, values: Any) -> int:
    """``target[positions] = values``, block by block, each block read back from
    ``target`` right after its writes. -1 when every written position holds its new
    contents; UNSORTED, nothing written, unless ``positions`` are strictly ascending
    and in range (no position is written twice, so no later write of this call can
    change one already confirmed); else the first index ``k`` whose read-back differs.
    ``target`` may alias ``positions`` or ``values`` as far as the compiler knows, so
    it cannot forward the stores to the loads: each read-back is a load from memory."""
    n = positions.size
    last = -1
    for k in range(n):
        p = positions[k]
        if p <= last or p >= target.size:
            return UNSORTED
        last = p
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        for k in range(start, end):
            target[positions[k]] = values[k]
        for k in range(start, end):
            if target[positions[k]] != values[k]:
                return k
    return -1


@jit  # type: ignore[untyped-decorator,misc]
def write_confirmed_all(table: Any, like: Any) -> Any:
    """:func:`write_confirmed` of several patches, one row of ``table`` each: (target
    address, its element count, positions address, values address, count), the
    targets and values of ``like``'s dtype, the positions int64. Returns (rows done,
    -1) when all hold, else (the row at fault, what write_confirmed returned for it)."""
    positions_like = np.empty(0, np.int64)
    for r in range(table.shape[0]):
        row = table[r]
        target = numba.carray(pointer_like(row[0], like), row[1])
        positions = numba.carray(pointer_like(row[2], positions_like), row[4])
        values = numba.carray(pointer_like(row[3], like), row[4])
        found = write_confirmed(target, positions, values)
        if found != -1:
            return r, found
    return table.shape[0], -1
