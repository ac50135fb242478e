"""Level 3: chunked, base-conditioned positions (the ``chunked`` encoding).

A tensor is cut into chunks of ``2 ** chunk`` elements that decode independently,
so one large tensor decodes on several threads (or on a GPU, chunked_torch.py).
Within a chunk, elements fall into up to four magnitude buckets of their base
value (``bounds``: thresholds on the bits below the sign, i.e. on the exponent):
the chance that an element changes depends strongly on its exponent, and the
receiver holds the base. Each bucket codes the gaps between the ranks of its
changed elements among its own elements (Rice, one parameter per chunk and
bucket); one vector compare per bound and 64 elements gives the buckets on both
sides. Contents, in position order: one sign bit per change, the indices of
magnitudes above one (Rice-coded gaps in the chunk's change order), those
magnitudes - 2 as one zstd frame of byte planes for the whole tensor.

Streams: ``table`` (LEB128 varints, per chunk: its bytes in ``bits``, then count
and Rice parameter of each bucket, then of the large magnitudes), ``bits`` (the
chunks' bit streams back to back, each from a byte boundary; their starting
offsets are the running sum of the table's byte counts, the starting element of
chunk c is c * 2 ** chunk), ``mags``.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline import cpus
from pipeline.codec import contents
from pipeline.codec.dtypes import DtypeInfo

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
AnyUInt = npt.NDArray[np.unsignedinteger]

ROLES = ("table", "bits", "mags")
CHUNK_LOG2 = 20  # 1M elements: a few kilobytes of bits per chunk at about 2% changed
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 6, 30
MAX_GROUPS = 4
MAX_PARAM = 40
# What buckets cost, in bits weighed against the bits they save: table bits per
# bucket and chunk (count and parameter); and decode time, as bits per element of
# the tensor: once for walking the base at all, and per bucket it keeps apart.
# The walk's weight keeps buckets from about 0.6% changed on (bench_codec: 0.89x the
# bound at 0.66% changed and apply_to within 1.5x of level 1; 0.02 kept one bucket
# up to about 1.5%, 1.04-1.05x the bound).
GROUP_PENALTY_BITS = 24.0
WALK_BITS_PER_ELEMENT = 0.005
GROUP_BITS_PER_ELEMENT = 0.01
# The sample the bucket bounds are chosen from (before the scan): runs of SAMPLE_RUN
# elements, one in every SAMPLE_EVERY such lengths, or the whole of a tensor of at
# most SAMPLE_ALL; the classes of its changes estimate how changes fall into buckets.
# MEMBERS elements of it, from the starts of at most MEMBER_RUNS runs, estimate the
# buckets' sizes (a histogram per element costs more than a compare per 64).
SAMPLE_RUN, SAMPLE_EVERY, SAMPLE_ALL = 2048, 16, 1 << 16
MEMBERS, MEMBER_RUNS = 1 << 14, 64
# Threads one tensor decodes on: a thread takes at least this many changes.
MIN_CHANGES_PER_THREAD = 1 << 15
DECODE_THREADS = max(1, min(8, cpus.available()))

DONE, BAD_UNARY, BAD_FIXED, BAD_POSITION, BAD_CONTENTS = 0, 1, 2, 3, 4
_REASONS = {
    BAD_UNARY: "a chunk's unary codes run past its bytes",
    BAD_FIXED: "a chunk's bits do not match its recorded counts",
    BAD_POSITION: "a chunk's positions do not fall within its elements",
    BAD_CONTENTS: "a chunk's large magnitudes do not match their indices",
}


# read_table's outcomes other than TABLE_OK (0), as chunked_jit.py numbers them.
TABLE_NUMBERS, TABLE_PARAM, TABLE_COUNTS, TABLE_TOTALS, TABLE_BYTES, TABLE_SHORT = range(1, 7)
_TABLE_REASONS = {
    TABLE_NUMBERS: "chunk table does not hold its numbers",
    TABLE_PARAM: "a Rice parameter is out of range",
    TABLE_COUNTS: "a chunk's counts exceed its elements",
    TABLE_TOTALS: "chunk counts do not add up to the record's",
    TABLE_BYTES: "chunk byte counts do not add up to the bit stream",
    TABLE_SHORT: "a chunk has fewer bits than its codes need",
}


class ChunkedError(Exception):
    """Chunked streams do not decode to what the record promises."""


@functools.cache
def compiled() -> Any:
    """The chunked kernels (numba is imported, and they are built, on first use):
    they encode, check a record's chunk table and decode on CPU tensors; the
    torch-ops decoder (chunked_torch.py) serves other devices."""
    return importlib.import_module("pipeline.codec.level3.chunked_jit")


def magnitude_mask(info: DtypeInfo) -> int:
    """The bits below the sign bit, which order a float's magnitude."""
    return (1 << (8 * info.width - 1)) - 1


