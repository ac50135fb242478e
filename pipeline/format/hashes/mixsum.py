"""mixsum-128: a content hash a replica can update from the changed elements alone.

For a tensor whose elements, as unsigned integers of their width, are ``b_i`` at
flat position ``i``:

    H = (sum_i A(i, b_i) mod 2^64, sum_i B(i, b_i) mod 2^64)

with ``s = splitmix(i ^ k0)`` (a bijection of the position), ``A = murmur(s ^ b ^ k1)``
and ``B = splitmix(rotl(s, 29) + b * k3 + k2)``: two keyed 64-bit mixes whose
finalisers differ. So:

- ``H(new) = H(old) + sum over changed i of [f(i, new_i) - f(i, old_i)]``: a delta's
  effect needs the changed elements only;
- the sums split across threads or GPU blocks in any order;
- for a fixed position each lane is a bijection of the bits, so any change of ONE
  element changes both lanes (a flipped bit is always caught); several changes
  cancel only if 128 pseudo-random bits happen to sum to zero.

It is not a MAC: anyone can forge a collision. The security boundary is the
objects' sha256 and the signed manifest; this hash proves that held memory matches.

Computed by compiled loops on CPU threads (numba), or by torch ops on the tensor's
own device (a GPU hashes its weights without a host copy); both give the same
digest, which is ``"%016x%016x" % (lane A, lane B)``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline import cpus
from pipeline.errors import CorruptObjectError
from pipeline.format.hashes.mixsum_keys import KEYS
from pipeline.format.tensors import UNSIGNED

NAME = "mixsum-128"
_MASK = (1 << 64) - 1
_SIGNED_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_SIGNED_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_INTS = frozenset(_SIGNED_VIEW.values()) | {torch.int8}
# Elements per thread task at most (balances a large tensor's tasks) and at least (a
# task's hand-off costs microseconds), and per torch-ops step (bounds the int64
# temporaries).
CPU_CHUNK = 1 << 22
MIN_TASK = 1 << 18
TORCH_CHUNK = 1 << 23
THREADS = max(1, min(8, cpus.available()))

# Tests switch this off to compare the torch-ops path with the compiled one.
COMPILED = True


@functools.cache
def _jit() -> Any | None:
    if importlib.util.find_spec("numba") is None:
        return None
    return importlib.import_module("pipeline.format.hashes.mixsum_jit")


def compiled() -> Any | None:
    """The compiled loops, or None (torch ops serve)."""
    return _jit() if COMPILED else None


_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="deltasync-mixsum")
    return _pool


def task_elements(size: int) -> int:
    """Elements per thread task for ``size`` elements: spread over every thread, each
    task MIN_TASK to CPU_CHUNK elements. (Tasks of CPU_CHUNK alone left a model's
    usual 0.8-4.4M-element tensors on one thread, docs/PERFORMANCE.md.)"""
    return min(CPU_CHUNK, max(MIN_TASK, -(-size // THREADS)))


# ---------------------------------------------------------------- digests


def digest(lanes: tuple[int, int]) -> str:
    return f"{lanes[0] & _MASK:016x}{lanes[1] & _MASK:016x}"


def lanes_of(hexdigest: str) -> tuple[int, int]:
    if len(hexdigest) != 32:
        raise ValueError(f"not a {NAME} digest: {hexdigest!r}")
    return int(hexdigest[:16], 16), int(hexdigest[16:], 16)


def add(hexdigest: str, lanes: tuple[int, int]) -> str:
    """``hexdigest`` plus lane sums (modulo 2^64 each)."""
    a, b = lanes_of(hexdigest)
    return digest((a + lanes[0], b + lanes[1]))


def total(digests: Sequence[str]) -> str:
    """The digest of a tensor from those of pieces covering it once (lane-wise sums)."""
    a = b = 0
    for d in digests:
        la, lb = lanes_of(d)
        a, b = a + la, b + lb
    return digest((a & _MASK, b & _MASK))


# ---------------------------------------------------------------- integer views


def int_flat(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat integer tensor of the same width, on its device."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8).view(-1)
    return t.view(_SIGNED_VIEW[t.element_size()]).view(-1)


def _unsigned(values: torch.Tensor | npt.NDArray[Any], width: int) -> npt.NDArray[Any]:
    """CPU integer values of ``width`` bytes as a numpy unsigned array (no copy)."""
    if isinstance(values, torch.Tensor):
        # A decoded patch's contents are already flat integers: numpy views them as is.
        flat_ints = values.dtype in _NUMPY_INTS and values.dim() == 1 and values.is_contiguous()
        values = values.numpy() if flat_ints else int_flat(values).numpy()
    return np.ascontiguousarray(values).reshape(-1).view(UNSIGNED[width])


# ---------------------------------------------------------------- torch ops


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_T_S1, _T_S2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_T_M1, _T_M2 = _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)
_T_KEYS = tuple(_signed(k) for k in KEYS)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _T_S1
    x = (x ^ _shr(x, 27)) * _T_S2
    return x ^ _shr(x, 31)


def _murmur(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 33)) * _T_M1
    x = (x ^ _shr(x, 33)) * _T_M2
    return x ^ _shr(x, 33)


def _torch_lanes(i: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lane values (int64 bit patterns) of bits ``b`` at positions ``i`` (both int64)."""
    s = _splitmix(i ^ _T_KEYS[0])
    a = _murmur(s ^ b ^ _T_KEYS[1])
    rot = (s << 29) | _shr(s, 35)
    c = _splitmix(rot + b * _T_KEYS[3] + _T_KEYS[2])
    return a, c


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integer values of ``width`` bytes as int64 holding their unsigned bits."""
    wide = values.to(torch.int64)
    return wide if width == 8 else wide & ((1 << (8 * width)) - 1)


def _torch_sum(lanes: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    # int64 sums wrap like uint64 ones; the result's bits are what count.
    return int(lanes[0].sum()), int(lanes[1].sum())


def torch_full(flat: torch.Tensor, offset: int = 0) -> tuple[int, int]:
    """Lane sums of a flat integer tensor whose first element is at flat position
    ``offset``, by torch ops on its own device."""
    width = flat.element_size()
    total = [0, 0]
    for start in range(0, flat.numel(), TORCH_CHUNK):
        part = flat[start : start + TORCH_CHUNK]
        at = offset + start
        i = torch.arange(at, at + part.numel(), dtype=torch.int64, device=flat.device)
        a, b = _torch_sum(_torch_lanes(i, _widen(part, width)))
        total[0] += a
        total[1] += b
    return total[0] & _MASK, total[1] & _MASK


def torch_change(
    positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, width: int
) -> tuple[int, int]:
    """Lane sums of f(i, new_i) - f(i, old_i), by torch ops on the positions' device."""
    i = positions.to(torch.int64)
    na, nb = _torch_lanes(i, _widen(new, width))
    oa, ob = _torch_lanes(i, _widen(old, width))
    return _torch_sum((na - oa, nb - ob))


