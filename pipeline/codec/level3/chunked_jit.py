"""The compiled code of chunked.py (level 3), imported only where numba is installed.

Module-level functions only, so that numba's disk cache serves them to the next
process. Layout of a chunk's bit stream (MSB first, see chunked.py): the unary
codes of every group (the magnitude buckets in order, then the large-magnitude
indices), then their fixed-width low bits in the same order, then one sign bit
per changed element, zero padding to a byte.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import binding as llvm  # type: ignore[import-untyped]
from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils, types  # type: ignore[import-untyped]
from numba.extending import intrinsic  # type: ignore[import-untyped]

from pipeline import kernel_cache
from pipeline.codec.compiled.fused_jit import (
    bit_reverse,
    neq_mask,
    peek,
    put_bits,
    put_tail,
    trailing_zeros,
)
from pipeline.intrinsics_jit import prefetch_write

jit = kernel_cache.jit  # numba.njit(cache=True, nogil=True), cached in the kernels folder

LANES = 64
# Changes whose contents a bucket walk writes at once: a few blocks' worth, so their
# lines are still in L1 and one call serves many blocks.
WALK_BATCH = 48
# Changes whose contents a chunk without buckets writes at once, so that the large
# magnitudes' second pass finds their lines in cache.
CONTENTS_BATCH = 256
WINDOW = np.uint64((1 << 56) - 1)  # the stream bits a peek guarantees, less one
MAX_PARAM = 40
# Outcomes of decode_chunks (chunked.py names them).
DONE = 0
BAD_UNARY = 1
BAD_FIXED = 2
BAD_POSITION = 3
BAD_CONTENTS = 4


def _lanes_and_splat(context: Any, builder: Any, sig: Any, args: Any) -> Any:
    """Codegen shared by the lane compares: the 64 elements of array args[0] from
    index args[1] as one vector, and a function that broadcasts a uint64 scalar to
    a vector of that element type."""
    element = context.get_data_type(sig.args[0].dtype)
    vector = ir.VectorType(element, LANES)
    array = context.make_array(sig.args[0])(context, builder, value=args[0])
    pointer = builder.bitcast(builder.gep(array.data, [args[1]]), vector.as_pointer())
    loaded = builder.load(pointer, align=1)
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)

    def splat(value: Any) -> Any:
        scalar = builder.trunc(value, element) if element.width < 64 else value
        one = builder.insert_element(
            ir.Constant(vector, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0)
        )
        return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), zeros)

    return loaded, splat


@intrinsic  # type: ignore[untyped-decorator,misc]
def below_mask(typingctx: Any, a: Any, start: Any, bound: Any, magnitude: Any) -> Any:
    """Bit j set where (a[start + j] & magnitude) < bound, j < 64 (one vector compare)."""
    signature = types.uint64(a, start, types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        loaded, splat = _lanes_and_splat(context, builder, sig, args)
        masked = builder.and_(loaded, splat(args[3]))
        below = builder.icmp_unsigned("<", masked, splat(args[2]))
        return builder.bitcast(below, ir.IntType(64))

    return signature, codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def shifted_at_least(typingctx: Any, a: Any, start: Any, add: Any, bound: Any) -> Any:
    """Bit j set where a[start + j] + add (wrapping at the element's width) >= bound,
    j < 64 (one vector compare)."""
    signature = types.uint64(a, start, types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        loaded, splat = _lanes_and_splat(context, builder, sig, args)
        shifted = builder.add(loaded, splat(args[2]))
        above = builder.icmp_unsigned(">=", shifted, splat(args[3]))
        return builder.bitcast(above, ir.IntType(64))

    return signature, codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def popcount(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def _pdep(typingctx: Any, x: Any, mask: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        word = ir.IntType(64)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(word, [word, word]), "llvm.x86.bmi.pdep.64"
        )
        return builder.call(function, args)

    return types.uint64(types.uint64, types.uint64), codegen


# The position of the r-th set bit (from 0) of byte v, at SELECT_IN_BYTE[8 * v + r].
SELECT_IN_BYTE = np.array(
    [[b for b in range(8) if v >> b & 1] + [0] * (8 - v.bit_count()) for v in range(256)],
    np.uint8,
).reshape(-1)
_L8, _H8 = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_M1, _M2 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)


@jit  # type: ignore[untyped-decorator,misc]
def _select_deposit(x: Any, mask: Any) -> Any:
    """pdep by selecting, for each set bit k of x, the k-th set bit of mask: its byte
    from the bytes' running popcounts (one subtraction compares all eight), its place
    in the byte from a table. A few operations per set bit of x, which holds about one
    change per block. x must have no bits past the count of mask's (``_low``)."""
    one = np.uint64(1)
    out = np.uint64(0)
    if x == 0:
        return out
    s = mask - ((mask >> one) & _M1)
    s = (s & _M2) + ((s >> np.uint64(2)) & _M2)
    s = ((s + (s >> np.uint64(4))) & _M4) * _L8  # byte i: set bits in bytes 0..i
    while x:
        k = np.uint64(trailing_zeros(x))
        # Bytes whose running count is at most k: their high bit stays clear.
        byte = popcount(~((s | _H8) - _L8 * (k + one)) & _H8)
        shift = np.uint64(8) * byte
        before = ((s << np.uint64(8)) >> shift) & np.uint64(255)
        v = (mask >> shift) & np.uint64(255)
        out |= one << (shift + np.uint64(SELECT_IN_BYTE[v * np.uint64(8) + k - before]))
        x &= x - one
    return out


@jit  # type: ignore[untyped-decorator,misc]
def _low(x: Any, n: Any) -> Any:
    """The low n bits of x, n at most 64."""
    one = np.uint64(1)
    return x & (((one << (n & np.uint64(63))) - one) | (np.uint64(0) - (n >> np.uint64(6))))


def _fast_pdep() -> bool:
    """BMI2's pdep is one instruction on Intel and on AMD from Zen 3; Zen 1 and 2
    run it as microcode, about 250 cycles here, slower than selecting."""
    cpu = llvm.get_host_cpu_name()
    return "+bmi2" in llvm.get_host_cpu_features().flatten() and cpu not in {"znver1", "znver2"}


# The low bits of x onto the set bits of mask, lowest first (numba's disk cache is
# keyed on the CPU's name and features, so each CPU gets its own choice compiled).
deposit = _pdep if _fast_pdep() else _select_deposit


@jit  # type: ignore[untyped-decorator,misc]
def bucket_of(value: Any, bounds: Any, magnitude: Any) -> int:
    m = np.uint64(value) & magnitude
    k = 0
    while k < bounds.size and m >= bounds[k]:
        k += 1
    return k


@jit  # type: ignore[untyped-decorator,misc]
def sample_classes(
    base: Any,
    new: Any,
    shift: int,
    top: int,
    runs: int,
    run_len: int,
    every: int,
    member_len: int,
    sample: Any,
    hit: Any,
) -> int:
    """Exponent-class histograms from a fixed sample (deterministic): ``runs``
    evenly spaced runs of ``run_len`` elements. ``hit``: the base contents of the
    changed elements in them (compared 64 at a time, so that only the changes cost
    more than reading); ``sample``: all elements of the first ``member_len`` of
    every ``every``-th run (the same memory, read once). Returns the elements the
    runs cover."""
    n = base.size
    s = np.uint64(shift)
    t = np.uint64(top)
    one = np.uint64(1)
    step = n // runs
    # Four histograms taken in turn: most elements share a few classes, and one
    # histogram would make each count wait for the one before.
    four = np.zeros((4, top + 1), np.int64)
    covered = 0
    for r in range(runs):
        lo = r * step
        hi = min(n, lo + run_len)
        if r % every == 0:
            end = min(hi, lo + member_len)
            i = lo
            while i + 4 <= end:
                four[0, (np.uint64(base[i]) >> s) & t] += 1
                four[1, (np.uint64(base[i + 1]) >> s) & t] += 1
                four[2, (np.uint64(base[i + 2]) >> s) & t] += 1
                four[3, (np.uint64(base[i + 3]) >> s) & t] += 1
                i += 4
            for p in range(i, end):
                four[0, (np.uint64(base[p]) >> s) & t] += 1
        i = lo
        while i + LANES <= hi:
            mask = neq_mask(base, new, i)
            while mask:
                p = i + trailing_zeros(mask)
                hit[(np.uint64(base[p]) >> s) & t] += 1
                mask &= mask - one
            i += LANES
        for p in range(i, hi):
            if base[p] != new[p]:
                hit[(np.uint64(base[p]) >> s) & t] += 1
        covered += hi - lo
    for c in range(top + 1):
        sample[c] += four[0, c] + four[1, c] + four[2, c] + four[3, c]
    return covered


@jit  # type: ignore[untyped-decorator,misc]
def _entropy_bits(n: float, k: float) -> float:
    """n * H(k / n) bits: about log2 C(n, k), the cost of k changes among n."""
    if k <= 0.0 or k >= n:
        return 0.0
    p = k / n
    return -(k * math.log2(p) + (n - k) * math.log2(1.0 - p))


@jit  # type: ignore[untyped-decorator,misc]
def choose_groups(
    members: Any, hits: Any, max_groups: int, penalty: float, walk: float, cuts: Any
) -> int:
    """Split the classes (in order) into at most ``max_groups`` contiguous groups
    that minimise the positions' information bits plus ``penalty`` per group and
    ``walk`` once for more than one group. Writes the first class of groups 1..
    into ``cuts``; returns the group count."""
    c = members.size
    cm = np.zeros(c + 1)
    ch = np.zeros(c + 1)
    for i in range(c):
        cm[i + 1] = cm[i] + members[i]
        ch[i + 1] = ch[i] + hits[i]
    # Bits of every run of classes i .. j - 1 as one group, computed once.
    span = np.zeros((c + 1, c + 1))
    for i in range(c):
        for j in range(i + 1, c + 1):
            k = ch[j] - ch[i]
            span[i, j] = _entropy_bits(max(cm[j] - cm[i], k), k)
    inf = 1e300
    cost = np.full((max_groups + 1, c + 1), inf)
    back = np.zeros((max_groups + 1, c + 1), np.int64)
    cost[0, 0] = 0.0
    for g in range(1, max_groups + 1):
        for j in range(1, c + 1):
            for i in range(g - 1, j):
                if cost[g - 1, i] >= inf:
                    continue
                value = cost[g - 1, i] + span[i, j] + penalty
                if value < cost[g, j]:
                    cost[g, j] = value
                    back[g, j] = i
    best = 1
    for g in range(2, max_groups + 1):
        if cost[g, c] + walk < cost[best, c] + (walk if best > 1 else 0.0):
            best = g
    j = c
    for g in range(best, 1, -1):
        j = back[g, j]
        cuts[g - 2] = j
    return best


@jit  # type: ignore[untyped-decorator,misc]
def choose_bounds(
    base: Any,
    new: Any,
    shift: int,
    top: int,
    runs: int,
    run_len: int,
    every: int,
    member_len: int,
    max_groups: int,
    penalty: float,
    walk: float,
    out: Any,
) -> int:
    """chunked.choose_bounds in one call: the sampled histograms, then the groups
    of classes; their first classes' bounds (class << shift) into ``out``. Returns
    the count of bounds."""
    n = base.size
    sample = np.zeros(top + 1)
    hit = np.zeros(top + 1)
    covered = sample_classes(base, new, shift, top, runs, run_len, every, member_len, sample, hit)
    scale = n / covered
    present = 0
    hits = 0.0
    sampled = 0.0
    for c in range(top + 1):
        present += sample[c] > 0 or hit[c] > 0
        hits += hit[c] * scale
        sampled += sample[c]
    if present < 2 or hits < 64.0:
        return 0
    classes = np.empty(present, np.int64)
    members = np.empty(present)
    hit_of = np.empty(present)
    j = 0
    for c in range(top + 1):
        if sample[c] > 0 or hit[c] > 0:
            classes[j] = c
            members[j] = sample[c] * (n / max(sampled, 1.0))
            hit_of[j] = hit[c] * scale
            j += 1
    cuts = np.zeros(max_groups, np.int64)
    groups = choose_groups(members, hit_of, max_groups, penalty, walk, cuts)
    for g in range(groups - 1):
        out[g] = classes[cuts[g]] << shift
    return int(groups - 1)


@jit  # type: ignore[untyped-decorator,misc]
def _guess_param(count: int, total: int) -> int:
    if count == 0:
        return 0
    mean = total / count
    return max(0, min(MAX_PARAM, int(np.log2(mean * 0.69 + 1.0))))


@jit  # type: ignore[untyped-decorator,misc]
def _four_masks(base: Any, i: int, bounds: Any, magnitude: Any, groups: int) -> Any:
    """The lanes of base[i : i + 64] in each of the four magnitude buckets (``bounds``
    padded with a value above every magnitude, so unused buckets are empty). Only
    ``groups - 1`` thresholds are compared: the others would give all lanes (a
    branch per block that is always taken the same way)."""
    zero = np.uint64(0)
    l0 = below_mask(base, i, bounds[0], magnitude)
    if groups == 2:
        return l0, ~l0, zero, zero
    l1 = below_mask(base, i, bounds[1], magnitude)
    if groups == 3:
        return l0, l1 & ~l0, ~l1, zero
    l2 = below_mask(base, i, bounds[2], magnitude)
    return l0, l1 & ~l0, l2 & ~l1, ~l2


@jit  # type: ignore[untyped-decorator,misc]
def _tail_masks(base: Any, i: int, hi: int, bounds: Any, magnitude: Any) -> Any:
    """_four_masks for the last, partial block base[i:hi], one element at a time."""
    m0 = m1 = m2 = m3 = np.uint64(0)
    one = np.uint64(1)
    for p in range(i, hi):
        bit = one << np.uint64(p - i)
        k = bucket_of(base[p], bounds, magnitude)
        if k == 0:
            m0 |= bit
        elif k == 1:
            m1 |= bit
        elif k == 2:
            m2 |= bit
        else:
            m3 |= bit
    return m0, m1, m2, m3


@jit  # type: ignore[untyped-decorator,misc]
def _rank_code(line: Any, lane: Any) -> Any:
    """rank * 4 + bucket of lane ``lane`` of a block whose bucket masks are
    ``line[0:4]`` and whose buckets' counts before it are ``line[4:8]``. Exactly one
    bucket holds the lane: its index without branches."""
    one = np.uint64(1)
    k = (
        np.int64((line[1] >> lane) & one)
        + 2 * np.int64((line[2] >> lane) & one)
        + 3 * np.int64((line[3] >> lane) & one)
    )
    rank = line[4 + k] + popcount(line[k] & ((one << lane) - one))
    return np.int64(rank) * 4 + k


@jit  # type: ignore[untyped-decorator,misc]
def scan_ranked(
    base: Any,
    new: Any,
    chunk: int,
    bounds: Any,
    groups: int,
    magnitude: Any,
    out_pos: Any,
    out_diff: Any,
    out_old: Any,
    out_rank: Any,
    running: Any,
    start: int,
) -> Any:
    """fused_jit.scan_diffs that also ranks each change among the elements of its
    magnitude bucket in its chunk (``out_rank``: rank * 4 + bucket), from the base
    it has in registers: level 3's only pass over base and new. ``running``: each
    bucket's count so far in the chunk of ``start``, kept for a resumed scan.
    Returns (elements written, where to resume)."""
    n = base.size
    main = n - n % LANES
    cap = out_pos.size
    one = np.uint64(1)
    zero = np.uint64(0)
    last = np.uint64(LANES - 1)
    line = np.empty(8, np.uint64)
    for g in range(4):
        line[4 + g] = running[g]
    line[0], line[1], line[2], line[3] = ~zero, zero, zero, zero
    # Unsigned indices: numba checks signed ones for wrapping around, at every access.
    ku = np.uint64(0)
    iu = np.uint64(start)
    capu = np.uint64(cap)
    mainu = np.uint64(main)
    lanes = np.uint64(LANES)
    withinu = np.uint64(chunk - 1)
    while iu < mainu and ku + lanes <= capu:
        if (iu & withinu) == zero:
            line[4] = line[5] = line[6] = line[7] = zero
        if groups > 1:
            m0, m1, m2, m3 = _four_masks(base, iu, bounds, magnitude, groups)
            line[0], line[1], line[2], line[3] = m0, m1, m2, m3
        mask = neq_mask(base, new, iu)
        for _ in range(2):
            lane = min(trailing_zeros(mask), last)
            p = iu + lane
            out_pos[ku] = p
            out_diff[ku] = new[p] - base[p]
            out_old[ku] = base[p]
            out_rank[ku] = _rank_code(line, lane)
            ku += np.uint64(mask != zero)
            mask &= mask - one
        while mask:
            lane = trailing_zeros(mask)
            p = iu + lane
            out_pos[ku] = p
            out_diff[ku] = new[p] - base[p]
            out_old[ku] = base[p]
            out_rank[ku] = _rank_code(line, lane)
            ku += one
            mask &= mask - one
        for g in range(4):
            line[4 + g] += popcount(line[g])
        iu += lanes
    k = np.int64(ku)
    i = np.int64(iu)
    if i == main and k + LANES <= cap:
        # The last, partial block, one element at a time.
        if main < n and (iu & withinu) == zero:
            line[4] = line[5] = line[6] = line[7] = zero
        for p in range(main, n):
            g = bucket_of(base[p], bounds, magnitude)
            if base[p] != new[p]:
                out_pos[k] = p
                out_diff[k] = new[p] - base[p]
                out_old[k] = base[p]
                out_rank[k] = np.int64(line[4 + g]) * 4 + g
                k += 1
            line[4 + g] += one
        i = np.int64(n)
    for g in range(4):
        running[g] = line[4 + g]
    return k, i


@jit  # type: ignore[untyped-decorator,misc]
def encode_chunks(
    base: Any,
    where: Any,
    diff: Any,
    ranks: Any,
    chunk: int,
    groups: int,
    table: Any,
    out: Any,
    mags: Any,
    by_bucket: Any,
    big_gaps: Any,
    signs: Any,
) -> Any:
    """Every chunk's bit stream into ``out`` and its numbers into ``table`` (one row
    per chunk: bytes, then count and Rice parameter of each of ``groups`` buckets and
    of the large magnitudes); large magnitudes - 2 into ``mags``. ``ranks``: scan_ranked's rank
    codes of the changes (read only with more than one bucket). Returns (bytes,
    count of large magnitudes)."""
    n = base.size
    width = base.itemsize
    top = np.uint64((1 << (8 * width)) - 1) if width < 8 else ~np.uint64(0)
    half = (top >> np.uint64(1)) + np.uint64(1)
    zero = np.uint64(0)
    one = np.uint64(1)
    two = np.uint64(2)
    three = np.uint64(3)
    nchunks = table.shape[0]
    last = np.zeros(4, np.int64)
    counts = np.zeros(5, np.int64)
    totals = np.zeros(5, np.int64)
    params = np.zeros(5, np.int64)
    firsts = np.zeros(4, np.int64)
    ptr = 0
    index = 0
    nbig = 0
    for c in range(nchunks):
        lo = c * chunk
        hi = min(n, lo + chunk)
        a = ptr
        while ptr < where.size and where[ptr] < hi:
            ptr += 1
        b = ptr
        # Gaps between ranks within each bucket (chunk-local), bucket k's into
        # by_bucket[k * stride:], with each bucket's count and sum of gaps.
        last[:] = -1
        counts[:] = 0
        totals[:] = 0
        stride = b - a
        if groups == 1:
            for j in range(a, b):
                by_bucket[j - a] = where[j] - lo - last[0] - 1
                last[0] = where[j] - lo
            counts[0] = b - a
            totals[0] = last[0] + 1 - (b - a)
        else:
            # Unsigned indices: numba checks signed ones for wrapping around.
            ju = np.uint64(a)
            us = np.uint64(stride)
            while ju < np.uint64(b):
                code = np.uint64(ranks[ju])
                bucket = code & three
                rank = np.int64(code >> two)
                by_bucket[bucket * us + np.uint64(counts[bucket])] = rank - last[bucket] - 1
                last[bucket] = rank
                counts[bucket] += 1
                ju += one
            for k in range(groups):
                # Each bucket's gaps sum to its last rank + 1 - its count.
                totals[k] = last[k] + 1 - counts[k]
        for k in range(groups):
            firsts[k] = max(0, _guess_param(counts[k], totals[k]) - 1)
        # Each bucket's Rice parameter: the cheapest of three candidates, their unary
        # bits summed over the bucket's own range of ``by_bucket``.
        for k in range(groups):
            f = firsts[k]
            f1 = min(f + 1, MAX_PARAM)
            f2 = min(f + 2, MAX_PARAM)
            c0 = c1 = c2 = 0
            for t in range(np.uint64(k * stride), np.uint64(k * stride + counts[k])):
                g = by_bucket[t]
                c0 += g >> f
                c1 += g >> f1
                c2 += g >> f2
            best = f
            best_cost = c0 + counts[k] * (1 + f)
            if c1 + counts[k] * (1 + f1) < best_cost:
                best = f1
                best_cost = c1 + counts[k] * (1 + f1)
            if c2 + counts[k] * (1 + f2) < best_cost:
                best = f2
            params[k] = best if counts[k] else 0
        # Large magnitudes (their gaps in change order into big_gaps, magnitudes - 2
        # into mags) and signs (packed, 64 a word), in one pass.
        big_first = nbig
        prev = -1
        big_total = 0
        j = a
        # 64 changes at a time: signs from one vector compare (d >= half), large
        # magnitudes (d not 1 or -1: d + 1 >= 3) from another, then only those.
        while j + LANES <= b:
            signs[(j - a) >> 6] = bit_reverse(shifted_at_least(diff, j, zero, half))
            large_lanes = shifted_at_least(diff, j, one, three)
            while large_lanes:
                at = j + int(trailing_zeros(large_lanes))
                d = np.uint64(diff[at])
                m = (top + one - d) & top if d >= half else d
                g = (at - a) - prev - 1
                mags[nbig] = m - two
                big_gaps[nbig - big_first] = g
                nbig += 1
                big_total += g
                prev = at - a
                large_lanes &= large_lanes - one
            j += LANES
        # The last, partial word: branch-free, each slot written and kept only when
        # the magnitude is large.
        word = np.uint64(0)
        for at in range(j, b):
            d = np.uint64(diff[at])
            negative = d >= half
            word = (word << one) | np.uint64(negative)
            m = (top + one - d) & top if negative else d
            large = int(m > one)
            g = (at - a) - prev - 1
            mags[nbig] = m - two
            big_gaps[nbig - big_first] = g
            nbig += large
            big_total += large * g
            prev += large * (g + 1)
        totals[4] += big_total
        if (b - a) & 63:
            signs[(b - a) >> 6] = word
        bc = nbig - big_first
        counts[4] = bc
        bp = _guess_param(bc, totals[4])
        totals[4] = 0
        bpu = np.uint64(bp)
        start = index
        acc = np.uint64(0)
        held = 0
        # Unary codes, bucket by bucket, then those of the large magnitudes.
        for k in range(groups):
            p = np.uint64(params[k])
            for t in range(np.uint64(k * stride), np.uint64(k * stride + counts[k])):
                q = np.uint64(by_bucket[t]) >> p
                while q >= np.uint64(32):
                    acc, held, index = put_bits(out, acc, held, index, np.uint64(0), np.int64(32))
                    q -= np.uint64(32)
                acc, held, index = put_bits(out, acc, held, index, one, np.int64(q) + 1)
        for t in range(bc):
            q = np.uint64(big_gaps[t]) >> bpu
            while q >= np.uint64(32):
                acc, held, index = put_bits(out, acc, held, index, np.uint64(0), np.int64(32))
                q -= np.uint64(32)
            acc, held, index = put_bits(out, acc, held, index, one, np.int64(q) + 1)
        # Their fixed-width low bits, in the same order.
        for k in range(groups):
            p = params[k]
            if p:
                low = (one << np.uint64(p)) - one
                for t in range(np.uint64(k * stride), np.uint64(k * stride + counts[k])):
                    acc, held, index = put_bits(
                        out, acc, held, index, np.uint64(by_bucket[t]) & low, p
                    )
        if bp:
            low = (one << bpu) - one
            for t in range(bc):
                acc, held, index = put_bits(out, acc, held, index, np.uint64(big_gaps[t]) & low, bp)
        # Signs, 32 at a time (put_bits takes at most 40).
        for w in range((b - a + 63) >> 6):
            filled = min(64, b - a - 64 * w)
            word = signs[w]
            if filled > 32:
                acc, held, index = put_bits(
                    out, acc, held, index, word >> np.uint64(32), filled - 32
                )
                word &= np.uint64(0xFFFFFFFF)
                filled = 32
            acc, held, index = put_bits(out, acc, held, index, word, filled)
        put_tail(out, index, acc, held)
        index += (held + 7) >> 3
        row = table[c]
        row[0] = index - start
        for k in range(groups):
            row[1 + 2 * k] = counts[k]
            row[2 + 2 * k] = params[k]
        row[1 + 2 * groups] = bc
        row[2 + 2 * groups] = bp
    return index, nbig


@jit  # type: ignore[untyped-decorator,misc]
def _bits_at(words: Any, at: int) -> Any:
    """The 64 bits of a bitmap from bit ``at`` on (bit r at words[r >> 6], bit r & 63)."""
    w = np.uint64(at) >> np.uint64(6)  # unsigned: no wraparound check on the index
    shift = np.uint64(at) & np.uint64(63)
    # (x << 1) << (63 - shift): no shift by 64 when ``at`` is word-aligned.
    high = (words[w + np.uint64(1)] << np.uint64(1)) << (np.uint64(63) - shift)
    return (words[w] >> shift) | high


@jit  # type: ignore[untyped-decorator,misc]
def _contents(
    base: Any,
    bits: Any,
    sign0: int,
    o_first: int,
    o_lo: int,
    o_hi: int,
    out_pos: Any,
    out_new: Any,
    out_old: Any,
    planes: Any,
    gaps: Any,
    state: Any,
    bstop: int,
    changed: int,
    top: Any,
    write: bool,
    ahead: int,
) -> int:
    """Contents of changes ``o_lo .. o_hi - 1`` (positions in ``out_pos``), written
    into ``base`` with ``write`` right after their old contents are kept. ``state``:
    the index of the next large-magnitude code, the change it falls on, the next
    large magnitude (in ``planes``: the large magnitudes - 2 as byte planes, low
    byte first). Returns ``o_hi``, or ``o_lo`` with nothing of the range written if
    its large magnitudes are damaged.

    Two passes: every change as a step of one unit, its sign taken without a branch
    (signs are random: a branch on them is mispredicted half the time); then the
    large magnitudes (about one change in ten) over the steps just written."""
    one = np.uint64(1)
    zero = np.uint64(0)
    # Unsigned indices: numba checks a signed one for wrapping on every access.
    for o in range(np.uint64(o_lo), np.uint64(o_hi)):
        if ahead and o + np.uint64(ahead) < np.uint64(o_first + changed):
            prefetch_write(base, out_pos[o + np.uint64(ahead)])
        s = np.uint64(sign0 - o_first) + o  # modulo 2**64: right even if sign0 < o_first
        negative = np.uint64((bits[s >> np.uint64(3)] >> (np.uint64(7) - (s & np.uint64(7)))) & one)
        pos = np.uint64(out_pos[o])
        old = base[pos]
        new = (np.uint64(old) + ((one ^ (zero - negative)) + negative)) & top
        out_old[o] = old
        out_new[o] = new
        if write:
            base[pos] = new
    width = base.itemsize
    nbig = planes.size // width
    bi = state[0]
    next_big = state[1]
    mi = state[2]
    j_hi = o_hi - o_first
    while next_big < j_hi:
        o = o_first + next_big
        m = zero
        for b in range(width):  # byte b of every magnitude is at planes[b * nbig:]
            m |= np.uint64(planes[b * nbig + mi]) << np.uint64(8 * b)
        m = (m + np.uint64(2)) & top
        bad = m <= one
        mi += 1
        bi += 1
        if bi < bstop:
            next_big += gaps[bi] + 1
            bad = bad or next_big >= changed
        else:
            next_big = changed
        if bad:
            if write:
                for q in range(o_lo, o_hi):
                    base[out_pos[q]] = out_old[q]
            return o_lo
        s = sign0 + (o - o_first)
        negative = np.uint64((bits[s >> 3] >> (7 - (s & 7))) & 1)
        new = (np.uint64(out_old[o]) + ((m ^ (zero - negative)) + negative)) & top
        out_new[o] = new
        if write:
            base[out_pos[o]] = new
    state[0] = bi
    state[1] = next_big
    state[2] = mi
    return o_hi


@jit  # type: ignore[untyped-decorator,misc]
def _walk_buckets(
    base: Any,
    lo: int,
    hi: int,
    bounds: Any,
    groups: int,
    magnitude: Any,
    gaps: Any,
    gend: Any,
    ranks: Any,
    out_pos: Any,
    o_first: int,
    bits: Any,
    sign0: int,
    out_new: Any,
    out_old: Any,
    planes: Any,
    state: Any,
    top: Any,
    write: bool,
) -> int:
    """Positions of a chunk's changes, given as ranks within their buckets (the set
    bits of ``ranks[k]`` for bucket k, which decode_chunks sets), into ``out_pos`` from
    ``o_first`` on, the contents (_contents) of every ``WALK_BATCH`` changes right
    after their positions, while their lines are in cache. Returns DONE or
    BAD_POSITION / BAD_CONTENTS, with ``state[3]`` the end of the changes whose
    contents it wrote.

    Without a branch per change: each block of 64 elements
    takes, per bucket, as many bits of that bitmap as the block has elements of
    the bucket and deposits them onto those elements' lanes (``deposit``)."""
    size = hi - lo
    changed = gend[groups - 1]
    one = np.uint64(1)
    s0 = s1 = s2 = s3 = np.int64(0)
    r0, r1, r2, r3 = ranks[0], ranks[1], ranks[2], ranks[3]
    o = np.int64(o_first)
    o_end = o_first + changed
    state[3] = o_first
    o_pending = o
    last_lane = np.uint64(LANES - 1)
    i = lo
    while i < hi and o < o_end:
        if i + LANES <= hi:
            m0, m1, m2, m3 = _four_masks(base, i, bounds, magnitude, groups)
        else:
            m0, m1, m2, m3 = _tail_masks(base, i, hi, bounds, magnitude)
        n0, n1 = popcount(m0), popcount(m1)
        x0, x1 = _low(_bits_at(r0, s0), n0), _low(_bits_at(r1, s1), n1)
        s0 += np.int64(n0)
        s1 += np.int64(n1)
        x2 = x3 = np.uint64(0)
        if groups > 2:
            n2, n3 = popcount(m2), popcount(m3)
            x2, x3 = _low(_bits_at(r2, s2), n2), _low(_bits_at(r3, s3), n3)
            s2 += np.int64(n2)
            s3 += np.int64(n3)
        # No branch on whether the block holds a change: about a third do not, at
        # random, and the deposits cost less than the mispredictions.
        chosen = deposit(x0, m0) | deposit(x1, m1)
        if groups > 2:
            chosen |= deposit(x2, m2) | deposit(x3, m3)
        # A block holds 0, 1 or 2 changes about equally often: the first three go
        # out without a branch on the count (a slot past the last change is
        # overwritten by the next one, and stays within the chunk's outputs).
        if o + 3 <= o_end:
            for _ in range(3):
                out_pos[np.uint64(o)] = i + np.int64(min(trailing_zeros(chosen), last_lane))
                o += np.int64(chosen != 0)
                chosen &= chosen - one
        while chosen:
            if o >= o_end:  # only a damaged record sets more bits than it has changes
                _clear(ranks, groups, size)
                return BAD_POSITION
            out_pos[np.uint64(o)] = i + np.int64(trailing_zeros(chosen))
            o += 1
            chosen &= chosen - one
        i += LANES
        # Contents every WALK_BATCH changes, and those of the last ones as the walk ends.
        if o - o_pending >= WALK_BATCH or (o > o_pending and (i >= hi or o >= o_end)):
            done = _contents(
                base,
                bits,
                sign0,
                o_first,
                o_pending,
                o,
                out_pos,
                out_new,
                out_old,
                planes,
                gaps,
                state,
                gend[groups],
                changed,
                top,
                write,
                0,
            )
            state[3] = done
            if done < o:
                _clear(ranks, groups, size)
                return BAD_CONTENTS
            o_pending = o
    if o != o_end:
        _clear(ranks, groups, size)
        return BAD_POSITION
    # Every change taken: each bucket's set bits lie below the ranks walked, so only
    # those words (and the one _bits_at read past them) need zeroing, not the chunk's
    # length in every bucket (a seventh of the decode of a 0.7M-element tensor in cache).
    for k, walked in enumerate((s0, s1, s2, s3)):
        if k < groups:
            ranks[k, : (walked >> 6) + 2] = 0
    return DONE


@jit  # type: ignore[untyped-decorator,misc]
def _clear(ranks: Any, groups: int, size: int) -> None:
    """Zero what a chunk of ``size`` elements may have set or read of the bitmaps."""
    words = min(ranks.shape[1], (size >> 6) + 2)
    for k in range(groups):
        ranks[k, :words] = 0


@jit  # type: ignore[untyped-decorator,misc]
def decode_chunks(
    bits: Any,
    table: Any,
    starts: Any,
    first: int,
    stop: int,
    base: Any,
    chunk: int,
    bounds: Any,
    groups: int,
    magnitude: Any,
    planes: Any,
    big_at: Any,
    out_at: Any,
    out_pos: Any,
    out_new: Any,
    out_old: Any,
    gaps: Any,
    ranks: Any,
    write: bool,
) -> Any:
    """Decode chunks ``first`` .. ``stop - 1``: positions, new and old contents of
    each chunk's changes at its ``out_at`` offset. With ``write`` each chunk's new
    contents are written into ``base`` once the chunk decoded whole. Returns
    (chunks done, DONE | BAD_*); a damaged chunk writes nothing."""
    n = base.size
    width = base.itemsize
    top = np.uint64((1 << (8 * width)) - 1) if width < 8 else ~np.uint64(0)
    one = np.uint64(1)
    gend = np.zeros(5, np.int64)
    state = np.zeros(4, np.int64)
    for c in range(first, stop):
        lo = c * chunk
        hi = min(n, lo + chunk)
        bit0 = starts[c] * 8
        end = bit0 + table[c, 0] * 8
        total = 0
        changed = 0
        for k in range(groups + 1):
            total += table[c, 1 + 2 * k]
            if k < groups:
                changed += table[c, 1 + 2 * k]
            gend[k] = total
        # Unary codes of every group, word by word: the ends of codes are the set bits
        # of the bit-reversed window (trailing zeros, no load per code). A quotient
        # past what the chunk can hold, or too few ends before the chunk's last bit,
        # is damage.
        prev = bit0 - 1  # the end of the previous code
        t = 0
        for k in range(groups + 1):
            limit = (chunk if k < groups else changed) >> table[c, 2 + 2 * k]
            stop_t = gend[k]
            u = prev + 1
            while t < stop_t:
                if u >= end:
                    return c - first, BAD_UNARY
                # peek guarantees 57 stream bits: take 56, none at or past ``end``.
                w = bit_reverse(peek(bits, u)) & WINDOW
                if end - u < 56:
                    w &= (one << np.uint64(end - u)) - one
                while w and t < stop_t:
                    e = u + np.int64(trailing_zeros(w))
                    q = e - prev - 1
                    if q > limit:
                        return c - first, BAD_UNARY
                    gaps[np.uint64(t)] = q
                    prev = e
                    t += 1
                    w &= w - one
                if t < stop_t:
                    u += 56
                    if u - prev - 1 > limit:
                        return c - first, BAD_UNARY
        u = prev + 1
        # Fixed-width low bits, group by group, after the whole layout is checked.
        # With buckets, each gap becomes a rank and its bit in the bucket's bitmap in
        # the same pass (the walk reads the bitmaps; only the large-magnitude indices
        # are kept as gaps).
        f = u
        sign0 = f
        for k in range(groups + 1):
            sign0 += table[c, 2 + 2 * k] * table[c, 1 + 2 * k]
        if sign0 + changed > end or end - (sign0 + changed) >= 8:
            return c - first, BAD_FIXED
        pad = end - (sign0 + changed)
        if pad and (np.uint64(bits[(end >> 3) - 1]) & ((one << np.uint64(pad)) - one)):
            return c - first, BAD_FIXED
        t = 0
        for k in range(groups + 1):
            p = table[c, 2 + 2 * k]
            stop_t = gend[k]
            shift = np.uint64(64 - p)
            if groups > 1 and k < groups:
                row = ranks[k]
                rank = -1
                while t < stop_t:
                    g = gaps[np.uint64(t)]
                    if p:
                        g = (g << p) | np.int64(peek(bits, f) >> shift)
                        f += p
                    rank += g + 1
                    if rank >= hi - lo:
                        _clear(ranks, groups, hi - lo)
                        return c - first, BAD_POSITION
                    row[np.uint64(rank) >> np.uint64(6)] |= one << np.uint64(rank & 63)
                    t += 1
            elif p:
                while t < stop_t:
                    gaps[t] = (gaps[t] << p) | np.int64(peek(bits, f) >> shift)
                    f += p
                    t += 1
            t = stop_t
        o_first = out_at[c]
        o_end = o_first + changed
        bt = gend[groups - 1]
        bstop = gend[groups]
        state[0] = bt
        state[1] = gaps[bt] if bt < bstop else changed
        state[2] = big_at[c]
        status = DONE
        if groups == 1:
            o = o_first
            pos = lo - 1
            for t in range(gend[0]):
                pos += gaps[t] + 1
                if pos >= hi:
                    return c - first, BAD_POSITION
                out_pos[o] = pos
                o += 1
            # In batches, so that the large magnitudes' lines are still in cache.
            done = o_first
            while done < o_end:
                o_hi = min(done + CONTENTS_BATCH, o_end)
                reached = _contents(
                    base,
                    bits,
                    sign0,
                    o_first,
                    done,
                    o_hi,
                    out_pos,
                    out_new,
                    out_old,
                    planes,
                    gaps,
                    state,
                    bstop,
                    changed,
                    top,
                    write,
                    16,
                )
                if reached < o_hi:
                    done = reached
                    break
                done = o_hi
        else:
            status = _walk_buckets(
                base,
                lo,
                hi,
                bounds,
                groups,
                magnitude,
                gaps,
                gend,
                ranks,
                out_pos,
                o_first,
                bits,
                sign0,
                out_new,
                out_old,
                planes,
                state,
                top,
                write,
            )
            done = state[3]
        if status == DONE and (done < o_end or state[0] != bstop):
            status = BAD_CONTENTS
        if status != DONE:
            # Damaged: put back what this chunk wrote (its old contents were kept first).
            if write:
                for j in range(o_first, done):
                    base[out_pos[j]] = out_old[j]
            return c - first, status
    return stop - first, DONE


@jit  # type: ignore[untyped-decorator,misc]
def write_varints(values: Any, out: Any) -> int:
    """Non-negative integers as LEB128 into ``out`` (7 bits a byte, low first, high
    bit: more); returns the bytes written."""
    at = 0
    for i in range(values.size):
        v = np.uint64(values[i])
        while v >= np.uint64(128):
            out[at] = np.uint8((v & np.uint64(127)) | np.uint64(128))
            v >>= np.uint64(7)
            at += 1
        out[at] = np.uint8(v)
        at += 1
    return at


# Outcomes of read_table (chunked.py names them).
TABLE_OK = 0
TABLE_NUMBERS = 1
TABLE_PARAM = 2
TABLE_COUNTS = 3
TABLE_TOTALS = 4
TABLE_BYTES = 5
TABLE_SHORT = 6


@jit  # type: ignore[untyped-decorator,misc]
def read_table(
    data: Any,
    groups: int,
    chunk: int,
    numel: int,
    changed: int,
    big: int,
    nbits: int,
    table: Any,
    starts: Any,
    changes: Any,
    out_at: Any,
    big_at: Any,
) -> tuple[int, int]:
    """Parse a chunk table of ``table.shape[0] * (2 * groups + 3)`` canonical LEB128
    varints (below 2**49) filling ``data`` into ``table``, check its numbers against
    the record's, and set each chunk's byte offset in ``bits``, count of changes,
    and index of its first change and first large magnitude. Returns (TABLE_OK or
    the first inconsistency found, the most Rice codes a chunk holds)."""
    nchunks, columns = table.shape
    most = 0
    at = 0
    for c in range(nchunks):
        for j in range(columns):
            value = np.int64(0)
            length = 0
            while True:
                if at >= data.size or length == 7:
                    return TABLE_NUMBERS, most
                byte = np.int64(data[at])
                at += 1
                value |= (byte & 127) << (7 * length)
                length += 1
                if byte < 128:
                    if byte == 0 and length > 1:  # not canonical
                        return TABLE_NUMBERS, most
                    break
            table[c, j] = value
    if at != data.size:
        return TABLE_NUMBERS, most
    offset = 0
    seen = 0
    seen_big = 0
    for c in range(nchunks):
        size = min(chunk, numel - c * chunk)
        count = 0
        codes = 0
        cost = 0
        for k in range(groups + 1):
            n = table[c, 1 + 2 * k]
            p = table[c, 2 + 2 * k]
            if p > MAX_PARAM:
                return TABLE_PARAM, most
            if k < groups:
                count += n
            codes += n
            cost += n * p
        most = max(most, codes)
        nbig = table[c, 1 + 2 * groups]
        if count > size or nbig > count:
            return TABLE_COUNTS, most
        if 8 * table[c, 0] < codes + cost + count:
            return TABLE_SHORT, most
        if table[c, 0] > nbits - offset:  # also keeps the running sums from wrapping
            return TABLE_BYTES, most
        starts[c] = offset
        changes[c] = count
        out_at[c] = seen
        big_at[c] = seen_big
        offset += table[c, 0]
        seen += count
        seen_big += nbig
    if seen != changed or seen_big != big:
        return TABLE_TOTALS, most
    if offset != nbits:
        return TABLE_BYTES, most
    return TABLE_OK, most


@jit  # type: ignore[untyped-decorator,misc]
def restore(target: Any, out_pos: Any, out_old: Any, a: int, b: int) -> None:
    for j in range(a, b):
        target[out_pos[j]] = out_old[j]
