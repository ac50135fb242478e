"""The compiled loop of confirmed.py, imported only where numba is installed.

A module-level function, so that numba's disk cache (``cache=True``) serves it to the
next process instead of compiling again.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped]

jit = numba.njit(cache=True, nogil=True)

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
