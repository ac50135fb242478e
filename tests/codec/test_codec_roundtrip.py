"""Round trips: apply(decode(encode(base, new)), base) == new, bit for bit."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from pipeline.codec import LEVELS, apply_patch, encode_delta, read_delta
from pipeline.codec.dtypes import BY_DTYPE
from tests import codec_reference

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
SHAPES = [(), (0,), (1,), (3, 0, 2), (7,), (33, 17), (4, 5, 6), (20000,)]
DENSITIES = [0.0, -1.0, 0.01, 0.5, 1.0]  # -1: exactly one element changes


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same width, for bitwise comparison."""
    return t.view(BY_DTYPE[t.dtype].view)


def random_bits(
    shape: tuple[int, ...], dtype: torch.dtype, gen: np.random.Generator
) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, infinities, subnormals, -0.0 included)."""
    width = torch.empty(0, dtype=dtype).element_size()
    raw = gen.integers(0, 256, size=int(np.prod(shape)) * width, dtype=np.uint8)
    t = torch.from_numpy(raw.view(f"<i{width}").copy()).view(BY_DTYPE[dtype].view).reshape(shape)
    if dtype == torch.bool:
        return (t & 1).view(torch.bool)
    return t.view(dtype)


def special_values(
    shape: tuple[int, ...], dtype: torch.dtype, gen: np.random.Generator
) -> torch.Tensor:
    """Floats near the special patterns: +-0.0, +-inf, NaNs with payloads, subnormals."""
    info = BY_DTYPE[dtype]
    base = random_bits(shape, dtype, gen)
    if info.exponent is None or base.numel() == 0:
        return base
    width_bits = info.width * 8
    shift, mask = info.exponent
    top = 1 << (width_bits - 1)
    specials = [
        0,
        top,
        mask << shift,
        (mask << shift) | 1,
        (mask << shift) | ((1 << shift) - 1),
        1,
        top | 1,
    ]
    flat = bits(base).reshape(-1).clone()
    picks = torch.from_numpy(gen.integers(0, len(specials), size=flat.numel()))
    choose = torch.from_numpy(gen.random(flat.numel()) < 0.5)
    table = torch.tensor(
        [s - (1 << width_bits) if s >= top else s for s in specials], dtype=torch.int64
    )
    flat = torch.where(choose, table[picks].to(flat.dtype), flat)
    return flat.view(dtype).reshape(shape)


def realistic_update(base: torch.Tensor, density: float, gen: np.random.Generator) -> torch.Tensor:
    """Change a subset of elements by a few units in the last place (or arbitrary bits)."""
    flat = bits(base).reshape(-1).clone()
    n = flat.numel()
    if n == 0 or density == 0.0:
        return flat.view(base.dtype).reshape(base.shape)
    if density < 0:
        where = torch.zeros(n, dtype=torch.bool)
        where[int(gen.integers(0, n))] = True
    else:
        where = torch.from_numpy(gen.random(n) < density)
    if base.dtype == torch.bool:
        flat = torch.where(where, flat ^ 1, flat)
        return flat.view(torch.bool).reshape(base.shape)
    step = torch.from_numpy(gen.choice([-2, -1, 1, 1, 2, 3, 1000], size=n)).to(flat.dtype)
    flat = torch.where(where, flat + step, flat)
    return flat.view(base.dtype).reshape(base.shape)


def roundtrip(base: torch.Tensor, new: torch.Tensor, level: int) -> None:
    """The compiled codec and the numpy reference (tests/codec_reference.py) write the
    same bytes and read the same changes from them; those make ``new`` of ``base``."""
    data = encode_delta([("t", base, new)], level=level)
    assert codec_reference.encode_delta([("t", base, new)], level=level) == data
    changed = int((bits(base) != bits(new)).sum())
    obj = read_delta(data, object_name="obj")
    patch = obj.decode("t", base)
    assert patch.positions.dtype == torch.int64
    assert bool((patch.positions[1:] > patch.positions[:-1]).all())
    assert obj.info("t").changed == changed == patch.positions.numel()
    where, new_bits = codec_reference.decode(obj, "t", base)
    assert np.array_equal(patch.positions.numpy(), where)
    assert np.array_equal(patch.values.numpy().view(new_bits.dtype), new_bits)
    target = base.clone()
    apply_patch(target, patch)
    assert torch.equal(bits(target), bits(new))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from(SHAPES),
    density=st.sampled_from(DENSITIES),
    level=st.sampled_from(LEVELS),
    special=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_bitwise(
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    density: float,
    level: int,
    special: bool,
    seed: int,
) -> None:
    gen = np.random.default_rng(seed)
    base = special_values(shape, dtype, gen) if special else random_bits(shape, dtype, gen)
    new = realistic_update(base, density, gen)
    roundtrip(base, new, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_arbitrary_bits_to_arbitrary_bits(dtype: torch.dtype, level: int) -> None:
    gen = np.random.default_rng(7)
    base = special_values((257, 3), dtype, gen)
    new = special_values((257, 3), dtype, gen)
    roundtrip(base, new, level)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64])
def test_large_dense_changes_grow_the_scan_buffers(dtype: torch.dtype) -> None:
    gen = np.random.default_rng(3)
    base = random_bits((300_001,), dtype, gen)
    new = realistic_update(base, 0.6, gen)
    roundtrip(base, new, 1)


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_storage(offset: int) -> None:
    gen = np.random.default_rng(4)
    big_base = random_bits((10_000,), torch.bfloat16, gen)
    big_new = realistic_update(big_base, 0.05, gen)
    base, new = big_base[offset:], big_new[offset:]
    assert base.data_ptr() % 8 != 0
    roundtrip(base, new, 1)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64]
)
def test_device_tensors_give_the_cpu_bytes_and_apply_on_the_device(
    device: str, level: int, dtype: torch.dtype
) -> None:
    """Weights on a GPU: the same object bytes as from host tensors, and decode,
    ``apply_patch`` and ``apply_to`` write the new bits on that device."""
    gen = np.random.default_rng(11)
    pairs = []
    for i, (shape, density) in enumerate(
        [((64, 300), 0.02), ((5000,), 0.6), ((7,), -1.0), ((0,), 0.0), ((33, 17), 1.0)]
    ):
        base = special_values(shape, dtype, gen)
        pairs.append((f"t{i}", base, realistic_update(base, density, gen)))
    on_host = encode_delta(pairs, level=level)
    on_device = encode_delta([(n, b.to(device), w.to(device)) for n, b, w in pairs], level=level)
    assert on_device == on_host
    obj = read_delta(on_device, object_name="obj")
    for name, base, new in pairs:
        patched = base.to(device, copy=True)
        apply_patch(patched, obj.decode(name, patched))
        walked = base.to(device, copy=True)
        obj.apply_to(name, walked)
        for got in (patched, walked):
            assert got.device.type == device
            assert torch.equal(bits(got.cpu()), bits(new)), name
