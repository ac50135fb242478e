"""Decoding ``chunked`` records with torch operations, on the base's device.

The same streams as chunked.py's compiled walk (the reference), decoded with
whole-tensor operations so that a GPU decodes where its weights are: the bit
stream is spread into one byte per bit, the ends of the unary codes are its set
bits found at each chunk's recorded starting offset, fixed-width bits are
gathered at offsets computed from the recorded counts and parameters, gaps
become ranks by a cumulative sum per bucket and chunk, and ranks become
positions through the indices of each bucket's elements, taken from the base
(``torch.bucketize`` of its magnitude bits). Only the large magnitudes' zstd
frame is decompressed on the host. Also runs on the CPU (where numba is
missing, and in tests); damage raises ChunkedError.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.codec.dtypes import DtypeInfo
from pipeline.codec.level3.chunked import ChunkedError, Layout, large_magnitudes, magnitude_mask

U8 = np.ndarray  # type: ignore[type-arg]

# Elements one pass decodes at most. A pass holds a few int64 temporaries per element
# of its chunks (bucket keys, their sort), so a whole large tensor at once would need
# gigabytes beside a serving engine's weights and cache; chunks decode independently.
PASS_ELEMENTS = 1 << 22


def _segment_cumsum(values: torch.Tensor, segment_lengths: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sums that restart at each segment."""
    total = torch.cumsum(values, 0)
    starts = torch.cumsum(segment_lengths, 0) - segment_lengths
    before = torch.zeros_like(segment_lengths)
    nonempty = segment_lengths > 0
    before[nonempty] = total[starts[nonempty]] - values[starts[nonempty]]
    return total - torch.repeat_interleave(before, segment_lengths)


