"""The compiled loops of mixsum.py, imported only where numba is installed.

Module-level functions, so that numba's disk cache (``cache=True``) serves them to
the next process instead of compiling again. All arithmetic is on uint64 (it wraps
modulo 2^64); every constant is a uint64 so that nothing is promoted to float.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline import kernel_cache
from pipeline.format.hashes.mixsum_keys import KEYS
from pipeline.intrinsics_jit import AHEAD, prefetch_read

jit = kernel_cache.jit  # numba.njit(cache=True, nogil=True), cached in the kernels folder

_K_POS = np.uint64(KEYS[0])
_K_A = np.uint64(KEYS[1])
_K_B = np.uint64(KEYS[2])
_ODD = np.uint64(KEYS[3])
_S1 = np.uint64(0xBF58476D1CE4E5B9)
_S2 = np.uint64(0x94D049BB133111EB)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_R30 = np.uint64(30)
_R27 = np.uint64(27)
_R31 = np.uint64(31)
_R33 = np.uint64(33)
_L29 = np.uint64(29)
_R35 = np.uint64(35)


@jit  # type: ignore[untyped-decorator,misc]
def _lanes(i: Any, b: Any) -> tuple[Any, Any]:
    """(lane a, lane b) of element bits ``b`` at flat position ``i``; see mixsum.py."""
    s = i ^ _K_POS
    s = (s ^ (s >> _R30)) * _S1
    s = (s ^ (s >> _R27)) * _S2
    s = s ^ (s >> _R31)
    a = s ^ b ^ _K_A
    a = (a ^ (a >> _R33)) * _M1
    a = (a ^ (a >> _R33)) * _M2
    a = a ^ (a >> _R33)
    c = ((s << _L29) | (s >> _R35)) + b * _ODD + _K_B
    c = (c ^ (c >> _R30)) * _S1
    c = (c ^ (c >> _R27)) * _S2
    c = c ^ (c >> _R31)
    return a, c


@jit  # type: ignore[untyped-decorator,misc]
def full_sum(flat: Any, start: int) -> Any:
    """Both lane sums over ``flat`` (unsigned integers), whose first element sits at
    flat position ``start`` of its tensor."""
    return runs_sum(flat, np.full(1, start, np.int64), flat.size)


@jit  # type: ignore[untyped-decorator,misc]
def runs_sum(flat: Any, starts: Any, width: int) -> Any:
    """:func:`full_sum` of a piece laid out as runs: its element ``r * width + j`` sits
    at flat position ``starts[r] + j`` (``flat.size == starts.size * width``)."""
    sa = np.uint64(0)
    sb = np.uint64(0)
    for r in range(starts.size):
        base = np.uint64(starts[r])
        at = r * width
        for j in range(width):
            a, c = _lanes(base + np.uint64(j), np.uint64(flat[at + j]))
            sa += a
            sb += c
    out = np.empty(2, np.uint64)
    out[0] = sa
    out[1] = sb
    return out


@jit  # type: ignore[untyped-decorator,misc]
def change_sum(positions: Any, old: Any, new: Any, offset: int) -> Any:
    """Both lane sums of f(offset + i, new_i) - f(offset + i, old_i) over the changed
    positions ``i``. A loop of its own, after the gather: with the hash in the
    gather's loop each cold-cache miss stalled it (6-10x slower at 2M positions in a
    1.2 GB state), and inside the delta walk's batches, whose lines are prefetched,
    it was still slower than this second pass (docs/PERFORMANCE.md)."""
    sa = np.uint64(0)
    sb = np.uint64(0)
    at = np.uint64(offset)
    for k in range(positions.size):
        i = np.uint64(positions[k]) + at
        na, nc = _lanes(i, np.uint64(new[k]))
        oa, oc = _lanes(i, np.uint64(old[k]))
        sa += na - oa
        sb += nc - oc
    out = np.empty(2, np.uint64)
    out[0] = sa
    out[1] = sb
    return out


@jit  # type: ignore[untyped-decorator,misc]
def change_sums(positions: Any, old: Any, new: Any, bounds: Any) -> Any:
    """:func:`change_sum` of each of several tensors' changes laid back to back:
    tensor k's are ``[bounds[k], bounds[k + 1])``; row k of the result is its two
    lane sums."""
    out = np.empty((bounds.size - 1, 2), np.uint64)
    for k in range(bounds.size - 1):
        lo, hi = bounds[k], bounds[k + 1]
        # Element by element (a row assignment compiles a shape check with its error
        # message, seconds of compiling), the offset not a literal (the compiled
        # change_sum that Python calls serves).
        sums = change_sum(positions[lo:hi], old[lo:hi], new[lo:hi], np.int64(0))
        out[k, 0] = sums[0]
        out[k, 1] = sums[1]
    return out


@jit  # type: ignore[untyped-decorator,misc]
def gather(positions: Any, held: Any, diffs: Any, old: Any, new: Any) -> int:
    """``old = held[positions]``, ``new = old + diffs`` (wrapping in the width); -1,
    nothing read, at a position out of range (compiled code checks no bounds itself)."""
    size = held.size
    n = positions.size
    for k in range(n):
        if positions[k] < 0 or positions[k] >= size:
            return -1
    for k in range(n):
        if k + AHEAD < n:  # the lines of later positions requested while this one waits
            prefetch_read(held, positions[k + AHEAD])
        o = held[positions[k]]
        old[k] = o
        new[k] = o + diffs[k]
    return 0