# ---------------------------------------------------------------- entry points


def full_lanes(tensor: torch.Tensor, offset: int = 0) -> tuple[int, int]:
    """Lane sums of a whole tensor (its first element at flat position ``offset``):
    compiled loops on CPU threads for a CPU tensor, torch ops on its device otherwise
    (no host copy)."""
    flat = int_flat(tensor)
    jit = compiled()
    if flat.device.type != "cpu" or jit is None:
        return torch_full(flat, offset)
    data = _unsigned(flat.numpy(), flat.element_size())
    step = task_elements(data.size)
    starts = range(0, data.size, step)
    if len(starts) <= 1:
        sums = [jit.full_sum(data, offset)]
    else:
        sums = list(_threads().map(lambda s: jit.full_sum(data[s : s + step], offset + s), starts))
    return (
        sum(int(s[0]) for s in sums) & _MASK,
        sum(int(s[1]) for s in sums) & _MASK,
    )


def torch_runs(flat: torch.Tensor, width: int, starts: npt.NDArray[np.int64]) -> tuple[int, int]:
    """:func:`torch_full` of a piece laid out as runs (see :func:`runs_lanes`)."""
    size = flat.element_size()
    per = max(1, TORCH_CHUNK // width)
    at = torch.from_numpy(starts).to(flat.device)
    inner = torch.arange(width, dtype=torch.int64, device=flat.device)
    total = [0, 0]
    for r in range(0, starts.size, per):
        first = at[r : r + per]
        i = (first[:, None] + inner[None, :]).reshape(-1)
        part = flat[r * width : r * width + i.numel()]
        a, b = _torch_sum(_torch_lanes(i, _widen(part, size)))
        total[0] += a
        total[1] += b
    return total[0] & _MASK, total[1] & _MASK


def runs_lanes(tensor: torch.Tensor, width: int, starts: npt.NDArray[np.int64]) -> tuple[int, int]:
    """Lane sums of a piece of a tensor laid out as runs: its element ``r * width + j``
    at flat position ``starts[r] + j`` of the tensor (a box, pipeline.format.regions)."""
    if starts.size == 1:
        return full_lanes(tensor, int(starts[0]))
    flat = int_flat(tensor)
    if flat.numel() != starts.size * width:
        raise CorruptObjectError(
            f"a piece of {flat.numel()} elements is not {starts.size} runs of {width}"
        )
    jit = compiled()
    if flat.device.type != "cpu" or jit is None:
        return torch_runs(flat, width, starts)
    data = _unsigned(flat.numpy(), flat.element_size())
    per = max(1, task_elements(flat.numel()) // width)
    sums = list(
        _threads().map(
            lambda r: jit.runs_sum(data[r * width : (r + per) * width], starts[r : r + per], width),
            range(0, starts.size, per),
        )
    )
    return (
        sum(int(s[0]) for s in sums) & _MASK,
        sum(int(s[1]) for s in sums) & _MASK,
    )


def full(tensor: torch.Tensor, offset: int = 0) -> str:
    """The mixsum-128 digest of a tensor's bits (dtype and shape are checked apart);
    with ``offset``, of the tensor as a piece starting at that flat position."""
    return digest(full_lanes(tensor, offset))


def change_lanes(
    positions: torch.Tensor | npt.NDArray[np.int64],
    old: torch.Tensor | npt.NDArray[Any],
    new: torch.Tensor | npt.NDArray[Any],
    width: int,
) -> tuple[int, int]:
    """Lane sums of f(i, new_i) - f(i, old_i) over the changed positions (integer
    contents of ``width`` bytes, signed or unsigned views alike), on the device the
    positions are on."""
    if isinstance(positions, torch.Tensor) and positions.device.type != "cpu":
        assert isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
        return torch_change(positions, int_flat(old), int_flat(new), width)
    jit = compiled()
    if jit is None:
        signed = _SIGNED_NP[width]
        return torch_change(
            torch.as_tensor(positions),
            torch.from_numpy(_unsigned(old, width).view(signed)),
            torch.from_numpy(_unsigned(new, width).view(signed)),
            width,
        )
    pos_np = positions.numpy() if isinstance(positions, torch.Tensor) else positions
    out = jit.change_sum(
        np.ascontiguousarray(pos_np, np.int64), _unsigned(old, width), _unsigned(new, width), 0
    )
    return int(out[0]), int(out[1])


def updated(
    held: str,
    positions: torch.Tensor | npt.NDArray[np.int64],
    old: torch.Tensor | npt.NDArray[Any],
    new: torch.Tensor | npt.NDArray[Any],
    width: int,
) -> str:
    """The digest after the elements at ``positions`` change from ``old`` to ``new``,
    from the digest ``held`` before."""
    return add(held, change_lanes(positions, old, new, width))


def updated_many(
    helds: Sequence[str],
    positions: npt.NDArray[np.int64],
    old: npt.NDArray[Any],
    new: npt.NDArray[Any],
    bounds: Sequence[int],
    width: int,
) -> list[str]:
    """:func:`updated` of several tensors whose changes lie back to back in CPU arrays:
    tensor k's digest before is ``helds[k]``, its changes ``[bounds[k], bounds[k + 1])``.
    One compiled call for all of them."""
    jit = compiled()
    if jit is None:
        return [
            updated(held, positions[lo:hi], old[lo:hi], new[lo:hi], width)
            for held, lo, hi in zip(helds, bounds, bounds[1:], strict=False)
        ]
    sums = jit.change_sums(
        np.ascontiguousarray(positions, np.int64),
        _unsigned(old, width),
        _unsigned(new, width),
        np.asarray(bounds, np.int64),
    ).tolist()
    return [add(held, (a, b)) for held, (a, b) in zip(helds, sums, strict=True)]


def gathered_update(
    held: str,
    flat: torch.Tensor,
    positions: npt.NDArray[np.int64],
    diffs: npt.NDArray[Any],
    offset: int = 0,
    runs: tuple[int, npt.NDArray[np.int64]] | None = None,
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(digest after, positions, old contents, new contents) of a change given as
    ``positions`` and ``diffs`` (new - old modulo the width, as from a delta's
    streams) to ``flat`` (:func:`int_flat` of the held tensor, not written), from
    the digest ``held`` before. The held contents are read at the changed positions
    only, once: a compiled pass on CPU, torch ops on the tensor's own device
    otherwise (positions, old and new then live there). CorruptObjectError for a
    position out of range. With ``offset``, ``flat`` is a piece starting at that flat
    position of its tensor: positions index the piece, and are mixed as the tensor's.
    With ``runs`` (width, starts), the piece is a box laid out as runs (see
    :func:`runs_lanes`) and ``offset`` is not used."""
    if runs is not None and runs[1].size == 1:
        offset, runs = int(runs[1][0]), None
    width = flat.element_size()
    signed = _SIGNED_NP[width]
    jit = compiled()
    if flat.device.type == "cpu" and jit is not None:
        data = _unsigned(flat.numpy(), width)
        where = np.ascontiguousarray(positions, np.int64)
        old = np.empty(where.size, data.dtype)
        new = np.empty_like(old)
        if jit.gather(where, data, diffs.view(data.dtype), old, new) < 0:
            raise CorruptObjectError(f"a changed position is out of range for {data.size} elements")
        if runs is not None:  # a box: its changes mixed at their positions in the tensor
            out = jit.change_sum(_mixed(where, data.size, runs), old, new, 0)
        else:
            out = jit.change_sum(where, old, new, offset)
        lanes = (int(out[0]), int(out[1]))
        return (
            add(held, lanes),
            torch.from_numpy(where),
            torch.from_numpy(old.view(signed)),
            torch.from_numpy(new.view(signed)),
        )
    moved = torch.from_numpy(np.ascontiguousarray(positions, np.int64)).to(flat.device)
    if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) >= flat.numel()):
        raise CorruptObjectError(f"a changed position is out of range for {flat.numel()} elements")
    old_t = flat.index_select(0, moved)
    step = torch.from_numpy(np.ascontiguousarray(diffs).view(signed)).to(flat.device)
    new_t = old_t + step  # wraps in the width
    if runs is not None:
        mixed_t = torch.from_numpy(_mixed(moved.cpu().numpy(), flat.numel(), runs))
        lanes = torch_change(mixed_t.to(flat.device), old_t, new_t, width)
    else:
        lanes = torch_change(moved + offset if offset else moved, old_t, new_t, width)
    return add(held, lanes), moved, old_t, new_t


def _mixed(
    where: npt.NDArray[np.int64], size: int, runs: tuple[int, npt.NDArray[np.int64]]
) -> npt.NDArray[np.int64]:
    """Flat tensor positions of a box piece's elements ``where`` (checked in range)."""
    if where.size and (int(where.min()) < 0 or int(where.max()) >= size):
        raise CorruptObjectError(f"a changed position is out of range for {size} elements")
    width, starts = runs
    return np.ascontiguousarray(starts[where // width] + where % width)