def decode(
    streams: dict[str, U8], lay: Layout, changed: int, base: torch.Tensor, info: DtypeInfo
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, new contents in the dtype's integer view) of the changed elements
    of ``base`` (flat integer view), on ``base``'s device, in passes of at most
    PASS_ELEMENTS elements' chunks."""
    nchunks = lay.table.shape[0]
    mags = large_magnitudes(streams, lay.big, info)  # on the host, once
    per_pass = max(1, PASS_ELEMENTS // lay.chunk)
    found = [
        _decode_pass(streams["bits"], lay, first, min(nchunks, first + per_pass), base, info, mags)
        for first in range(0, max(nchunks, 1), per_pass)
    ]
    if len(found) == 1:
        return found[0]
    positions = torch.cat([p for p, _ in found])
    if positions.numel() != changed:
        raise ChunkedError("chunk counts do not add up to the record's")
    return positions, torch.cat([v for _, v in found])


def _decode_pass(
    stream: U8,
    lay: Layout,
    first: int,
    stop: int,
    whole: torch.Tensor,
    info: DtypeInfo,
    all_mags: U8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode() of chunks ``first`` .. ``stop - 1``: positions in the whole tensor."""
    device = whole.device
    groups = lay.groups
    nchunks = stop - first
    offset = first * lay.chunk
    base = whole[offset : offset + nchunks * lay.chunk]
    rows = lay.table[first:stop]
    byte0 = int(lay.starts[first]) if nchunks else 0
    byte_end = int(lay.starts[stop - 1] + rows[-1, 0]) if nchunks else 0
    table = torch.from_numpy(rows.copy()).to(device)
    counts = table[:, 1::2]  # (chunks, groups + 1)
    params = table[:, 2::2]
    bits_u8 = torch.from_numpy(stream[byte0:byte_end].copy()).to(device)
    shifts = torch.arange(7, -1, -1, device=device, dtype=torch.uint8)
    bits = ((bits_u8[:, None] >> shifts) & 1).reshape(-1).to(torch.int64)
    start_bit = torch.from_numpy((lay.starts[first:stop] - byte0) * 8).to(device)
    end_bit = start_bit + table[:, 0] * 8
    codes_per_chunk = counts.sum(1)
    total = int(codes_per_chunk.sum())
    chunk_of_code = torch.repeat_interleave(torch.arange(nchunks, device=device), codes_per_chunk)
    flat_counts = counts.reshape(-1)
    group_of_code = torch.repeat_interleave(
        torch.arange(groups + 1, device=device).repeat(nchunks), flat_counts
    )
    param_of_code = torch.repeat_interleave(params.reshape(-1), flat_counts)
    code_at = torch.cumsum(codes_per_chunk, 0) - codes_per_chunk
    local = torch.arange(total, device=device) - code_at[chunk_of_code]
    # Unary: the code ends are the first set bits at or after each chunk's start.
    ones = torch.nonzero(bits).view(-1)
    first_one = torch.searchsorted(ones, start_bit)
    which = first_one[chunk_of_code] + local
    if total and int(which.max()) >= ones.numel():
        raise ChunkedError("a chunk's unary codes run past its bytes")
    ends = ones[which] if total else torch.zeros(0, dtype=torch.int64, device=device)
    prev = torch.empty_like(ends)
    if total:
        prev[1:] = ends[:-1]
        prev[local == 0] = start_bit[chunk_of_code[local == 0]] - 1
    quotients = ends - prev - 1
    last_end = start_bit - 1
    has_codes = codes_per_chunk > 0
    last_index = code_at + codes_per_chunk - 1
    if total:
        last_end = torch.where(has_codes, ends[last_index.clamp(min=0)], last_end)
    fixed_start = last_end + 1
    # Fixed-width bits: each code's offset is the sum of the parameters before it.
    offsets = torch.cumsum(param_of_code, 0) - param_of_code
    fixed_at = fixed_start[chunk_of_code] + offsets
    if total:
        fixed_at = fixed_at - offsets[code_at[chunk_of_code]]
    fixed_bits = (counts * params).sum(1)
    sign_at = fixed_start + fixed_bits
    changes = torch.from_numpy(lay.changes[first:stop].copy()).to(device)
    changed = int(changes.sum())
    sign_end = sign_at + changes
    if bool(((sign_end > end_bit) | (end_bit - sign_end >= 8)).any()) or bool(
        (quotients > (lay.chunk >> param_of_code)).any()
    ):
        raise ChunkedError("a chunk's bits do not match its recorded counts")
    # Padding after the signs must be zero bits: one canonical stream per record.
    padding = torch.zeros_like(bits)
    padding_len = end_bit - sign_end
    padded = padding_len > 0
    if bool(padded.any()):
        marks = torch.zeros(bits.numel() + 1, dtype=torch.int64, device=device)
        marks.index_add_(0, sign_end[padded], torch.ones_like(sign_end[padded]))
        marks.index_add_(0, end_bit[padded], -torch.ones_like(end_bit[padded]))
        padding = torch.cumsum(marks, 0)[:-1] > 0
        if bool((bits.bool() & padding).any()):
            raise ChunkedError("a chunk's bits do not match its recorded counts")
    low = torch.zeros(total, dtype=torch.int64, device=device)
    top_param = int(param_of_code.max()) if total else 0
    for j in range(top_param):
        use = param_of_code > j
        index = torch.where(use, fixed_at + j, torch.zeros_like(fixed_at))
        low = torch.where(use, (low << 1) | bits[index], low)
    gaps = (quotients << param_of_code) | low
    # Ranks per (chunk, group) segment.
    ranks = _segment_cumsum(gaps + 1, flat_counts) - 1
    is_position = group_of_code < groups
    pos_chunk = chunk_of_code[is_position]
    pos_group = group_of_code[is_position]
    pos_rank = ranks[is_position]
    numel = base.numel()
    if groups == 1:
        positions = pos_chunk * lay.chunk + pos_rank
        limit = torch.clamp(numel - pos_chunk * lay.chunk, max=lay.chunk)
        if bool((pos_rank >= limit).any()):
            raise ChunkedError("a chunk's positions do not fall within its elements")
    else:
        magnitude = base.to(torch.int64) & magnitude_mask(info)
        bounds = torch.from_numpy(lay.bounds).to(device)
        bucket = torch.bucketize(magnitude, bounds, right=True)
        element_chunk = torch.arange(numel, device=device) // lay.chunk
        key = element_chunk * groups + bucket
        order = torch.argsort(key, stable=True)
        members = torch.bincount(key, minlength=nchunks * groups)
        member_at = torch.cumsum(members, 0) - members
        seg = pos_chunk * groups + pos_group
        if bool((pos_rank >= members[seg]).any()):
            raise ChunkedError("a chunk's positions do not fall within its elements")
        positions = torch.sort(order[member_at[seg] + pos_rank]).values
    # Contents, in position order.
    change_chunk = torch.repeat_interleave(torch.arange(nchunks, device=device), changes)
    change_at = torch.cumsum(changes, 0) - changes
    j_local = torch.arange(changed, device=device) - change_at[change_chunk]
    negative = bits[sign_at[change_chunk] + j_local].bool()
    magnitudes = torch.ones(changed, dtype=torch.int64, device=device)
    is_big = ~is_position
    nbig = int(is_big.sum())
    width_bits = 8 * info.width
    top = (1 << width_bits) - 1 if width_bits < 64 else -1
    if nbig:
        big_chunk = chunk_of_code[is_big]
        big_index = ranks[is_big]
        if bool((big_index >= changes[big_chunk]).any()):
            raise ChunkedError("a chunk's large magnitudes do not match their indices")
        big0 = int(lay.big_at[first])
        planes = all_mags[big0 : big0 + nbig]
        if planes.size != nbig:
            raise ChunkedError("a chunk's large magnitudes do not match their indices")
        wide = planes.astype(np.int64) if info.width < 8 else planes.view(np.int64).copy()
        mags = torch.from_numpy(wide)
        mags = (mags.to(device) + 2) & top
        if bool(((mags >= 0) & (mags <= 1)).any()):
            raise ChunkedError("a chunk's large magnitudes do not match their indices")
        magnitudes[change_at[big_chunk] + big_index] = mags
    diffs = torch.where(negative, -magnitudes, magnitudes)
    old = base.index_select(0, positions).to(torch.int64)
    new = old + diffs
    if width_bits < 64:
        new = new & top
        signed = new - ((new >> (width_bits - 1)) & 1) * (1 << width_bits)
        if base.dtype == torch.uint8:
            signed = new
        values = signed.to(base.dtype)
    else:
        values = new
    return positions + offset, values
