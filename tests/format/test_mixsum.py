"""mixsum-128: incremental updates equal full hashes, every path gives the same digest,
and accidental corruption is caught."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pipeline.format.hashes import mixsum
from pipeline.format.tensors import DTYPES, UNSIGNED

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Bit patterns that a float compare would merge or reorder, per width.
EDGES = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x78, 0xF8, 0x7C, 0x7E, 0x01],
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7C00, 0xFC00, 0x7E01, 0x0001],
    4: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC0BEEF, 1],
    8: [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, (0x7FF0 << 48) | 1, (1 << 64) - 1, 1],
}


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` with the edge patterns (NaN payloads, -0.0, infinities)
    at the front."""
    g = np.random.default_rng(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.from_numpy(g.integers(0, 2, numel).astype(np.bool_))
    raw = g.integers(0, 256, numel * width, dtype=np.uint8)
    bits = raw.view(UNSIGNED[width])
    edges = np.array(EDGES[width], dtype=np.uint64).astype(UNSIGNED[width])
    bits[: min(numel, edges.size)] = edges[: min(numel, edges.size)]
    return torch.from_numpy(bits.view(mixsum._SIGNED_NP[width]).copy()).view(dtype)


def _both_paths(t: torch.Tensor) -> Iterator[str]:
    yield mixsum.full(t)
    mixsum.COMPILED = False
    try:
        yield mixsum.full(t)
    finally:
        mixsum.COMPILED = True


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_incremental_equals_full_on_every_dtype(dtype: torch.dtype) -> None:
    base = _tensor(dtype, 5000, 1)
    new = _tensor(dtype, 5000, 2)
    width = base.element_size()
    g = np.random.default_rng(3)
    positions = np.sort(g.choice(base.numel(), 700, replace=False)).astype(np.int64)
    positions[:5] = np.arange(5)  # the edge patterns change too
    after = mixsum.int_flat(base).clone()
    after[torch.from_numpy(positions)] = mixsum.int_flat(new)[torch.from_numpy(positions)]
    old_v = mixsum.int_flat(base)[torch.from_numpy(positions)]
    new_v = after[torch.from_numpy(positions)]
    want = mixsum.full(after.view(dtype) if dtype != torch.bool else after.bool())
    held = mixsum.full(base)
    assert want != held
    assert mixsum.updated(held, positions, old_v, new_v, width) == want
    assert mixsum.updated(held, torch.from_numpy(positions), old_v.numpy(), new_v, width) == want
    mixsum.COMPILED = False
    try:
        assert mixsum.updated(held, positions, old_v, new_v, width) == want
    finally:
        mixsum.COMPILED = True
    for device in DEVICES[1:]:
        got = mixsum.updated(
            held, torch.from_numpy(positions).to(device), old_v.to(device), new_v.to(device), width
        )
        assert got == want, device


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_torch_ops_equal_compiled(dtype: torch.dtype) -> None:
    t = _tensor(dtype, 3001, 4)
    compiled, ops = _both_paths(t)
    assert compiled == ops
    for device in DEVICES[1:]:
        assert mixsum.full(t.to(device)) == compiled, device


def test_thread_chunks_and_torch_steps_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tensor(torch.bfloat16, 100_003, 5)
    whole = mixsum.full(t)
    monkeypatch.setattr(mixsum, "CPU_CHUNK", 1000)
    monkeypatch.setattr(mixsum, "TORCH_CHUNK", 777)
    compiled, ops = _both_paths(t)
    assert compiled == ops == whole
    # A non-contiguous view hashes as its contiguous copy.
    m = t[:99_997].view(19, 5263)
    assert mixsum.full(m.t()) == mixsum.full(m.t().contiguous())


def test_a_mid_size_tensor_is_spread_over_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mixsum, "THREADS", 4)
    monkeypatch.setattr(mixsum, "MIN_TASK", 1000)
    # 4,003 elements: four tasks of 1,001, none under MIN_TASK nor over CPU_CHUNK.
    assert mixsum.task_elements(4003) == 1001
    assert mixsum.task_elements(1500) == 1000  # two tasks, not four of 375
    assert mixsum.task_elements(10 * mixsum.CPU_CHUNK) == mixsum.CPU_CHUNK
    t = _tensor(torch.bfloat16, 4003, 7)
    spread = mixsum.full(t)
    runs = np.arange(0, 4003 * 3, 3 * 7, dtype=np.int64)[: 4003 // 7]
    piece = t[: runs.size * 7]
    spread_runs = mixsum.runs_lanes(piece, 7, runs)
    monkeypatch.setattr(mixsum, "THREADS", 1)
    monkeypatch.setattr(mixsum, "MIN_TASK", 1 << 30)
    assert mixsum.task_elements(4003) == mixsum.CPU_CHUNK
    assert mixsum.full(t) == spread
    assert mixsum.runs_lanes(piece, 7, runs) == spread_runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_every_flipped_bit_is_caught(dtype: torch.dtype) -> None:
    t = _tensor(dtype, 257, 6)
    want = mixsum.full(t)
    width = t.element_size()
    bits = mixsum.int_flat(t).numpy().view(UNSIGNED[width])
    for element in (0, 3, 256):
        for bit in range(8 * width):
            bad = bits.copy()
            bad[element] ^= UNSIGNED[width](1 << bit)
            assert mixsum.full(torch.from_numpy(bad.view(mixsum._SIGNED_NP[width]))) != want


def test_misplaced_truncated_and_swapped_tensors_are_caught() -> None:
    t = _tensor(torch.bfloat16, 64 * 128, 7).view(64, 128)
    want = mixsum.full(t)
    # A row written one row too far (and the row it hid kept): the same multiset of
    # values at other positions.
    moved = t.clone()
    moved[11] = t[10]
    moved[10] = t[11]
    assert mixsum.full(moved) != want
    shifted = t.clone()
    shifted[5, 1:] = t[5, :-1]
    assert mixsum.full(shifted) != want
    # A rolled tensor: every value at another position.
    assert mixsum.full(torch.roll(t, 1)) != want
    # Truncated, or padded with zeros.
    assert mixsum.full(t.reshape(-1)[:-1]) != want
    assert mixsum.full(torch.cat([t.reshape(-1), torch.zeros(1, dtype=t.dtype)])) != want
    # Two tensors of one shape swapped.
    other = _tensor(torch.bfloat16, 64 * 128, 8).view(64, 128)
    assert mixsum.full(other) != want
    # Zeros at any length differ (the position enters every element).
    zeros = {mixsum.full(torch.zeros(n, dtype=torch.bfloat16)) for n in range(1, 50)}
    assert len(zeros) == 49


def test_digest_round_trip_and_bad_digest() -> None:
    lanes = (0xFFFFFFFFFFFFFFFF, 1)
    assert mixsum.lanes_of(mixsum.digest(lanes)) == lanes
    assert mixsum.add(mixsum.digest(lanes), (1, -1)) == mixsum.digest((0, 0))
    with pytest.raises(ValueError):
        mixsum.lanes_of("abc")


def _changed(base: torch.Tensor, density: float, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """A copy of ``base`` with ``density`` of its elements changed, the edge patterns
    at the front among them (each replaced by the next edge); (new, positions)."""
    g = np.random.default_rng(seed)
    flat = mixsum.int_flat(base)
    count = max(16, round(density * flat.numel()))
    where = np.union1d(np.arange(9), g.choice(flat.numel(), min(count, flat.numel()), False))
    after = flat.clone()
    other = mixsum.int_flat(_tensor(base.dtype, flat.numel(), seed + 1))
    after[torch.from_numpy(where)] = other[torch.from_numpy(where)]
    after[:9] = torch.roll(flat[:9], 1)  # edges into other edges
    moved = np.flatnonzero((after != flat).numpy()).astype(np.int64)
    new = after.bool() if base.dtype == torch.bool else after.view(base.dtype)
    return new, moved


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_gathered_update_from_a_delta_equals_the_full_hash(dtype: torch.dtype) -> None:
    """What a replica and the diff worker do: positions and differences from a delta's
    streams (every encoding: sparse, bitmap, dense), the old contents gathered at
    those positions, the hash updated; on compiled, torch-ops and CUDA paths."""
    from pipeline.codec import encode_delta, read_delta
    from pipeline.codec.dtypes import info_for
    from pipeline.errors import CodecError

    try:
        info_for(dtype, "t")
    except CodecError:
        pytest.skip(f"the codec does not carry {dtype}")
    encodings = set()
    for density in (0.005, 0.05, 0.4, 1.0, None):
        base = _tensor(dtype, 6000, 11)
        if density is None:  # every other element of a run: a bitmap of positions
            bits = mixsum.int_flat(base).clone()
            bits[1000:3000:2] ^= 1
            new = bits.bool() if dtype == torch.bool else bits.view(dtype)
            moved = np.arange(1000, 3000, 2, dtype=np.int64)
        else:
            new, moved = _changed(base, density, 12)
        held = mixsum.full(base)
        want = mixsum.full(new)
        delta = read_delta(encode_delta([("t", base, new)], 1))
        encodings.add(delta.info("t").encoding)
        found = delta.differences("t", base)
        assert found is not None
        assert np.array_equal(found[0], moved)
        for device in DEVICES:
            for compiled in (True, False):
                mixsum.COMPILED = compiled
                try:
                    flat = mixsum.int_flat(base.to(device))
                    digest, where, old, after = mixsum.gathered_update(held, flat, *found)
                finally:
                    mixsum.COMPILED = True
                assert digest == want, (density, device, compiled)
                assert torch.equal(where.cpu(), torch.from_numpy(moved))
                assert torch.equal(old.cpu(), mixsum.int_flat(base)[where.cpu()])
                assert torch.equal(after.cpu(), mixsum.int_flat(new)[where.cpu()])
    if dtype != torch.bool:  # (bool's contents are too small for dense to win)
        assert encodings == {"sparse", "bitmap", "dense"}, encodings


def test_gathered_update_refuses_a_position_out_of_range() -> None:
    from pipeline.errors import CorruptObjectError

    base = _tensor(torch.bfloat16, 100, 13)
    held = mixsum.full(base)
    for bad in (np.array([3, 100], np.int64), np.array([-1], np.int64)):
        diffs = np.ones(bad.size, np.uint16)
        for compiled in (True, False):
            mixsum.COMPILED = compiled
            try:
                with pytest.raises(CorruptObjectError, match="out of range"):
                    mixsum.gathered_update(held, mixsum.int_flat(base), bad, diffs)
            finally:
                mixsum.COMPILED = True
