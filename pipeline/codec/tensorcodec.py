"""Encode and decode one tensor's change.

Encodings (the smallest wins per tensor):
- ``same``: nothing changed, no streams.
- ``sparse``: positions as Rice-coded gaps, then contents.
- ``bitmap``: zstd of the packed change mask, then contents.
- ``dense``: zigzagged difference of every element as zstd byte planes.
- ``chunked`` (level 3): independent chunks, positions per magnitude bucket of
  the base (chunked.py).
Contents are bit-pattern differences new - base in the integer view
(contents.py); decoding adds them to the receiver's base.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.codec import contents, positions, rice
from pipeline.codec.compiled import fused, kernels
from pipeline.codec.dtypes import DtypeInfo
from pipeline.codec.level3 import chunked
from pipeline.codec.positions import to_numpy

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
AnyUInt = npt.NDArray[np.unsignedinteger]

ENCODINGS = ("same", "sparse", "bitmap", "dense", "chunked")
BITMAP_MIN_DENSITY = 1 / 32
DENSE_MIN_DENSITY = 1 / 4
# A tensor this large has its scan cut into pieces that idle encoding threads help
# with: alone in its part (an untied lm_head often is), it would keep one thread
# busy while the others wait.
SPLIT_SCAN_ELEMENTS = 1 << 24
SPLIT_PIECE_ELEMENTS = 1 << 22
# Scan buffers hold one change per SCAN_SHARE elements; a piece of a split scan
# writes into its own share of them.
SCAN_SHARE = 16


class DamagedStreamError(Exception):
    """A stream does not decode to what its record promises (reason in the message)."""


class ReadBackError(Exception):
    """A confirmed walk (fused.CONFIRM) read a written position back and found other
    contents than it wrote."""


@dataclass(frozen=True)
class Helpers:
    """Other threads that may take pieces of a large tensor's encode (its scan, then
    its coding and ``on_changes``): ``submit`` runs a function on one of ``threads``
    (ThreadPoolExecutor.submit)."""

    submit: Callable[[Callable[[], None]], object]
    threads: int


@dataclass
class Encoded:
    encoding: str
    changed: int
    streams: dict[str, U8] = field(default_factory=dict)  # role -> bytes, in stored order
    params: dict[str, Any] = field(default_factory=dict)
    blob: U8 | None = None  # the streams back to back, when they were built that way

    @property
    def nbytes(self) -> int:
        return sum(int(s.size) for s in self.streams.values())


def roles(encoding: str, params: dict[str, Any]) -> tuple[str, ...] | None:
    """The stream roles a record must have, in order; None when params are unusable."""
    if encoding == "same":
        return ()
    if encoding == "dense":
        return contents.ROLES["planes"]
    if encoding == "chunked":
        return chunked.ROLES
    method = params.get("contents")
    if encoding not in positions.ROLES or method not in contents.ROLES:
        return None
    return positions.ROLES[encoding] + contents.ROLES[method]


# (positions, new - base there (wrapping), base there) of a tensor's changed elements.
Changes = tuple[I64, AnyUInt, AnyUInt]
# The scan's buffers (positions, differences, base contents), count and resume point.
Scanned = tuple[I64, AnyUInt, AnyUInt, int, int]


def find_changes(base: AnyUInt, new: AnyUInt) -> Changes:
    """Positions where two flat arrays differ, the differences new - base there
    (wrapping) and the base contents there: one vectorised pass (fused.scan_diffs)."""
    return _scan_compiled(fused.get(), base, new)


def _scan_capacity(numel: int) -> int:
    """Scan output slots: room for ~6% changed (the scan stops and is resumed into
    larger buffers when more changed)."""
    return numel // SCAN_SHARE + 2 * fused.LANES


def _scan_compiled(
    compiled: Any,
    base: AnyUInt,
    new: AnyUInt,
    done: Scanned | None = None,
) -> Changes:
    """Views into per-thread scratch buffers (contents.scratch): encode_tensor
    consumes them before it scans the next tensor. ``done``: the buffers, count
    and resume point of a scan that already ran."""
    if done is None:
        capacity = _scan_capacity(base.size)
        out_pos = contents.scratch("positions", capacity, np.int64)
        out_diff = contents.scratch("diffs", capacity, base.dtype)
        out_old = contents.scratch("olds", capacity, base.dtype)
        count, start = compiled.scan_diffs(base, new, out_pos, out_diff, out_old, 0)
    else:
        out_pos, out_diff, out_old, count, start = done
        capacity = out_pos.size
    if start >= base.size:
        return out_pos[:count], out_diff[:count], out_old[:count]
    pieces = [(out_pos[:count].copy(), out_diff[:count].copy(), out_old[:count].copy())]
    while start < base.size:
        capacity = min(2 * capacity, base.size - start + 2 * fused.LANES)
        out_pos = np.empty(capacity, np.int64)
        out_diff = np.empty(capacity, base.dtype)
        out_old = np.empty(capacity, base.dtype)
        count, start = compiled.scan_diffs(base, new, out_pos, out_diff, out_old, start)
        pieces.append((out_pos[:count], out_diff[:count], out_old[:count]))
    return (
        np.concatenate([p[0] for p in pieces]),
        np.concatenate([p[1] for p in pieces]),
        np.concatenate([p[2] for p in pieces]),
    )


def _changes(base_flat: torch.Tensor, new_flat: torch.Tensor, info: DtypeInfo) -> Changes:
    """Positions of changed elements, the differences new - base there and the base
    contents there (unsigned)."""
    unsigned = info.unsigned
    if base_flat.device.type == "cpu":
        return find_changes(base_flat.numpy().view(unsigned), new_flat.numpy().view(unsigned))
    where_t = torch.nonzero(torch.ne(base_flat, new_flat)).view(-1)
    base_vals = to_numpy(base_flat[where_t]).view(unsigned)
    return to_numpy(where_t), to_numpy(new_flat[where_t]).view(unsigned) - base_vals, base_vals


# Called with (positions, new - base modulo the width, base there), unsigned, of a
# tensor's changed elements as the encoder's own scan found them, on the encoding
# thread, before the next tensor is scanned (the arrays may be scratch reused after it
# returns).
OnChanges = Callable[[I64, AnyUInt, AnyUInt], None]


def encode_tensor(
    base_flat: torch.Tensor,
    new_flat: torch.Tensor,
    info: DtypeInfo,
    level: int,
    on_changes: OnChanges | None = None,
    helpers: Helpers | None = None,
) -> Encoded:
    """The smallest encoding of the change from base to new (flat integer views).
    ``on_changes`` gets the changes the scan found, when there are any. ``helpers``:
    where pieces of a large tensor's scan may run besides this thread."""
    numel = base_flat.numel()
    if numel == 0:
        return Encoded("same", 0)
    if level >= 3:
        return _encode_chunked(chunked.compiled(), base_flat, new_flat, info, on_changes)
    compiled = fused.get()
    if base_flat.device.type == "cpu" and info.width <= 4:
        base_np = base_flat.numpy().view(info.unsigned)
        new_np = new_flat.numpy().view(info.unsigned)
        encoded, scanned, hooked = _encode_sparse_compiled(
            compiled, base_np, new_np, helpers, on_changes
        )
        if hooked:
            on_changes = None
        if encoded is not None:
            if on_changes is not None:  # done: the scan ran to the end
                count = scanned[3]
                on_changes(scanned[0][:count], scanned[1][:count], scanned[2][:count])
            return encoded
        where, diff, old = _scan_compiled(compiled, base_np, new_np, scanned)
    else:
        where, diff, old = _changes(base_flat, new_flat, info)
    changed = where.size
    if changed == 0:
        return Encoded("same", 0)
    if on_changes is not None:
        on_changes(where, diff, old)
    content_streams, content_params = contents.encode_contents(diff)

    candidates: list[Encoded] = []
    if changed < numel:
        streams, params = positions.encode_sparse(where)
        candidates.append(Encoded("sparse", changed, streams, params))
    if changed >= numel * BITMAP_MIN_DENSITY:
        mask = np.zeros(numel, bool)
        mask[where] = True
        candidates.append(Encoded("bitmap", changed, positions.encode_bitmap(mask)))
    best = min(candidates, key=lambda e: e.nbytes) if candidates else None
    if best is not None:
        best.streams.update(content_streams)
        best.params.update(content_params)
    if changed >= numel * DENSE_MIN_DENSITY:
        unsigned = info.unsigned
        all_diff = to_numpy(new_flat).view(unsigned) - to_numpy(base_flat).view(unsigned)
        dense = Encoded(
            "dense", changed, {"values": contents.encode_planes(contents.zigzag(all_diff))}
        )
        if best is None or dense.nbytes < best.nbytes:
            best = dense
    assert best is not None
    return best