def padded_bounds(bounds: I64, info: DtypeInfo) -> npt.NDArray[np.uint64]:
    """Three thresholds for the kernels: ``bounds`` then values above every magnitude
    (their buckets stay empty)."""
    out = np.full(MAX_GROUPS - 1, magnitude_mask(info) + 1, np.uint64)
    out[: bounds.size] = bounds
    return out


# ----------------------------------------------------------------------------- varints


def write_varints(values: I64) -> U8:
    """Non-negative integers below 2**63 as LEB128 (7 bits a byte, low first, high
    bit: more)."""
    out = np.empty(10 * values.size, np.uint8)
    used = compiled().write_varints(values, out)
    return out[:used].copy()


# ----------------------------------------------------------------------------- encode


@dataclass(frozen=True)
class EncodedChunks:
    streams: dict[str, U8]
    params: dict[str, Any]


def choose_bounds(walker: Any, base: AnyUInt, new: AnyUInt, info: DtypeInfo, nchunks: int) -> I64:
    """Magnitude thresholds that split the elements into the buckets whose changes
    cost the fewest bits. Chosen before the scan, which ranks each change in its
    bucket as it finds it, from a fixed sample (deterministic; the whole of a small
    tensor): the classes of the changed elements in it, and of all the elements in
    part of it. On bench_codec's medium delta the sampled bounds cost no bytes
    against bounds from every change (606,844 against 610,003)."""
    if info.exponent is None:
        return np.zeros(0, np.int64)
    shift, top = info.exponent
    numel = base.size
    if numel <= SAMPLE_ALL:
        runs, run_len = 1, numel
    else:
        runs, run_len = numel // (SAMPLE_RUN * SAMPLE_EVERY), SAMPLE_RUN
    every = -(-runs // MEMBER_RUNS)
    member_len = min(run_len, MEMBERS // -(-runs // every))
    penalty = GROUP_PENALTY_BITS * nchunks + GROUP_BITS_PER_ELEMENT * numel
    walk = WALK_BITS_PER_ELEMENT * numel
    out = np.zeros(MAX_GROUPS - 1, np.int64)
    count = walker.choose_bounds(
        base, new, shift, top, runs, run_len, every, member_len, MAX_GROUPS, penalty, walk, out
    )
    return out[:count]


_scratch = threading.local()


def _buffer(key: str, size: int, dtype: Any) -> npt.NDArray[Any]:
    """A per-thread buffer of at least ``size`` elements, reused between tensors."""
    held: dict[str, npt.NDArray[Any]] | None = getattr(_scratch, "held", None)
    if held is None:
        held = _scratch.held = {}
    buf = held.get(key)
    if buf is None or buf.size < size or buf.dtype != np.dtype(dtype):
        buf = held[key] = np.empty(max(size, 1 << 16), dtype)
    return buf[:size]


def _zeroed_ranks(words: int) -> npt.NDArray[np.uint64]:
    """The decoder's per-thread rank bitmaps, one row per bucket, zero (the kernel
    leaves them zero), at least ``words`` a row."""
    held: npt.NDArray[np.uint64] | None = getattr(_scratch, "ranks", None)
    if held is None or held.shape[1] < words:
        held = _scratch.ranks = np.zeros((MAX_GROUPS, max(words, 1 << 10)), np.uint64)
    return held


@dataclass(frozen=True)
class Scan:
    """A tensor's changes as level 3's scan found them: positions ascending,
    differences new - base and base contents there (unsigned), and each change's
    rank * 4 + bucket within its chunk, for the magnitude ``bounds``."""

    where: I64
    diff: AnyUInt
    old: AnyUInt
    ranks: I64
    bounds: I64


def scan(walker: Any, base: AnyUInt, new: AnyUInt, info: DtypeInfo) -> Scan:
    """Chooses the bounds, then finds and ranks the changes of two flat unsigned
    arrays in one pass (per-thread scratch: consumed before the next tensor)."""
    numel = base.size
    chunk = 1 << CHUNK_LOG2
    bounds = choose_bounds(walker, base, new, info, -(-numel // chunk))
    padded = padded_bounds(bounds, info)
    magnitude = np.uint64(magnitude_mask(info))
    running = np.zeros(MAX_GROUPS, np.uint64)  # each bucket's count so far in its chunk
    capacity = numel // 16 + 128  # ~6% changed; a denser tensor resumes into more
    kind = base.dtype.str
    bufs: tuple[npt.NDArray[Any], ...] = (
        _buffer("positions", capacity, np.int64),
        _buffer("diffs" + kind, capacity, base.dtype),
        _buffer("olds" + kind, capacity, base.dtype),
        _buffer("ranks", capacity, np.int64),
    )
    pieces: list[list[npt.NDArray[Any]]] = []
    start = 0
    while True:
        count, start = walker.scan_ranked(
            base, new, chunk, padded, bounds.size + 1, magnitude, *bufs, running, start
        )
        pieces.append([b[:count] for b in bufs])
        if start >= numel:
            break
        if len(pieces) == 1:  # the scratch is reused below: keep a copy
            pieces[0] = [p.copy() for p in pieces[0]]
        capacity = min(2 * capacity, numel - start + 128)
        bufs = tuple(np.empty(capacity, b.dtype) for b in bufs)
    if len(pieces) == 1:
        parts = pieces[0]
    else:
        parts = [np.concatenate(p) for p in zip(*pieces, strict=True)]
    return Scan(parts[0], parts[1], parts[2], parts[3], bounds)


def encode(walker: Any, base: AnyUInt, found: Scan) -> EncodedChunks:
    """The chunked streams of a tensor's changes (``base``: flat, unsigned)."""
    numel = base.size
    chunk = 1 << CHUNK_LOG2
    nchunks = -(-numel // chunk)
    bounds = found.bounds
    groups = bounds.size + 1
    table = np.zeros((nchunks, 2 * groups + 3), np.int64)
    changed = found.where.size
    capacity = (2 * numel + (2 * MAX_PARAM + 8) * changed) // 8 + nchunks + 64
    out = _buffer("bits", capacity, np.uint8)
    mags = _buffer(f"mags{base.dtype.str}", changed, base.dtype)
    most = min(chunk, numel, changed)  # changes of one chunk, at most
    by_bucket = _buffer("by_bucket", groups * most, np.int64)  # a range per bucket
    big_gaps = _buffer("big_gaps", most, np.int64)
    signs = _buffer("signs", (most + 63) >> 6, np.uint64)
    used, nbig = walker.encode_chunks(
        base,
        found.where,
        found.diff,
        found.ranks,
        chunk,
        groups,
        table,
        out,
        mags,
        by_bucket,
        big_gaps,
        signs,
    )
    streams = {
        "table": write_varints(table.reshape(-1)),
        "bits": out[:used].copy(),
        "mags": contents.encode_planes(mags[:nbig]) if nbig else np.zeros(0, np.uint8),
    }
    params = {"chunk": CHUNK_LOG2, "bounds": [int(b) for b in bounds], "big": int(nbig)}
    return EncodedChunks(streams, params)


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Layout:
    """A validated chunked record: per-chunk numbers and where each chunk's bits,
    large magnitudes and outputs start."""

    chunk: int  # elements per chunk
    bounds: I64
    table: I64  # (chunks, 2 * groups + 3)
    starts: I64  # byte offset of each chunk in ``bits``
    changes: I64  # changed elements per chunk
    out_at: I64  # index of each chunk's first change in the tensor's change order
    big_at: I64  # index of each chunk's first large magnitude
    # What every decode of the record needs, worked out once:
    big: int  # large magnitudes in all
    most_codes: int  # Rice codes of the chunk with the most
    padded: npt.NDArray[np.uint64]  # padded_bounds(bounds)
    magnitude: np.uint64  # magnitude_mask of the dtype

    @property
    def groups(self) -> int:
        return int(self.bounds.size) + 1


def layout(
    streams: dict[str, U8], params: dict[str, Any], changed: int, numel: int, info: DtypeInfo
) -> Layout | str:
    """The record's layout, or the reason it is inconsistent (checked before any
    decoding allocates from its numbers)."""
    log2 = params.get("chunk")
    if type(log2) is not int or not MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2:
        return f"chunk size exponent {log2!r} out of range"
    raw_bounds = params.get("bounds")
    if not isinstance(raw_bounds, list) or len(raw_bounds) > MAX_GROUPS - 1:
        return "bucket bounds are not a short list"
    if not all(type(b) is int for b in raw_bounds):
        return "bucket bounds are not integers"
    if raw_bounds and info.exponent is None:
        return "bucket bounds on a dtype without an exponent"
    top = magnitude_mask(info)
    if any(not 0 < b <= top for b in raw_bounds) or any(
        a >= b for a, b in itertools.pairwise(raw_bounds)
    ):
        return "bucket bounds are not increasing magnitudes"
    big = params.get("big")
    if type(big) is not int or not 0 <= big <= changed:
        return f"count of large differences {big!r} not within 0..{changed}"
    width = info.width
    mags = streams["mags"]
    if (mags.size > 0) != (big > 0) or (big and contents.frame_content_size(mags) != big * width):
        return "magnitude frame does not match the count of large differences"
    chunk = 1 << log2
    nchunks = -(-numel // chunk)
    groups = len(raw_bounds) + 1
    table = np.empty((nchunks, 2 * groups + 3), np.int64)
    starts, changes, out_at, big_at = np.empty((4, nchunks), np.int64)
    found, most_codes = compiled().read_table(
        streams["table"],
        groups,
        chunk,
        numel,
        changed,
        big,
        streams["bits"].size,
        table,
        starts,
        changes,
        out_at,
        big_at,
    )
    if found:
        return _TABLE_REASONS[found]
    bounds = np.asarray(raw_bounds, np.int64)
    return Layout(
        chunk,
        bounds,
        table,
        starts,
        changes,
        out_at,
        big_at,
        big,
        int(most_codes),
        padded_bounds(bounds, info),
        np.uint64(top),
    )


# ----------------------------------------------------------------------------- decode


def large_magnitudes(streams: dict[str, U8], nbig: int, info: DtypeInfo) -> AnyUInt:
    """The large magnitudes - 2 of a record (one placeholder when there are none)."""
    if not nbig:
        return np.zeros(1, info.unsigned)
    try:
        return contents.decode_planes(streams["mags"], nbig, info.unsigned)
    except contents.ContentsError as exc:
        raise ChunkedError(str(exc)) from None


def magnitude_planes(streams: dict[str, U8], nbig: int, info: DtypeInfo) -> U8:
    """The large magnitudes - 2 of a record as their byte planes, as the compiled
    decode reads them (it gathers each one's bytes, so nothing is transposed)."""
    if not nbig:
        return np.zeros(info.width, np.uint8)
    raw = contents.decompress(streams["mags"], nbig * info.width)
    if raw is None:
        raise ChunkedError("contents frame does not decompress to the recorded size")
    return np.frombuffer(raw, np.uint8)


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _decode_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():  # threads do not survive fork
            workers = max(1, min(8, cpus.available()))
            _pool = (os.getpid(), ThreadPoolExecutor(workers, "deltasync-decode"))
        return _pool[1]


def _ranges(lay: Layout, threads: int) -> list[tuple[int, int]]:
    """Contiguous chunk ranges with about equal numbers of changes."""
    nchunks = lay.table.shape[0]
    if threads <= 1 or nchunks <= 1:
        return [(0, nchunks)]
    total = int(lay.changes.sum())
    ends = np.cumsum(lay.changes)
    cuts = [
        int(np.searchsorted(ends, total * t / threads, side="left")) + 1 for t in range(1, threads)
    ]
    edges = sorted({0, nchunks, *[min(max(c, 1), nchunks - 1) for c in cuts]})
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def decode(
    walker: Any,
    streams: dict[str, U8],
    lay: Layout,
    changed: int,
    target: AnyUInt,
    info: DtypeInfo,
    *,
    write: bool,
    threads: int | None = None,
) -> tuple[I64, AnyUInt, AnyUInt]:
    """(positions, new contents, old contents) of the changed elements of ``target``
    (the base, flat, unsigned view). With ``write`` the new contents are written
    into ``target``; a damaged stream raises ChunkedError with ``target`` as it was.
    Chunks are shared out over ``threads`` (default: as many as pay)."""
    unsigned = info.unsigned
    planes = magnitude_planes(streams, lay.big, info)
    out_pos = np.empty(changed, np.int64)
    out_new = np.empty(changed, unsigned)
    out_old = np.empty(changed, unsigned)
    wanted = DECODE_THREADS if threads is None else threads
    wanted = max(1, min(wanted, changed // MIN_CHANGES_PER_THREAD if threads is None else wanted))
    ranges = _ranges(lay, wanted)
    rank_words = (min(lay.chunk, target.size) >> 6) + 2 if lay.groups > 1 else 1

    def run(span: tuple[int, int]) -> tuple[int, int]:
        gaps = _buffer("decode_gaps", max(lay.most_codes, 1), np.int64)
        ranks = _zeroed_ranks(rank_words)
        first, stop = span
        done, status = walker.decode_chunks(
            streams["bits"],
            lay.table,
            lay.starts,
            first,
            stop,
            target,
            lay.chunk,
            lay.padded,
            lay.groups,
            lay.magnitude,
            planes,
            lay.big_at,
            lay.out_at,
            out_pos,
            out_new,
            out_old,
            gaps,
            ranks,
            write,
        )
        return int(done), int(status)

    results = [run(ranges[0])] if len(ranges) == 1 else list(_decode_pool().map(run, ranges))
    failed = [status for _, status in results if status != DONE]
    if failed:
        if write:
            for (first, _), (done, _) in zip(ranges, results, strict=True):
                if done:
                    a = int(lay.out_at[first])
                    b = int(lay.out_at[first + done - 1] + lay.changes[first + done - 1])
                    walker.restore(target, out_pos, out_old, a, b)
        raise ChunkedError(_REASONS.get(failed[0], "a chunk is damaged"))
    return out_pos, out_new, out_old
