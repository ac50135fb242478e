"""The compiled code of fused.py, imported only where numba is installed.

Every function and intrinsic is defined at module level so that numba's disk
cache (``cache=True``) serves it to the next process instead of compiling again.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import types  # type: ignore[import-untyped]
from numba.extending import intrinsic  # type: ignore[import-untyped]

from pipeline import kernel_cache
from pipeline.codec.compiled.fused_constants import (
    APPLY,
    BAD_BIG,
    BAD_CONTENTS,
    BAD_POSITION,
    BAD_READBACK,
    BAD_UNARY,
    BATCH,
    CONFIRM,
    DECODE,
    DIFFS,
    DONE,
    FALLBACK,
    GATHER,
    LANES,
    MAX_PARAM,
    RECORD_FIELDS,
    SIGNMAG_OF,
    SIGNMAG_ONES,
    UNDO,
)
from pipeline.intrinsics_jit import pointer_like, prefetch_read_l2, prefetch_write

# numba's disk cache is keyed on this file alone and freezes the constants imported
# above at their values when compiled. This line names those values, and the import
# fails while it disagrees with fused_constants.py: changing a constant means editing this file
# too, which invalidates the cache (a checkout updated by git otherwise keeps kernels
# built with the old values).
CONSTANTS = (
    "LANES=64 BATCH=256 MAX_PARAM=40 DECODE=1 UNDO=2 DIFFS=3 GATHER=4 CONFIRM=5 DONE=0 "
    "BAD=1,2,3,4,5 FALLBACK=1 SIGNMAG=2/5 RECORD=streams,unary,fixed,sign,big_unary,"
    "big_fixed,count,param,zigzag,nbig,big_param,planes,planes_size,out,bigs,address,size"
)
_LIVE = (
    f"LANES={LANES} BATCH={BATCH} MAX_PARAM={MAX_PARAM} DECODE={DECODE} UNDO={UNDO} "
    f"DIFFS={DIFFS} GATHER={GATHER} CONFIRM={CONFIRM} DONE={DONE} "
    f"BAD={BAD_UNARY},{BAD_POSITION},{BAD_CONTENTS},{BAD_READBACK},{BAD_BIG} "
    f"FALLBACK={FALLBACK} SIGNMAG={SIGNMAG_ONES}/{SIGNMAG_OF} RECORD={','.join(RECORD_FIELDS)}"
)
if CONSTANTS != _LIVE:
    raise ImportError(f"fused_jit.py: CONSTANTS says {CONSTANTS!r}, fused_constants.py {_LIVE!r}")

jit = kernel_cache.jit  # numba.njit(cache=True, nogil=True), cached in the kernels folder

# walk_records' table columns (see RECORD_FIELDS).
(
    _STREAMS,
    _UNARY,
    _FIXED,
    _SIGN,
    _BIG_UNARY,
    _BIG_FIXED,
    _COUNT,
    _PARAM,
    _ZIGZAG,
    _NBIG,
    _BIG_PARAM,
    _PLANES,
    _PLANES_SIZE,
    _OUT,
    _BIGS,
    _ADDRESS,
    _SIZE,
) = range(len(RECORD_FIELDS))


@intrinsic  # type: ignore[untyped-decorator,misc]
def neq_mask(typingctx: Any, a: Any, b: Any, start: Any) -> Any:
    """Bit j set where a[start + j] != b[start + j], j < 64 (one vector compare)."""
    signature = types.uint64(a, b, start)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        vector = ir.VectorType(context.get_data_type(sig.args[0].dtype), LANES)
        loaded = []
        for array_type, value in zip(sig.args[:2], args[:2], strict=True):
            array = context.make_array(array_type)(context, builder, value=value)
            pointer = builder.bitcast(builder.gep(array.data, [args[2]]), vector.as_pointer())
            loaded.append(builder.load(pointer, align=1))
        differ = builder.icmp_unsigned("!=", loaded[0], loaded[1])
        return builder.bitcast(differ, ir.IntType(64))

    return signature, codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def trailing_zeros(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return types.uint64(types.uint64), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def bit_reverse(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitreverse(args[0])

    return types.uint64(types.uint64), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def load_be64(typingctx: Any, stream: Any, index: Any) -> Any:
    """Bytes index .. index + 7 of a uint8 array as a big-endian uint64 (unchecked)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array = context.make_array(sig.args[0])(context, builder, value=args[0])
        word = ir.IntType(64)
        pointer = builder.bitcast(builder.gep(array.data, [args[1]]), word.as_pointer())
        return builder.bswap(builder.load(pointer, align=1))

    return types.uint64(stream, index), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def store_be64(typingctx: Any, stream: Any, index: Any, value: Any) -> Any:
    """Store ``value`` big-endian at bytes index .. index + 7 of a uint8 array
    (unchecked)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        array = context.make_array(sig.args[0])(context, builder, value=args[0])
        word = ir.IntType(64)
        pointer = builder.bitcast(builder.gep(array.data, [args[1]]), word.as_pointer())
        builder.store(builder.bswap(args[2]), pointer, align=1)
        return context.get_dummy_value()

    return types.none(stream, index, types.uint64), codegen


@jit  # type: ignore[untyped-decorator,misc]
def put_bits(stream: Any, acc: Any, held: int, index: int, value: Any, width: int) -> Any:
    """Append the ``width`` (<= 40) low bits of ``value`` to a bit writer that holds
    ``held`` bits in ``acc`` and stores whole 8-byte words at ``index``."""
    if held + width < 64:
        return (acc << np.uint64(width)) | value, held + width, index
    spill = held + width - 64
    word = (acc << np.uint64(64 - held)) | (value >> np.uint64(spill))
    store_be64(stream, index, word)
    return value & ((np.uint64(1) << np.uint64(spill)) - np.uint64(1)), spill, index + 8


@jit  # type: ignore[untyped-decorator,misc]
def word_at(stream: Any, index: int) -> Any:
    """Bytes index .. index + 7 of ``stream`` as a big-endian uint64, zeros past its end."""
    if index + 8 <= stream.size:
        return load_be64(stream, index)
    word = np.uint64(0)
    for j in range(8):
        word <<= np.uint64(8)
        if index + j < stream.size:
            word |= np.uint64(stream[index + j])
    return word


@jit  # type: ignore[untyped-decorator,misc]
def peek(stream: Any, bit: int) -> Any:
    """The 64 bits of ``stream`` from ``bit`` on, MSB first, zeros past its end
    (at least 57 of them are stream bits when the stream is that long)."""
    return word_at(stream, bit >> 3) << np.uint64(bit & 7)


@jit  # type: ignore[untyped-decorator,misc]
def scan_diffs(base: Any, new: Any, out_pos: Any, out_diff: Any, out_old: Any, start: int) -> Any:
    """Changed elements from ``start`` on (a multiple of 64): positions, new - base
    (wrapping) and base there, until the outputs could overflow: (elements written,
    where to resume). The base contents are taken while they are in cache, so that
    a content hash of the change needs no second, scattered read of the base.

    Each 64-lane mask is compacted into two output slots without branches
    (a branch per lane or per mask mispredicts at a few percent changed);
    the mask with more than two bits set finishes in a loop. The main loop indexes
    with unsigned integers: no negative-index wrapping to compute, and the arrays'
    addresses stay in registers."""
    n = base.size
    main = np.uint64(n - n % LANES)
    cap = np.uint64(out_pos.size)
    lanes = np.uint64(LANES)
    k = np.uint64(0)
    i = np.uint64(start)
    one = np.uint64(1)
    last = np.uint64(LANES - 1)
    while i < main:
        if k + lanes > cap:
            return np.int64(k), np.int64(i)
        mask = neq_mask(base, new, i)
        for _ in range(2):
            p = i + min(trailing_zeros(mask), last)
            old = base[p]
            out_pos[k] = p
            out_diff[k] = new[p] - old
            out_old[k] = old
            k += np.uint64(mask != 0)
            mask &= mask - one
        while mask:
            p = i + trailing_zeros(mask)
            old = base[p]
            out_pos[k] = p
            out_diff[k] = new[p] - old
            out_old[k] = old
            k += one
            mask &= mask - one
        i += lanes
    written = np.int64(k)
    if written + LANES > out_pos.size:
        return written, np.int64(i)
    for q in range(np.int64(i), n):
        out_pos[written] = q
        out_diff[written] = new[q] - base[q]
        out_old[written] = base[q]
        written += base[q] != new[q]
    return written, n


@jit  # type: ignore[untyped-decorator,misc]
def signmag_diffs(diff: Any, top: int, signs: Any, big: Any, mags: Any) -> Any:
    """Sign bits (into ``signs``), indices of magnitudes above one and
    those magnitudes - 2, of differences modulo top + 1 (elements of at most 4
    bytes): (count of magnitude one, count above one)."""
    half = (top >> 1) + 1
    ones = 0
    nbig = 0
    byte = np.int64(0)
    for i in range(diff.size):
        d = np.int64(diff[i])
        negative = np.int64(d >= half)
        # Branch-free: signs are fair coins, a branch on them mispredicts half the time.
        magnitude = ((d ^ -negative) + negative) & top
        # Sign bits gather in a register, a byte is stored every eighth element.
        byte = (byte << 1) | negative
        if i & 7 == 7:
            signs[i >> 3] = byte
            byte = np.int64(0)
        big[nbig] = i
        mags[nbig] = magnitude - 2
        ones += magnitude == 1
        nbig += magnitude != 1
    if diff.size & 7:
        signs[diff.size >> 3] = byte << (8 - (diff.size & 7))
    return ones, nbig


@jit  # type: ignore[untyped-decorator,misc]
def unary_word(unary: Any, index: int) -> Any:
    """Bytes index .. index + 7 of the unary stream (zeros past its end) with bit k
    holding stream bit 8 * index + k, so ends of codes come out of trailing zeros."""
    return bit_reverse(word_at(unary, index))


@jit  # type: ignore[untyped-decorator,misc]
def unary_ends(unary: Any, out: Any, count: int, word: Any, word_bit: int, next_byte: int) -> Any:
    """The stream bits where the next ``count`` unary codes end, into ``out[:count]``,
    read on from a reader's state: ``word`` the bits not yet taken of the 8 bytes
    that start at bit ``word_bit`` (unary_word), ``next_byte`` where the next 8
    start. (word, word_bit, next_byte, codes found): fewer than ``count`` when the
    stream ends first."""
    one = np.uint64(1)
    k = 0
    while k < count:
        if word == 0:
            if next_byte >= unary.size:
                break
            word = unary_word(unary, next_byte)
            word_bit = 8 * next_byte
            next_byte += 8
            continue
        out[k] = word_bit + np.int64(trailing_zeros(word))
        word &= word - one
        k += 1
    return word, word_bit, next_byte, k


@jit  # type: ignore[untyped-decorator,misc]
def write_batch(
    target: Any,
    positions: Any,
    diffs: Any,
    size: int,
    first: int,
    mode: int,
    out_pos: Any,
    out_val: Any,
    out_old: Any,
    written: Any,
) -> int:
    """target[positions] += diffs for one batch of walk_sparse (see there): -1, or
    for CONFIRM the index in the batch of the first position that, read back, does
    not hold what was written (``written`` keeps the batch's new contents)."""
    record = out_pos.size > 0
    if mode == DIFFS:
        for b in range(size):
            out_pos[first + b] = positions[b]
            out_val[first + b] = diffs[b]  # modulo the element width
        return -1
    if mode == GATHER:
        for b in range(size):
            p = positions[b]
            old = target[p]
            out_pos[first + b] = p
            out_val[first + b] = old + diffs[b]
            out_old[first + b] = old
        return -1
    for b in range(size):
        p = positions[b]
        old = target[p]
        value = old + diffs[b]
        if mode != DECODE:
            target[p] = value
        if mode == CONFIRM:
            written[b] = value
        if record:
            out_pos[first + b] = p
            out_val[first + b] = value if mode == DECODE else old
    if mode == CONFIRM:
        # The batch's lines are still in L1/L2. ``written`` may alias ``target`` as far
        # as the compiler knows, so each of these is a load from the target's memory.
        for b in range(size):
            if target[positions[b]] != written[b]:
                return b
    return -1


@jit  # type: ignore[untyped-decorator,misc]
def walk_sparse(
    unary: Any,
    fixed: Any,
    param: int,
    count: int,
    signs: Any,
    big: Any,
    planes: Any,
    zigzag: bool,
    target: Any,
    mode: int,
    out_pos: Any,
    out_val: Any,
    out_old: Any,
) -> Any:
    """Walk ``count`` Rice-coded positions (unary + fixed streams, parameter
    ``param``) with their contents over ``target``, the base contents. Sign-magnitude
    contents: sign bits, ascending indices of magnitudes above one followed by a
    sentinel >= count, and those magnitudes - 2 as byte planes (``planes``, least
    significant plane first, as many planes as target's element width). With
    ``zigzag`` (byte-plane contents), ``planes`` holds every difference of the
    record zigzagged (``planes.size // width`` bytes a plane: an UNDO walks a prefix
    of them), ``signs`` is empty and ``big`` only the sentinel.

    APPLY writes target[p] += diff and, when ``out_pos`` is not empty, records
    positions and old contents; CONFIRM is APPLY with each batch read back right
    after its writes (BAD_READBACK, with the batch counted as done, if a position
    does not hold what was written); DECODE writes nothing and records positions
    and new contents; UNDO takes back the first ``count`` elements of an APPLY;
    DIFFS records positions and differences (new - old modulo the element
    width) and touches nothing of ``target`` but its size; GATHER writes nothing
    and records positions, new contents and the old ones (``out_old``: what a
    content hash of the change needs, the target read once).

    Works in batches, each in short loops: find where the batch's unary codes
    end (trailing zeros of bit-reversed words: one cheap dependency per element
    instead of a load-shift-count chain), then turn ends and fixed bits into
    positions and differences while prefetching the target lines, then fix up
    the large magnitudes; the batch is written (many cache misses in flight)
    after the next one is decoded.

    Returns (elements done, DONE | BAD_*). On damage an APPLY has written
    exactly the elements done; its caller UNDOes them."""
    numel = target.size
    width = target.itemsize
    nbig = big.size - 1
    stride = planes.size // width
    top = (1 << (8 * width)) - 1
    one = np.uint64(1)
    low = np.uint64(63 - param)
    flip = np.int64(1 if mode == UNDO else 0)
    word = np.uint64(0)
    word_bit = np.int64(0)  # stream bit of the word's bit 0 (int64s, not literals: one
    next_byte = np.int64(0)  # compiled unary_ends serves the walk and rice_read)
    prev_end = -1
    fbit = np.int64(0)
    pos = -1
    j = 0
    # Two batches in flight: one is decoded (prefetching its lines) while the
    # previous one, whose lines had a batch's time to arrive, is written.
    pos_buffers = np.empty((2, BATCH), np.int64)
    diff_buffers = np.empty((2, BATCH), np.int64)
    written_buffer = np.empty(BATCH if mode == CONFIRM else 0, target.dtype)
    for first in range(0, count, BATCH):
        size = min(BATCH, count - first)
        batch_pos = pos_buffers[(first // BATCH) & 1]
        batch_diff = diff_buffers[(first // BATCH) & 1]
        written = max(first - BATCH, 0)  # the previous batch is not written yet
        word, word_bit, next_byte, found = unary_ends(
            unary, batch_pos, size, word, word_bit, next_byte
        )
        if found < size:
            return written, BAD_UNARY
        for b in range(size):
            i = first + b
            end = batch_pos[b]
            quotient = end - prev_end - 1
            prev_end = end
            if quotient > (numel >> param):
                return written, BAD_UNARY
            rem = np.int64((peek(fixed, fbit) >> one) >> low)
            fbit += param
            pos += (quotient << param) + rem + 1
            if pos >= numel:
                return written, BAD_POSITION
            if mode in (GATHER, DECODE):
                # Read only: no line asked for writing; into L2, as the batch's reads
                # come a batch later (4% faster than into L1, docs/PERFORMANCE.md).
                prefetch_read_l2(target, pos)
            elif mode != DIFFS:
                prefetch_write(target, pos)
            batch_pos[b] = pos
            if zigzag:
                code = np.int64(0)
                for plane in range(width):
                    code |= np.int64(planes[plane * stride + i]) << (8 * plane)
                if code == 0:
                    return written, BAD_CONTENTS
                odd = code & 1
                batch_diff[b] = (((code >> 1) ^ -odd) ^ -flip) + flip
            else:
                negative = ((signs[i >> 3] >> (7 - (i & 7))) & 1) ^ flip
                batch_diff[b] = (1 ^ -negative) + negative
        while big[j] < first + size:
            i = big[j]
            magnitude = np.int64(2)
            for plane in range(width):
                magnitude += np.int64(planes[plane * nbig + j]) << (8 * plane)
            if magnitude & top == 0:
                return written, BAD_CONTENTS
            negative = ((signs[i >> 3] >> (7 - (i & 7))) & 1) ^ flip
            batch_diff[i - first] = (magnitude ^ -negative) + negative
            j += 1
        if first:
            previous = ((first // BATCH) - 1) & 1
            if (
                write_batch(
                    target,
                    pos_buffers[previous],
                    diff_buffers[previous],
                    np.int64(BATCH),  # not a literal: one compiled write_batch serves both calls
                    first - BATCH,
                    mode,
                    out_pos,
                    out_val,
                    out_old,
                    written_buffer,
                )
                >= 0
            ):
                return first, BAD_READBACK
    if count:
        last = ((count - 1) // BATCH) * BATCH
        slot = (last // BATCH) & 1
        if (
            write_batch(
                target,
                pos_buffers[slot],
                diff_buffers[slot],
                count - last,
                last,
                mode,
                out_pos,
                out_val,
                out_old,
                written_buffer,
            )
            >= 0
        ):
            return count, BAD_READBACK
    # Exactly ``count`` codes, the last in the last byte, then zero padding.
    if word != 0 or (prev_end >> 3) != unary.size - 1:
        return count, BAD_UNARY
    return count, DONE


@jit  # type: ignore[untyped-decorator,misc]
def rice_read(unary: Any, fixed: Any, param: int, limit: int, out: Any) -> int:
    """Decode ``out.size`` Rice-coded positions (rice.encode_positions' streams;
    ``fixed`` must hold exactly their fixed bits): the unary bits used, or -1 when
    the unary stream ends before that many codes, holds another in the word after
    the last, or a gap reaches ``limit``. Codes end where bits are set, read a word
    at a time as in walk_sparse; the caller checks that the last code ends in the
    stream's last byte and that only zero bits follow it."""
    count = out.size
    one = np.uint64(1)
    # Not literals: one compiled unary_ends serves this and the walk.
    word, _, _, found = unary_ends(unary, out, count, np.uint64(0), np.int64(0), np.int64(0))
    if found < count or word != 0:
        return -1
    low = np.uint64(63 - param)
    end = -1
    pos = -1
    fbit = np.int64(0)
    for i in range(count):
        quotient = out[i] - end - 1
        end = out[i]
        if quotient > (limit >> param):
            return -1
        if param:
            pos += (quotient << param) + np.int64((peek(fixed, fbit) >> one) >> low) + 1
            fbit += param
        else:  # no fixed bits (an empty stream, which peek would read byte by byte)
            pos += quotient + 1
        out[i] = pos
    return end + 1


@jit  # type: ignore[untyped-decorator,misc]
def read_positions(unary: Any, fixed: Any, param: int, limit: int, out: Any) -> Any:
    """Decode ``out.size`` Rice-coded positions (rice.encode_positions' streams) into
    ``out``: False unless the streams hold exactly that many codes (``fixed`` their
    fixed bits, the last code ending in the unary stream's last byte, zero bits
    after it) and every position is below ``limit``."""
    count = out.size
    if count == 0:
        return unary.size == 0 and fixed.size == 0
    if fixed.size != (count * param + 7) >> 3:
        return False
    used = rice_read(unary, fixed, param, limit, out)
    if used < 0 or (used + 7) >> 3 != unary.size:
        return False
    if used & 7 and (unary[unary.size - 1] & (0xFF >> (used & 7))) != 0:
        return False
    return out[count - 1] < limit


@jit  # type: ignore[untyped-decorator,misc]
def walk_records(
    streams: Any,
    planes: Any,
    table: Any,
    like: Any,
    mode: int,
    out_pos: Any,
    out_val: Any,
    out_old: Any,
    bigs: Any,
) -> Any:
    """``walk_sparse`` of many sparse records in one call, one row of ``table`` each
    (columns: RECORD_FIELDS), each over its own target: the memory at the row's
    ``address``, ``size`` elements of ``like``'s dtype. Outputs go to the row's
    ``out`` offset of ``out_pos``, ``out_val`` and (GATHER) ``out_old``; APPLY and
    CONFIRM record nothing (empty outputs). A write mode's failing row is walked back
    here (what it wrote); the rows before it stay written, for the caller to undo.

    The caller has checked each row's fixed and sign stream sizes, decompressed its
    contents and checked their size; the large magnitudes' indices are decoded here
    (BAD_BIG when their streams do not hold them). Returns (rows done, DONE | BAD_*
    of the row that failed)."""
    gather = mode == GATHER
    writes = mode in (APPLY, CONFIRM)
    for r in range(table.shape[0]):
        row = table[r]
        at = row[_STREAMS]
        unary = streams[at : at + row[_UNARY]]
        at += row[_UNARY]
        fixed = streams[at : at + row[_FIXED]]
        at += row[_FIXED]
        count = row[_COUNT]
        nbig = row[_NBIG]
        big = bigs[row[_BIGS] : row[_BIGS] + nbig + 1]
        zigzag = row[_ZIGZAG] != 0
        signs = streams[at : at + row[_SIGN]]
        at += row[_SIGN]
        if not zigzag:
            big_unary = streams[at : at + row[_BIG_UNARY]]
            at += row[_BIG_UNARY]
            big_fixed = streams[at : at + row[_BIG_FIXED]]
            if not read_positions(big_unary, big_fixed, row[_BIG_PARAM], count, big[:nbig]):
                return r, BAD_BIG
        big[nbig] = count
        contents = planes[row[_PLANES] : row[_PLANES] + row[_PLANES_SIZE]]
        target = numba.carray(pointer_like(row[_ADDRESS], like), row[_SIZE])
        first = row[_OUT]
        done, status = walk_sparse(
            unary,
            fixed,
            row[_PARAM],
            count,
            signs,
            big,
            contents,
            zigzag,
            target,
            mode,
            out_pos[first : first + count] if not writes else out_pos[:0],
            out_val[first : first + count] if not writes else out_val[:0],
            out_old[first : first + count] if gather else out_old[:0],
        )
        if status != DONE:
            if writes and done:
                walk_sparse(
                    unary,
                    fixed,
                    row[_PARAM],
                    done,
                    signs,
                    big,
                    contents,
                    zigzag,
                    target,
                    np.int64(UNDO),  # not a literal: the walk compiled above serves
                    out_pos[:0],
                    out_val[:0],
                    out_val[:0],
                )
            return r, status
    return table.shape[0], DONE


@jit  # type: ignore[untyped-decorator,misc]
def put_tail(stream: Any, index: int, acc: Any, held: int) -> None:
    """Flush a bit writer's ``held`` bits byte by byte: nothing is stored past the
    stream's last byte, so streams can be written back to back."""
    if held:
        acc <<= np.uint64(64 - held)
        for j in range((held + 7) >> 3):
            stream[index + j] = np.uint8((acc >> np.uint64(56 - 8 * j)) & np.uint64(0xFF))


@jit  # type: ignore[untyped-decorator,misc]
def rice_choose(positions: Any, count: int) -> Any:
    """The Rice parameter rice.encode_positions picks for ``positions[:count]``
    (count > 0), and the unary bits it takes: (param, unary bits)."""
    mean = (positions[count - 1] + 1 - count) / max(count, 1)
    guess = max(0, min(MAX_PARAM, int(np.log2(mean * 0.69 + 1.0))))
    first = max(0, guess - 1)
    candidates = min(3, MAX_PARAM + 1 - first)
    shift0 = first
    shift1 = min(first + 1, 63)
    shift2 = min(first + 2, 63)
    sum0 = positions[0] >> shift0
    sum1 = positions[0] >> shift1
    sum2 = positions[0] >> shift2
    for i in range(1, count):
        gap = positions[i] - positions[i - 1] - 1
        sum0 += gap >> shift0
        sum1 += gap >> shift1
        sum2 += gap >> shift2
    best = 0
    best_cost = sum0 + count * (1 + first)
    if candidates > 1 and sum1 + count * (2 + first) < best_cost:
        best = 1
        best_cost = sum1 + count * (2 + first)
    if candidates > 2 and sum2 + count * (3 + first) < best_cost:
        best = 2
        best_cost = sum2 + count * (3 + first)
    param = first + best
    return param, best_cost - count * param


@jit  # type: ignore[untyped-decorator,misc]
def rice_write(positions: Any, count: int, param: int, out: Any, uindex: int, findex: int) -> None:
    """Rice codes of the gaps of strictly increasing ``positions[:count]``, MSB
    first: the unary stream into ``out`` from byte ``uindex``, the fixed stream
    from byte ``findex``. Stores exactly the streams' bytes, so the two (and
    others) can lie back to back in one buffer."""
    prev = -1
    uacc = facc = np.uint64(0)
    uheld = fheld = np.int64(0)  # int64s, not literals: fewer compiled put_bits
    mask = np.uint64((1 << param) - 1)
    one = np.uint64(1)
    for i in range(count):
        p = positions[i]
        gap = p - prev - 1
        prev = p
        quotient = gap >> param
        while quotient >= 32:
            uacc, uheld, uindex = put_bits(out, uacc, uheld, uindex, np.uint64(0), np.int64(32))
            quotient -= 32
        uacc, uheld, uindex = put_bits(out, uacc, uheld, uindex, one, quotient + 1)
        if param:
            facc, fheld, findex = put_bits(out, facc, fheld, findex, np.uint64(gap) & mask, param)
    put_tail(out, uindex, uacc, uheld)
    put_tail(out, findex, facc, fheld)


@jit  # type: ignore[untyped-decorator,misc]
def encode_sparse(
    base: Any,
    new: Any,
    pos: Any,
    diff: Any,
    old: Any,
    big: Any,
    mags: Any,
    out: Any,
    planes: Any,
) -> Any:
    """The whole level-1 encoding of the common case in one call: scan, then
    Rice-coded positions and sign-magnitude contents (encode_scanned), the same
    bytes as the step-by-step path."""
    changed, resume = scan_diffs(base, new, pos, diff, old, np.int64(0))
    return encode_scanned(base, pos, diff, big, mags, out, planes, changed, resume)


@jit  # type: ignore[untyped-decorator,misc]
def encode_scanned(
    base: Any,
    pos: Any,
    diff: Any,
    big: Any,
    mags: Any,
    out: Any,
    planes: Any,
    changed: int,
    resume: int,
) -> Any:
    """The level-1 encoding of what a scan of ``base`` found (``changed`` entries of
    pos / diff, the scan stopped at ``resume``): Rice-coded positions and
    sign-magnitude contents. ``out`` receives the streams unary, fixed, sign,
    big_unary, big_fixed back to back; ``planes`` the magnitudes - 2 as byte
    planes (the caller compresses them).

    Returns (status, changed, resume, param, unary bytes, fixed bytes, sign
    bytes, large magnitudes, their param, their unary bytes, their fixed bytes).
    With status FALLBACK another encoding applies (the scan's results stay in
    pos / diff for it; resume from ``resume`` when that is short of the end): a
    bitmap may be smaller (at least 1/32 changed), the byte-plane contents are
    (under SIGNMAG_ONES / SIGNMAG_OF of the differences are +-1), or ``out`` is too small.

    Three steps, which a caller may also run apart (the last two on two threads:
    they write disjoint bytes of ``out``): sparse_plan, sparse_contents, and
    rice_write of the positions."""
    nothing = (FALLBACK, changed, resume, 0, 0, 0, 0, 0, 0, 0, 0)
    param, unary_n, fixed_n = sparse_plan(base.size, pos, changed, resume, out.size)
    if param < 0:
        return nothing
    sign_at = unary_n + fixed_n
    done, nbig, big_param, big_unary_n, big_fixed_n = sparse_contents(
        diff, changed, base.itemsize, big, mags, out, sign_at, planes
    )
    if not done:
        return nothing
    rice_write(pos, changed, param, out, np.int64(0), unary_n)
    return (
        DONE,
        changed,
        resume,
        param,
        unary_n,
        fixed_n,
        (changed + 7) >> 3,
        nbig,
        big_param,
        big_unary_n,
        big_fixed_n,
    )


@jit  # type: ignore[untyped-decorator,misc]
def sparse_plan(n: int, pos: Any, changed: int, resume: int, room: int) -> Any:
    """The layout of encode_scanned's streams for ``changed`` positions a finished
    scan of ``n`` elements found: (Rice parameter, unary bytes, fixed bytes), the
    sign bits following them; the parameter is -1 when another encoding applies
    (the scan stopped short, nothing or at least 1/32 changed) or when the
    positions and signs would not fit in ``room`` bytes."""
    if resume < n or changed == 0 or 32 * changed >= n:
        return -1, 0, 0
    param, ubits = rice_choose(pos, changed)
    unary_n = (ubits + 7) >> 3
    fixed_n = (changed * param + 7) >> 3
    if unary_n + fixed_n + ((changed + 7) >> 3) > room:
        return -1, 0, 0
    return param, unary_n, fixed_n


@jit  # type: ignore[untyped-decorator,misc]
def sparse_contents(
    diff: Any, changed: int, width: int, big: Any, mags: Any, out: Any, sign_at: int, planes: Any
) -> Any:
    """encode_scanned's sign-magnitude contents of ``diff[:changed]`` (elements of
    ``width`` bytes): the sign bits into ``out`` from byte ``sign_at``, then the
    Rice-coded indices of magnitudes above one; those magnitudes - 2 as byte planes
    into ``planes``. Writes no byte of ``out`` before ``sign_at``. (done, large
    magnitudes, their param, their unary bytes, their fixed bytes); not done when
    under SIGNMAG_ONES / SIGNMAG_OF of the differences are +-1 or ``out``
    is too small."""
    top = (1 << (8 * width)) - 1
    sign_n = (changed + 7) >> 3
    ones, nbig = signmag_diffs(diff[:changed], top, out[sign_at : sign_at + sign_n], big, mags)
    if SIGNMAG_OF * ones < SIGNMAG_ONES * changed:
        return False, 0, 0, 0, 0
    big_param = big_ubits = 0
    if nbig:
        big_param, big_ubits = rice_choose(big, nbig)
    big_unary_n = (big_ubits + 7) >> 3
    big_fixed_n = (nbig * big_param + 7) >> 3
    big_at = sign_at + sign_n
    if big_at + big_unary_n + big_fixed_n > out.size:
        return False, 0, 0, 0, 0
    if nbig:
        rice_write(big, nbig, big_param, out, big_at, big_at + big_unary_n)
        for plane in range(width):
            shift = 8 * plane
            for j in range(nbig):
                planes[plane * nbig + j] = np.uint8((mags[j] >> shift) & 0xFF)
    return True, nbig, big_param, big_unary_n, big_fixed_n


@jit  # type: ignore[untyped-decorator,misc]
def patch_chunk(
    chunk: Any,
    start: int,
    positions: Any,
    diffs: Any,
    lo: int,
    hi: int,
    old_out: Any,
    new_out: Any,
) -> None:
    """Add diffs[lo:hi] (modulo the element width) at positions[lo:hi] - start of
    ``chunk``, a copy of a tensor's elements from ``start`` on, recording the old
    and new contents (a chunk patched in cache, for hashing)."""
    for k in range(lo, hi):
        i = positions[k] - start
        old = chunk[i]
        chunk[i] = old + diffs[k]
        old_out[k] = old
        new_out[k] = chunk[i]