def _encode_chunked(
    walker: Any,
    base_flat: torch.Tensor,
    new_flat: torch.Tensor,
    info: DtypeInfo,
    on_changes: OnChanges | None = None,
) -> Encoded:
    """Level 3: the ``chunked`` encoding, or a level-1 one where that is smaller.
    Level 1 is tried only where it can be: differences mostly above one unit, a
    quarter or more changed (its dense encoding), or changes that the buckets do
    not tell apart at a bitmap's density. Where buckets pay, chunked positions cost
    less than Rice gaps and a bitmap (9-14% less on realistic dense updates,
    docs/PERFORMANCE.md), and the level-1 encode would double the work."""
    numel = base_flat.numel()
    base_np = to_numpy(base_flat).view(info.unsigned)
    scanned = chunked.scan(walker, base_np, to_numpy(new_flat).view(info.unsigned), info)
    changed = scanned.where.size
    if changed == 0:
        return Encoded("same", 0)
    if on_changes is not None:
        on_changes(scanned.where, scanned.diff, scanned.old)
    found = chunked.encode(walker, base_np, scanned)
    best = Encoded("chunked", changed, found.streams, found.params)
    bucketed = bool(found.params["bounds"])
    if (
        3 * int(found.params["big"]) > changed
        or changed >= numel * DENSE_MIN_DENSITY
        or (not bucketed and changed >= numel * BITMAP_MIN_DENSITY)
    ):
        other = encode_tensor(base_flat, new_flat, info, 1)
        if other.nbytes < best.nbytes:
            best = other
    return best


_SPARSE_ROLES = ("unary", "fixed", "sign", "big_unary", "big_fixed", "mags")
_workspaces = threading.local()


def _workspace(numel: int, dtype: np.dtype[Any]) -> tuple[npt.NDArray[Any], ...]:
    """Per-thread buffers for fused.encode_sparse, big enough for ``numel``
    elements of ``dtype`` and reused (the kernel reads their sizes as capacities):
    positions, differences, base contents, large-magnitude indices, magnitudes,
    streams, planes."""
    cache: dict[str, tuple[int, tuple[npt.NDArray[Any], ...]]] | None = getattr(
        _workspaces, "cache", None
    )
    if cache is None:
        cache = _workspaces.cache = {}
    held = cache.get(dtype.str)
    if held is not None and held[0] >= numel:
        return held[1]
    numel = max(numel, 1 << 16)
    capacity = _scan_capacity(numel)
    buffers = (
        np.empty(capacity, np.int64),
        np.empty(capacity, dtype),
        np.empty(capacity, dtype),
        np.empty(capacity, np.int64),
        np.empty(capacity, dtype),
        np.empty(numel // 8 + 1024, np.uint8),
        np.empty(capacity * dtype.itemsize, np.uint8),
    )
    cache[dtype.str] = (numel, buffers)
    return buffers


def _encode_sparse_compiled(
    compiled: Any,
    base: AnyUInt,
    new: AnyUInt,
    helpers: Helpers | None = None,
    on_changes: OnChanges | None = None,
) -> tuple[Encoded | None, Scanned, bool]:
    """The common case (few changes, mostly +-1 units in the last place) in one
    compiled call (fused.encode_sparse): the same bytes as the general path,
    without its per-stream Python and compiled-call overhead. Otherwise None and
    the scan's buffers, count and resume point. With ``helpers``, a large tensor is
    scanned in pieces first, then its positions, its contents and ``on_changes``
    run side by side (_code_split). The flag: ``on_changes`` was called (only then;
    the caller calls it otherwise)."""
    buffers = _workspace(base.size, base.dtype)
    split = None
    if helpers is not None and base.size >= SPLIT_SCAN_ELEMENTS:
        split = _scan_in_pieces(compiled, base, new, buffers[:3], helpers)
    hooked = False
    if split is None:
        result = compiled.encode_sparse(base, new, *buffers)
    else:
        assert helpers is not None
        result, hooked = _code_split(compiled, base, buffers, split, helpers, on_changes)
    status, changed, resume, param = result[:4]
    scanned = (buffers[0], buffers[1], buffers[2], changed, resume)
    if status != fused.DONE:
        return None, scanned, hooked
    nbig, big_param = result[7], result[8]
    head = result[4] + result[5] + result[6] + result[9] + result[10]
    mags = contents.compress(buffers[6][: nbig * base.itemsize]) if nbig else np.zeros(0, np.uint8)
    blob = np.empty(head + mags.size, np.uint8)
    blob[:head] = buffers[5][:head]
    blob[head:] = mags
    streams: dict[str, U8] = {}
    offset = 0
    for role, size in zip(_SPARSE_ROLES, (*result[4:7], *result[9:11], mags.size), strict=True):
        streams[role] = blob[offset : offset + size]
        offset += size
    params = {"rice": param, "contents": "signmag", "big": nbig, "big_rice": big_param}
    return Encoded("sparse", changed, streams, params, blob), scanned, hooked


def _code_split(
    compiled: Any,
    base: AnyUInt,
    buffers: tuple[npt.NDArray[Any], ...],
    split: tuple[int, int],
    helpers: Helpers,
    on_changes: OnChanges | None,
) -> tuple[tuple[int, ...], bool]:
    """fused.encode_scanned's result for the finished split scan ``split`` (changes,
    elements), its steps side by side: the Rice-coded positions, the contents, and
    ``on_changes`` (which then needs no thread of its own after the coding). The
    flag: ``on_changes`` was called."""
    pos, diff, old, big, mags, out, planes = buffers
    changed, resume = split
    nothing = (fused.FALLBACK, changed, resume, 0, 0, 0, 0, 0, 0, 0, 0)
    param, unary_n, fixed_n = compiled.sparse_plan(base.size, pos, changed, resume, out.size)
    if param < 0:
        return nothing, False
    sign_at = unary_n + fixed_n
    coded: list[tuple[bool, int, int, int, int]] = []

    def code_contents() -> None:
        coded.append(
            compiled.sparse_contents(diff, changed, base.itemsize, big, mags, out, sign_at, planes)
        )

    def code_positions() -> None:
        compiled.rice_write(pos, changed, param, out, 0, unary_n)

    tasks = [code_contents]  # the longest first
    if on_changes is not None:
        hook = on_changes
        tasks.append(lambda: hook(pos[:changed], diff[:changed], old[:changed]))
    tasks.append(code_positions)
    _share(tasks, helpers)
    done, nbig, big_param, big_unary_n, big_fixed_n = coded[0]
    if not done:
        return nothing, on_changes is not None
    sign_n = (changed + 7) >> 3
    result = (fused.DONE, changed, resume, param, unary_n, fixed_n, sign_n, nbig, big_param)
    return (*result, big_unary_n, big_fixed_n), on_changes is not None


def _share(tasks: list[Callable[[], None]], helpers: Helpers) -> None:
    """Run each of ``tasks`` once, taken in order by this thread and by ``helpers``
    that are free: work queued behind busy threads finds nothing left and returns,
    so this thread never waits on a task nobody started. Returns when every task is
    done; the first error is raised here."""
    claims = itertools.count()
    errors: list[BaseException] = []
    lock = threading.Lock()
    left = [len(tasks)]
    finished = threading.Event()

    def work() -> None:
        while (r := next(claims)) < len(tasks):
            try:
                tasks[r]()
            except BaseException as e:  # re-raised by the thread that waits
                errors.append(e)
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        finished.set()

    for _ in range(min(len(tasks) - 1, helpers.threads)):
        helpers.submit(work)
    work()
    finished.wait()
    if errors:
        raise errors[0]


def _scan_in_pieces(
    compiled: Any,
    base: AnyUInt,
    new: AnyUInt,
    outs: tuple[npt.NDArray[Any], ...],
    helpers: Helpers,
) -> tuple[int, int] | None:
    """fused.scan_diffs over pieces of SPLIT_PIECE_ELEMENTS, shared with ``helpers``
    (_share). Each piece writes its changes into its own share of ``outs``
    (positions, differences, base contents: one slot per SCAN_SHARE elements); they
    are then moved together. (changes, n) as scan_diffs returns them, or None when a
    piece held more changes than its share (the caller scans the tensor on one
    thread instead)."""
    pos, diff, old = outs
    n = base.size
    bounds = [*range(0, n, SPLIT_PIECE_ELEMENTS), n]
    pieces = len(bounds) - 1
    found = [(0, 0)] * pieces

    def scan(r: int) -> None:
        start, stop = bounds[r], bounds[r + 1]
        lo = start // SCAN_SHARE
        hi = stop // SCAN_SHARE if r + 1 < pieces else pos.size
        # From ``start`` (a multiple of 64) of the tensor's prefix: positions come out
        # as the tensor's, with no second pass to shift them.
        found[r] = compiled.scan_diffs(
            base[:stop], new[:stop], pos[lo:hi], diff[lo:hi], old[lo:hi], start
        )

    _share([functools.partial(scan, r) for r in range(pieces)], helpers)
    total = 0
    for r, (k, at) in enumerate(found):
        if at < bounds[r + 1]:
            return None
        lo = bounds[r] // SCAN_SHARE
        if lo != total:  # moved down: never past a piece not yet moved
            pos[total : total + k] = pos[lo : lo + k]
            diff[total : total + k] = diff[lo : lo + k]
            old[total : total + k] = old[lo : lo + k]
        total += k
    return total, n


def decode_tensor(
    encoding: str,
    changed: int,
    streams: dict[str, U8],
    params: dict[str, Any],
    *,
    base_flat: torch.Tensor,
    info: DtypeInfo,
) -> tuple[I64, AnyUInt]:
    """(positions, new contents as unsigned integers) of the changed elements."""
    numel = base_flat.numel()
    unsigned = info.unsigned
    on_cpu = base_flat.device.type == "cpu"
    try:
        if encoding == "same":
            return np.zeros(0, np.int64), np.zeros(0, unsigned)
        if encoding == "dense":
            where, diff = _dense_differences(streams, changed, numel, unsigned)
        else:
            if on_cpu and walk_applies(encoding, params, info):
                base_np = base_flat.numpy().view(unsigned)
                where, new, _ = walk_sparse(
                    fused.get(), streams, params, changed, base_np, info, fused.DECODE
                )
                return where, new
            if encoding == "sparse":
                where = positions.decode_sparse(streams, params, changed, numel)
            else:
                where = positions.decode_bitmap(streams, changed, numel)
            if where.size and int(where[-1]) >= numel:
                raise DamagedStreamError(
                    f"position {int(where[-1])} is out of range for {numel} elements"
                )
            if on_cpu and params["contents"] == "signmag" and info.width <= 4:
                # Differences and base in one pass, without materialising either.
                signs, big, mags = contents.signmag_parts(streams, params, changed, unsigned)
                out = np.empty(changed, unsigned)
                top = (1 << (8 * info.width)) - 1
                base_np = base_flat.numpy().view(unsigned)
                if kernels.get().signmag_values(signs, big, mags, base_np, where, out, top) < 0:
                    raise DamagedStreamError(
                        "contents hold a zero difference for a changed element"
                    )
                return where, out
            diff = contents.decode_contents(streams, params, changed, unsigned)
    except (positions.PositionsError, contents.ContentsError) as exc:
        raise DamagedStreamError(str(exc)) from None
    if on_cpu:
        out = np.empty(where.size, unsigned)
        kernels.get().gather_add(base_flat.numpy().view(unsigned), where, diff, out)
        return where, out
    base_vals = to_numpy(base_flat[torch.from_numpy(where).to(base_flat.device)]).view(unsigned)
    return where, base_vals + diff


def _dense_differences(
    streams: dict[str, U8], changed: int, numel: int, unsigned: type[np.unsignedinteger]
) -> tuple[I64, AnyUInt]:
    """(positions, differences) of a ``dense`` record: every element's zigzagged
    difference, the nonzero ones counted against the record."""
    diff = contents.unzigzag(contents.decode_planes(streams["values"], numel, unsigned))
    where = np.flatnonzero(diff).astype(np.int64)
    if where.size != changed:
        raise DamagedStreamError(f"contents change {where.size} elements, record says {changed}")
    return where, diff[where]


def decode_differences(
    encoding: str,
    changed: int,
    streams: dict[str, U8],
    params: dict[str, Any],
    numel: int,
    info: DtypeInfo,
) -> tuple[I64, AnyUInt] | None:
    """(positions, new - base modulo the element width, unsigned) of the changed
    elements, from the streams alone: the base is not read. None for ``chunked``,
    whose positions depend on the base's contents."""
    unsigned = info.unsigned
    try:
        if encoding == "same":
            return np.zeros(0, np.int64), np.zeros(0, unsigned)
        if encoding == "dense":
            return _dense_differences(streams, changed, numel, unsigned)
        if encoding == "sparse":
            where = positions.decode_sparse(streams, params, changed, numel)
        elif encoding == "bitmap":
            where = positions.decode_bitmap(streams, changed, numel)
        else:
            return None
        if where.size and (int(where[0]) < 0 or int(where[-1]) >= numel):
            raise DamagedStreamError(f"a position is out of range for {numel} elements")
        return where, contents.decode_contents(streams, params, changed, unsigned)
    except (positions.PositionsError, contents.ContentsError) as exc:
        raise DamagedStreamError(str(exc)) from None


def walk_applies(encoding: str, params: dict[str, Any], info: DtypeInfo) -> bool:
    """Whether ``walk_sparse`` handles a record (the common case: sparse positions,
    either contents)."""
    return encoding == "sparse" and params.get("contents") in contents.METHODS and info.width <= 4


def walk_sparse(
    walker: Any,
    streams: dict[str, U8],
    params: dict[str, Any],
    changed: int,
    target: AnyUInt,
    info: DtypeInfo,
    mode: int,
    *,
    record: bool = True,
) -> tuple[I64, AnyUInt, AnyUInt]:
    """Positions and contents of a sparse record (either contents) in one pass over
    ``target`` (the base; fused.APPLY writes the new contents into it and returns
    the old ones, fused.CONFIRM too, reading each batch back: ReadBackError, what
    was written walked back, if one differs; fused.DECODE returns the new ones,
    fused.GATHER the new ones and, third, the old ones; the third is empty
    otherwise). Damaged streams raise DamagedStreamError with ``target`` unchanged."""
    unsigned = info.unsigned
    unary, fixed, param = streams["unary"], streams["fixed"], int(params["rice"])
    # The walk reads these unchecked: their sizes must be what the counts say.
    if fixed.size != rice.fixed_nbytes(changed, param):
        raise DamagedStreamError("position stream has the wrong size")
    zigzag = params["contents"] == "planes"
    if zigzag:
        signs: U8 = np.zeros(0, np.uint8)
        big_ends = np.array([changed], np.int64)  # the sentinel alone
        raw = contents.decompress(streams["values"], changed * info.width)
        if raw is None:
            raise DamagedStreamError("contents frame does not decompress to the recorded size")
        planes: U8 = np.frombuffer(raw, np.uint8)
    else:
        signs, planes = streams["sign"], np.zeros(0, np.uint8)
        if signs.size != (changed + 7) // 8:
            raise DamagedStreamError("sign stream has the wrong size")
        nbig, big_param = int(params["big"]), int(params["big_rice"])
        # Indices of large magnitudes, then a sentinel that keeps the walk off their end.
        big_ends = np.empty(nbig + 1, np.int64)
        big = rice.decode_positions(
            streams["big_unary"], streams["big_fixed"], nbig, big_param, changed, big_ends[:nbig]
        )
        if big is None:
            raise DamagedStreamError("large-difference streams do not hold the recorded count")
        big_ends[nbig] = changed
        if nbig:
            raw = contents.decompress(streams["mags"], nbig * info.width)
            if raw is None:
                raise DamagedStreamError("contents frame does not decompress to the recorded size")
            planes = np.frombuffer(raw, np.uint8)
    size = changed if record else 0
    out_pos = np.empty(size, np.int64)
    out_val = np.empty(size, unsigned)
    out_old = np.empty(size if mode == fused.GATHER else 0, unsigned)
    done, status = walker.walk_sparse(
        unary,
        fixed,
        param,
        changed,
        signs,
        big_ends,
        planes,
        zigzag,
        target,
        mode,
        out_pos,
        out_val,
        out_old,
    )
    if status != fused.DONE:
        if mode in (fused.APPLY, fused.CONFIRM) and done:
            empty_pos, empty_val = np.empty(0, np.int64), np.empty(0, unsigned)
            walker.walk_sparse(
                unary,
                fixed,
                param,
                done,
                signs,
                big_ends,
                planes,
                zigzag,
                target,
                fused.UNDO,
                empty_pos,
                empty_val,
                empty_val,
            )
        reason = _walk_status(status, target.size)
        raise ReadBackError(reason) if status == fused.BAD_READBACK else DamagedStreamError(reason)
    return out_pos, out_val, out_old


@dataclass(frozen=True)
class RecordWalk:
    """One sparse record for :func:`walk_records`: its streams back to back (role
    order), their sizes, its params and count, and its target's memory (``address``
    of ``size`` elements of the walk's dtype; only read)."""

    blob: U8
    sizes: tuple[int, ...]
    params: dict[str, Any]
    changed: int
    address: int
    size: int


def _walk_status(status: int, size: int) -> str:
    """The reason a compiled walk over ``size`` elements stopped with ``status``."""
    if status == fused.BAD_READBACK:
        return "a written position, read back, does not hold its new contents"
    if status == fused.BAD_POSITION:
        return f"a position is out of range for {size} elements"
    if status == fused.BAD_CONTENTS:
        return "contents hold a zero difference for a changed element"
    if status == fused.BAD_BIG:
        return "large-difference streams do not hold the recorded count"
    return "position streams do not hold the recorded gaps"


def _walk_row(
    walk: RecordWalk, width: int, at: int, planes_at: int, out: int, bigs: int
) -> tuple[tuple[int, ...], bytes]:
    """(the table row, the decompressed contents) of one record; DamagedStreamError
    with walk_sparse's reasons where its sizes or contents frame are wrong."""
    changed, sizes, params = walk.changed, walk.sizes, walk.params
    param = int(params["rice"])
    if sizes[1] != rice.fixed_nbytes(changed, param):
        raise DamagedStreamError("position stream has the wrong size")
    values = walk.blob[sizes[0] + sizes[1] :]
    row: tuple[int, ...]
    if params["contents"] == "planes":
        raw = contents.decompress(values, changed * width)
        if raw is None:
            raise DamagedStreamError("contents frame does not decompress to the recorded size")
        row = (at, sizes[0], sizes[1], 0, 0, 0, changed, param, 1, 0, 0)
    else:
        if sizes[2] != (changed + 7) // 8:
            raise DamagedStreamError("sign stream has the wrong size")
        nbig = int(params["big"])
        raw = b""
        if nbig:
            found = contents.decompress(values[sizes[2] + sizes[3] + sizes[4] :], nbig * width)
            if found is None:
                raise DamagedStreamError("contents frame does not decompress to the recorded size")
            raw = found
        row = (at, *sizes[:5], changed, param, 0, nbig, int(params["big_rice"]))
    return (*row, planes_at, len(raw), out, bigs, walk.address, walk.size), raw


WalkFailure = tuple[int, int, str]  # (record index, fused.BAD_*, reason)


def walk_records(
    walker: Any, walks: list[RecordWalk], info: DtypeInfo, mode: int
) -> tuple[I64, AnyUInt, AnyUInt, I64, WalkFailure | None]:
    """:func:`walk_sparse` of many sparse records of one dtype (``walk_applies``) in
    one compiled call. Python then stays per call, not per record: what a model of
    many small tensors (MoE experts, norms) spends most of its apply on otherwise.

    Returns (positions, values, old contents, bounds, failure): record k's outputs
    are ``[bounds[k], bounds[k + 1])`` of the first three, which are laid out as
    :func:`walk_sparse` returns them (old contents for GATHER only; nothing for
    fused.APPLY and CONFIRM, which write into the targets). ``failure`` is None, or
    (index, fused.BAD_*, reason) of the first record whose streams are damaged (or,
    CONFIRM, whose write did not read back): records before it are done, none after
    it is, and it was walked back (a writing mode)."""
    if mode not in (fused.DECODE, fused.DIFFS, fused.GATHER, fused.APPLY, fused.CONFIRM):
        raise ValueError(f"walk_records: mode {mode} is not one of its modes")
    writes = mode in (fused.APPLY, fused.CONFIRM)
    width = info.width
    rows: list[tuple[int, ...]] = []
    blobs: list[U8] = []
    raws: list[bytes] = []
    bounds = [0]
    failure: WalkFailure | None = None
    at = planes_at = bigs = 0
    for index, walk in enumerate(walks):
        try:
            row, raw = _walk_row(walk, width, at, planes_at, bounds[-1], bigs)
        except DamagedStreamError as exc:
            failure = (index, fused.BAD_UNARY, str(exc))
            break
        rows.append(row)
        blobs.append(walk.blob)
        raws.append(raw)
        at += walk.blob.size
        planes_at += len(raw)
        bigs += row[9] + 1
        bounds.append(bounds[-1] + (0 if writes else walk.changed))
    total = bounds[-1]
    out_pos = np.empty(total, np.int64)
    out_val = np.empty(total, info.unsigned)
    out_old = np.empty(total if mode == fused.GATHER else 0, info.unsigned)
    if rows:
        table = np.array(rows, np.int64)
        streams = np.concatenate(blobs) if len(blobs) > 1 else np.ascontiguousarray(blobs[0])
        planes = np.frombuffer(b"".join(raws), np.uint8) if planes_at else np.zeros(0, np.uint8)
        done, status = walker.walk_records(
            streams,
            planes,
            table,
            np.zeros(0, info.unsigned),
            mode,
            out_pos,
            out_val,
            out_old,
            np.empty(bigs, np.int64),
        )
        if status != fused.DONE:
            failure = (int(done), int(status), _walk_status(int(status), walks[int(done)].size))
            bounds = bounds[: int(done) + 1]
    return out_pos, out_val, out_old, np.array(bounds, np.int64), failure
