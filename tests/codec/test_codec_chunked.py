"""Level 3 (``chunked``): pinned bytes, bit-exact round trips of every dtype on the
compiled walk, its threads and the torch-ops decoder, and hostile streams."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.codec import encode_delta, read_delta, tensorcodec
from pipeline.codec.container import read_container
from pipeline.codec.dtypes import BY_DTYPE
from pipeline.codec.level3 import chunked, chunked_torch
from pipeline.errors import DeltasyncError
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from tests import codec_reference
from tests.codec.test_codec_errors import rebuild
from tests.codec.test_codec_fused import pinned_pairs
from tests.codec.test_codec_roundtrip import DTYPES, bits, realistic_update

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

# sha256 of the level-3 object written for pinned_pairs(); moved on 2026-12-06 with
# level 1's contents rule (test_codec_fused.PINNED_TWO_THIRDS has the one before).
PINNED_LEVEL_3 = "c7f72fa267fadef8285afacbaef2a5c754472822ec624741b0258773aa688595"


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chunks of 4096 elements, so small tensors span many chunks."""
    monkeypatch.setattr(chunked, "CHUNK_LOG2", 12)
    yield


def weights(numel: int, gen: np.random.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Weights whose magnitudes spread over many exponents (normal values)."""
    if dtype.is_floating_point:
        values = torch.from_numpy(gen.standard_normal(numel) * 0.05).to(torch.float32)
        return values.to(dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(gen.integers(0, 256, size=numel * width).astype(np.uint8))
    return raw.view(dtype) if dtype != torch.bool else (raw & 1).view(torch.bool)


def conditioned_update(
    base: torch.Tensor,
    gen: np.random.Generator,
    steps: tuple[int, ...] = (-1, 1, -1, 1, -1, 1, 2, -3, 400),
) -> torch.Tensor:
    """Small values change far more often than large ones, as under a small learning
    rate; a few differences are large (one in three of the default ``steps``)."""
    flat = bits(base).reshape(-1)
    magnitude = base.float().abs().reshape(-1).numpy()
    chance = np.where(magnitude < 0.01, 0.3, np.where(magnitude < 0.05, 0.03, 0.002))
    where = torch.from_numpy(gen.random(flat.numel()) < chance)
    step = torch.from_numpy(gen.choice(np.array(steps), size=flat.numel()))
    new = torch.where(where, flat + step.to(flat.dtype), flat)
    return new.view(base.dtype).reshape(base.shape)


def check_object(data: bytes, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Every decoder reproduces ``new`` bit for bit: the compiled walk (decode, gather,
    apply on 1, 2 and 4 threads) and the torch operations."""
    obj = read_delta(data, object_name="t")
    for name, base, new in pairs:
        expected = torch.nonzero(bits(base).reshape(-1) != bits(new).reshape(-1)).view(-1)
        patch = obj.decode(name, base)
        assert torch.equal(patch.positions, expected)
        assert torch.equal(patch.values, bits(new).reshape(-1)[expected])
        # The reference: level-1 records in numpy, chunked ones by the torch decoder.
        where, new_bits = codec_reference.decode(obj, name, base)
        assert np.array_equal(where, expected.numpy())
        want = bits(new).reshape(-1)[expected].numpy()
        assert np.array_equal(new_bits, want.view(new_bits.dtype))
        # A replica's proof: positions, new and old contents from the one decode,
        # the held tensor read and left as it was.
        held = base.clone()
        found = obj.gathered(name, held)
        assert found is not None or obj._records[name].encoding != "chunked"
        if found is not None:
            assert torch.equal(bits(held), bits(base))
            assert torch.equal(found[0], expected)
            assert torch.equal(found[1], bits(new).reshape(-1)[expected])
            assert torch.equal(found[2], bits(base).reshape(-1)[expected])
        for threads in (1, 2, 4):
            saved = chunked.DECODE_THREADS
            chunked.DECODE_THREADS = threads
            try:
                target = base.clone()
                obj.apply_to(name, target)
            finally:
                chunked.DECODE_THREADS = saved
            assert torch.equal(bits(target), bits(new))


def test_level_3_is_pinned() -> None:
    pairs = pinned_pairs()
    data = encode_delta(pairs, level=3)
    check_object(data, pairs)
    assert hashlib.sha256(data).hexdigest() == PINNED_LEVEL_3
    records = json.loads(read_container(data, "pinned").metadata["tensors"])
    assert "chunked" in {r[3] for r in records}  # compact records: arrays


def test_large_tensor_is_pinned_with_buckets_and_chunks() -> None:
    gen = np.random.default_rng(5)
    base = weights(3 << 20 | 77, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    data = encode_delta([("big", base, new)], level=3)
    obj = read_delta(data)
    record = obj._records["big"]
    assert record.encoding == "chunked" and record.layout is not None
    assert record.layout.groups > 1 and record.layout.table.shape[0] == 4
    check_object(data, [("big", base, new)])
    assert hashlib.sha256(data).hexdigest() == PINNED_LARGE


PINNED_LARGE = "4ed06791074da56477a755c45c378450ad3f946b47d82dd3878935b0e996f1ef"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["one", "realistic", "conditioned", "dense"])
def test_every_dtype_round_trips(small_chunks: None, dtype: torch.dtype, kind: str) -> None:
    gen = np.random.default_rng(DTYPES.index(dtype) * 7 + len(kind))
    base = weights(20_011, gen, dtype)
    if kind == "one":
        new = realistic_update(base, -1.0, gen)
    elif kind == "realistic":
        new = realistic_update(base, 0.02, gen)
    elif kind == "dense":
        new = realistic_update(base, 0.5, gen)
    else:
        new = conditioned_update(base, gen) if dtype.is_floating_point else base
    pairs = [("w", base, new), ("empty", base[:0], new[:0]), ("tail", base[:70], new[:70])]
    check_object(encode_delta(pairs, level=3), pairs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_long_unary_codes(dtype: torch.dtype) -> None:
    """A run of changes then one far away: Rice parameter 0 and a quotient of
    about a million zero bits, longer than any word the walk reads at once."""
    gen = np.random.default_rng(2)
    base = weights((1 << 20) + 1000, gen, dtype)
    flat = bits(base).reshape(-1).clone()
    where = torch.tensor([*range(0, 300), 1_000_000, (1 << 20) + 999])
    flat[where] += 1
    new = flat.view(dtype).reshape(base.shape)
    check_object(encode_delta([("w", base, new)], level=3), [("w", base, new)])


@pytest.mark.parametrize("kind", ["uniform", "large", "conditioned"])
def test_level_3_is_never_larger_than_level_1(kind: str) -> None:
    """Level 3 tries level 1 only where that can be smaller: changes the buckets do
    not tell apart at a bitmap's density, differences mostly above one unit. Where
    buckets pay, the chunked record stands and is smaller."""
    gen = np.random.default_rng(len(kind))
    base = weights(1 << 18, gen, torch.bfloat16)
    flat = bits(base).reshape(-1)
    if kind == "conditioned":
        size = base.float().abs().reshape(-1).numpy()
        where = torch.from_numpy(gen.random(flat.numel()) < np.where(size < 0.02, 0.4, 0.02))
        step = torch.ones_like(flat)
    else:
        where = torch.from_numpy(gen.random(flat.numel()) < 0.1)
        sizes = [1, -1] if kind == "uniform" else [-900, 700, 1, 3000]
        step = torch.from_numpy(gen.choice(sizes, size=flat.numel())).to(flat.dtype)
    new = torch.where(where, flat + step, flat).view(torch.bfloat16)
    pairs = [("w", base, new)]
    level_1, level_3 = encode_delta(pairs, level=1), encode_delta(pairs, level=3)
    check_object(level_3, pairs)
    assert len(level_3) <= len(level_1)
    record = read_delta(level_3)._records["w"]
    assert (record.encoding == "chunked") == (kind == "conditioned")
    if kind == "conditioned":
        assert record.layout is not None and record.layout.groups > 1
        assert len(level_3) < 0.95 * len(level_1)


def test_buckets_pay_at_one_percent_changed() -> None:
    """At about 1% changed, the sparse end of what training steps change, level 3
    still codes positions per bucket and takes at most 0.8x level 1's bytes (its
    walk weighed more once kept one bucket there: 0.88x)."""
    gen = UpdateGenerator(ModelConfig.preset("tiny"), lr=5e-7, seed=5)
    base = gen.state()
    new = base
    for _ in range(3):
        base, new = new, gen.step()
    pairs = [(name, base[name], new[name]) for name in new]
    numel = sum(t.numel() for t in new.values())
    changed = sum(int((bits(base[n]) != bits(new[n])).sum()) for n in new)
    assert 0.005 < changed / numel < 0.015
    level_1, level_3 = encode_delta(pairs, level=1), encode_delta(pairs, level=3)
    check_object(level_3, pairs)
    assert len(level_3) <= 0.8 * len(level_1)
    records = read_delta(level_3)._records.values()
    bucketed = [r for r in records if r.layout is not None and r.layout.groups > 1]
    assert len(bucketed) >= len([r for r in records if r.changed]) // 2


def test_chunking_costs_little() -> None:
    """Chunks of 4096 elements against one chunk for the whole tensor: the table and
    the per-chunk byte padding stay within 1% at the default chunk size's scale."""
    gen = np.random.default_rng(9)
    base = weights(1 << 20, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    sizes = {}
    for log2 in (20, 16):
        saved = chunked.CHUNK_LOG2
        chunked.CHUNK_LOG2 = log2
        try:
            sizes[log2] = len(encode_delta([("w", base, new)], level=3))
        finally:
            chunked.CHUNK_LOG2 = saved
    # 16 chunks of 64K elements cost at most 1% over one chunk of 1M.
    assert sizes[16] <= sizes[20] * 1.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
def test_device_decode_matches_the_host() -> None:
    gen = np.random.default_rng(3)
    base = weights(2 << 20, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    data = encode_delta([("w", base, new)], level=3)
    obj = read_delta(data)
    device = torch.device("cuda")
    on_device = base.to(device)
    patch = obj.decode("w", on_device)
    assert patch.positions.device.type == "cuda"
    host = obj.decode("w", base)
    assert torch.equal(patch.positions.cpu(), host.positions)
    assert torch.equal(patch.values.cpu(), host.values)
    target = on_device.clone()
    obj.apply_to("w", target)
    assert torch.equal(bits(target.cpu()), bits(new))
    assert encode_delta([("w", on_device, new.to(device))], level=3) == data


def test_the_device_decoder_takes_a_few_chunks_a_pass(
    small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch decoder (a GPU's) decodes a few chunks a pass, so that its int64
    temporaries stay bounded on a large tensor; any split gives the host's patch."""
    gen = np.random.default_rng(11)
    base = weights(10 * 4096 + 123, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    obj = read_delta(encode_delta([("w", base, new)], level=3))
    layout = obj._records["w"].layout
    assert layout is not None and layout.groups > 1 and layout.table.shape[0] == 11
    host = obj.decode("w", base)
    passes: list[tuple[int, int]] = []
    decode_pass = chunked_torch._decode_pass

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        passes.append((args[2], args[3]))  # (first, stop)
        return decode_pass(*args)

    monkeypatch.setattr(chunked_torch, "_decode_pass", counted)
    for elements, split in ((1 << 30, 1), (3 * 4096, 4), (4096, 11)):
        monkeypatch.setattr(chunked_torch, "PASS_ELEMENTS", elements)
        passes.clear()
        where, new_bits = codec_reference.decode(obj, "w", base)  # the torch decoder
        assert len(passes) == split and passes[-1][1] == 11
        assert np.array_equal(where, host.positions.numpy())
        assert np.array_equal(new_bits, host.values.numpy().view(new_bits.dtype))


# ----------------------------------------------------------------------------- hostile


def _fuzz_object() -> tuple[bytes, torch.Tensor]:
    gen = np.random.default_rng(17)
    base = weights(3 * 4096 + 100, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    saved = chunked.CHUNK_LOG2
    chunked.CHUNK_LOG2 = 12
    try:
        return encode_delta([("w", base, new)], level=3), base
    finally:
        chunked.CHUNK_LOG2 = saved


def _guarded(base: torch.Tensor, guard: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``base`` copied into the middle of a larger buffer filled with a pattern, so
    a write outside the tensor shows."""
    buffer = torch.full((base.numel() + 2 * guard,), 0x5A5A, dtype=torch.int16)
    inner = buffer[guard : guard + base.numel()]
    inner.copy_(bits(base).reshape(-1))
    return buffer, inner.view(base.dtype)


def _try_all(data: bytes, base: torch.Tensor) -> None:
    """Read, decode (both decoders) and apply: only DeltasyncError may escape; an
    apply that fails leaves the tensor as it was; nothing outside it is written."""
    try:
        obj = read_delta(data, object_name="fuzz")
    except DeltasyncError:
        return
    with contextlib.suppress(DeltasyncError):
        obj.decode("w", base)
    with contextlib.suppress(codec_reference.DamagedError):
        codec_reference.decode(obj, "w", base)  # the torch decoder
    buffer, target = _guarded(base)
    before = buffer.clone()
    with contextlib.suppress(DeltasyncError):
        obj.gathered("w", target)  # a proof's decode reads and never writes
    assert torch.equal(buffer, before)
    guard = 4096
    try:
        obj.apply_to("w", target)
    except DeltasyncError:
        assert torch.equal(buffer, before)
    assert torch.equal(buffer[:guard], before[:guard])
    assert torch.equal(buffer[-guard:], before[-guard:])


def _two_bytes_replaced(data: bytes, copies: int, seed: int) -> Iterator[bytes]:
    """``copies`` objects of ``data`` with two random bytes of its one entry replaced
    and the checksum rebuilt, so that the damage reaches the decoders."""
    size = int(read_container(data, "x").streams["streams"].size)
    gen = np.random.default_rng(seed)
    for _ in range(copies):
        spots = gen.integers(0, size, size=2)
        values = gen.integers(0, 256, size=2).astype(np.uint8)

        def edit(
            found: dict[str, np.ndarray], s: np.ndarray = spots, v: np.ndarray = values
        ) -> None:  # type: ignore[type-arg]
            found["streams"][s] = v

        yield rebuild(data, edit_entries=edit)


def test_hostile_bytes_in_every_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # The torch decoder takes the object's four chunks in two passes.
    monkeypatch.setattr(chunked_torch, "PASS_ELEMENTS", 2 * 4096)
    data, base = _fuzz_object()
    entries = read_container(data, "x").streams
    record = read_delta(data)._records["w"]
    size = int(entries["streams"].size)  # the one entry of a compact object
    assert size == record.nbytes
    gen = np.random.default_rng(1)
    for trial in range(400):
        edits = gen.integers(1, 4)
        spots = gen.integers(0, size, size=edits)
        values = gen.integers(0, 256, size=edits).astype(np.uint8)

        def edit(
            found: dict[str, np.ndarray], s: np.ndarray = spots, v: np.ndarray = values
        ) -> None:  # type: ignore[type-arg]
            found["streams"][s] = v

        _try_all(rebuild(data, edit_entries=edit), base)
        if trial % 50 == 0:  # truncated and extended entries
            cut = int(gen.integers(0, size))

            def shorten(found: dict[str, np.ndarray], c: int = cut) -> None:  # type: ignore[type-arg]
                found["streams"] = found["streams"][:c]

            _try_all(rebuild(data, edit_entries=shorten), base)


@pytest.mark.parametrize(
    "edit",
    [
        {"chunk": 5},
        {"chunk": 31},
        {"chunk": 13},
        {"chunk": 11},
        {"chunk": "12"},
        {"bounds": [0]},
        {"bounds": [5000, 4000]},
        {"bounds": [1, 2, 3, 4]},
        {"bounds": [1 << 20]},
        {"bounds": []},
        {"bounds": [14000]},
        {"bounds": None},
        {"big": -1},
        {"big": 0},
        {"big": 10**9},
    ],
)
def test_hostile_params(edit: dict[str, object]) -> None:
    data, base = _fuzz_object()

    def change(meta: dict[str, str], records: list[list[object]]) -> None:
        params = records[0][6]
        assert isinstance(params, dict)
        params.update(edit)

    _try_all(rebuild(data, edit_meta=change), base)


@pytest.mark.parametrize(
    "row",
    [
        [],
        ["w"],
        ["w", "bfloat16", [12388], "chunked", 5, [1, 2], {}],
        ["w", "bfloat16", [12388], "nope", 5, [1, 2, 3], {}],
        [7, "bfloat16", [12388], "chunked", 5, [1, 2, 3], {}],
        ["w", "bfloat16", [12388], "chunked", 5, [1, -2, 3], {}],
        ["w", "bfloat16", [12388], "chunked", 5, [1, 2, 3], []],
        ["w", "bfloat16", [12388], "chunked", 5, [10**12, 2, 3], {}],
        {"name": "w"},
    ],
)
def test_hostile_compact_records(row: object) -> None:
    data, base = _fuzz_object()

    def change(meta: dict[str, str], records: list[object]) -> None:
        records[0] = row

    _try_all(rebuild(data, edit_meta=change), base)

    def extra(meta: dict[str, str], records: list[object]) -> None:
        records.append(row)

    _try_all(rebuild(data, edit_meta=extra), base)


def test_hostile_stream_sizes() -> None:
    data, base = _fuzz_object()
    for role in chunked.ROLES:
        for delta in (-1, 1):

            def change(
                meta: dict[str, str],
                records: list[list[object]],
                r: int = chunked.ROLES.index(role),
                d: int = delta,
            ) -> None:
                sizes = records[0][5]
                assert isinstance(sizes, list)
                sizes[r] = max(0, int(sizes[r]) + d)

            _try_all(rebuild(data, edit_meta=change), base)


def test_unary_codes_that_run_past_their_chunk_are_refused() -> None:
    """A chunk whose bits hold no end of a code (the first chunk's bytes zeroed, or
    every chunk's) is refused by name, on one thread and on two, with the weights
    untouched: the word-at-a-time unary reader stops at each chunk's last byte."""
    data, base = _fuzz_object()
    record = read_delta(data, object_name="x")._records["w"]
    assert record.layout is not None and record.layout.table.shape[0] > 2
    table_bytes = record.streams["table"]
    first_chunk = int(record.layout.table[0, 0])
    for lo, hi in ((0, first_chunk), (0, record.streams["bits"])):

        def edit(found: dict[str, np.ndarray], a: int = lo, b: int = hi) -> None:  # type: ignore[type-arg]
            found["streams"][table_bytes + a : table_bytes + b] = 0

        damaged = read_delta(rebuild(data, edit_entries=edit), object_name="damaged")
        with pytest.raises(DeltasyncError, match="unary codes run past its bytes"):
            damaged.decode("w", base)
        for threads in (1, 2):
            buffer, target = _guarded(base)
            before = buffer.clone()
            with (
                pytest.MonkeyPatch.context() as patch,
                pytest.raises(DeltasyncError, match="unary codes run past its bytes"),
            ):
                patch.setattr(chunked, "DECODE_THREADS", threads)
                patch.setattr(chunked, "MIN_CHANGES_PER_THREAD", 1)
                damaged.apply_to("w", target)
            assert torch.equal(buffer, before)


def test_both_decoders_refuse_the_same_damage() -> None:
    """The compiled walk and the torch-ops decoder, given the same damaged streams
    (with a valid checksum), both refuse them or both decode the same changes."""
    data, base = _fuzz_object()
    compared = 0
    for damaged in _two_bytes_replaced(data, 200, seed=3):
        try:
            obj = read_delta(damaged, object_name="fuzz")
        except DeltasyncError:
            continue
        outcomes: list[tuple[list[int], list[int]] | None] = []
        try:
            patch = obj.decode("w", base)
        except DeltasyncError:
            outcomes.append(None)
        else:
            values = patch.values.numpy().view(np.uint16)
            outcomes.append((patch.positions.tolist(), values.tolist()))
        try:
            where, new_bits = codec_reference.decode(obj, "w", base)  # the torch decoder
        except codec_reference.DamagedError:
            outcomes.append(None)
        else:
            outcomes.append((where.tolist(), new_bits.tolist()))
        assert outcomes[0] == outcomes[1]
        compared += 1
    assert compared > 100


@pytest.mark.parametrize("buckets", [True, False])
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_damaged_large_magnitude_leaves_the_tensor_as_it_was(
    monkeypatch: pytest.MonkeyPatch, buckets: bool, which: str
) -> None:
    """Contents are written in batches, the large magnitudes after each batch's unit
    steps: a large magnitude that decodes to 0 or 1 (damage) anywhere in a chunk of
    thousands of changes refuses the tensor with nothing of it written, on the bucket
    walk and on a chunk without buckets alike."""
    if not buckets:  # one bucket everywhere: no walk over the base
        monkeypatch.setattr(chunked, "GROUP_BITS_PER_ELEMENT", 1e9)
        # Without buckets, level 3 also tries level 1 at a bitmap's density, and
        # level 1's record is the smaller here: keep the chunks, whose walk is tested.
        monkeypatch.setattr(tensorcodec, "BITMAP_MIN_DENSITY", 1.0)
    gen = np.random.default_rng(5)
    base = weights(300_000, gen, torch.bfloat16)
    # One in five large: with more, level 3 tries level 1, whose record wins where
    # buckets do not pay (no chunks to damage).
    new = conditioned_update(base, gen, steps=(-1, 1) * 6 + (2, -3, 400))
    data = encode_delta([("w", base, new)], level=3)
    obj = read_delta(data, object_name="damaged")
    record = obj._records["w"]
    assert record.layout is not None
    assert (record.layout.groups > 1) == buckets
    assert record.changed > 10 * 256
    decode = chunked.magnitude_planes

    def damaged(*args: object) -> np.ndarray:  # type: ignore[type-arg]
        planes = decode(*args).copy()  # type: ignore[arg-type]
        count = planes.size // 2  # bf16: two byte planes
        assert count > 100
        at = {"first": 0, "middle": count // 2, "last": count - 1}[which]
        planes[[at, count + at]] = 0xFF  # + 2 wraps to 1: not a large magnitude
        return planes

    target = base.clone()
    obj.apply_to("w", target)
    assert torch.equal(bits(target), bits(new))
    monkeypatch.setattr(chunked, "magnitude_planes", damaged)
    target = base.clone()
    with pytest.raises(DeltasyncError, match="large magnitudes"):
        obj.apply_to("w", target)
    assert torch.equal(bits(target), bits(base))


def test_a_clean_decode_follows_damaged_ones() -> None:
    """The decoder's reused scratch (rank bitmaps) is left clean by a damaged chunk."""
    data, base = _fuzz_object()
    obj = read_delta(data, object_name="clean")
    expected = obj.decode("w", base)
    for damaged in _two_bytes_replaced(data, 60, seed=2):
        with contextlib.suppress(DeltasyncError):
            read_delta(damaged, object_name="fuzz").decode("w", base)
        again = obj.decode("w", base)
        assert torch.equal(again.positions, expected.positions)
        assert torch.equal(again.values, expected.values)


def test_a_clean_decode_leaves_the_rank_bitmaps_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished chunk zeroes only the bitmap words its buckets walked: every word
    of the reused scratch is zero again, whichever bucket ended where."""
    monkeypatch.setattr(chunked, "DECODE_THREADS", 1)  # on this thread's scratch
    gen = np.random.default_rng(11)
    base = weights(3 << 20 | 77, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    obj = read_delta(encode_delta([("big", base, new)], level=3))
    assert obj._records["big"].layout is not None and obj._records["big"].layout.groups > 1
    ranks = chunked._zeroed_ranks(1 << 15)  # rows longer than any chunk's here
    patch = obj.decode("big", base)
    assert torch.equal(patch.values, bits(new).reshape(-1)[patch.positions])
    assert chunked._zeroed_ranks(1) is ranks  # the buffer this thread decoded with
    assert not ranks.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("small_chance", [0.3, 0.9])
def test_the_scan_ranks_every_change_in_its_bucket(
    small_chunks: None, dtype: torch.dtype, small_chance: float
) -> None:
    """scan_ranked against the definition: each change's rank is the count of
    elements of its chunk before it in its magnitude bucket. Dense changes (more
    than 6%) make the scan resume into new buffers mid-chunk; the tensor ends in a
    partial block."""
    gen = np.random.default_rng(int(small_chance * 100))
    numel = 11 * 4096 + 1000 + 37
    base = weights(numel, gen, dtype)
    info = BY_DTYPE[dtype]
    old_u = bits(base).reshape(-1).numpy().view(info.unsigned)
    size = base.float().abs().numpy()
    chance = np.where(size < 0.01, small_chance, np.where(size < 0.05, small_chance / 10, 0.0))
    new_u = old_u + (gen.random(numel) < chance).astype(info.unsigned)
    walker = chunked.compiled()
    found = chunked.scan(walker, old_u, new_u, info)
    assert found.bounds.size >= 1
    where = np.flatnonzero(old_u != new_u)
    assert (where.size > numel // 16 + 128) == (small_chance > 0.5)  # resumed or not
    assert np.array_equal(found.where, where)
    assert np.array_equal(found.diff, new_u[where] - old_u[where])
    assert np.array_equal(found.old, old_u[where])
    magnitude = old_u.astype(np.uint64) & np.uint64(chunked.magnitude_mask(info))
    bucket = np.searchsorted(found.bounds.astype(np.uint64), magnitude, side="right")
    expected = np.empty(where.size, np.int64)
    for c in range(-(-numel // 4096)):
        lo, hi = c * 4096, min(numel, (c + 1) * 4096)
        for g in range(found.bounds.size + 1):
            members = np.flatnonzero(bucket[lo:hi] == g) + lo
            rank_of = np.full(numel, -1, np.int64)
            rank_of[members] = np.arange(members.size)
            picked = (where >= lo) & (where < hi) & (bucket[where] == g)
            expected[picked] = rank_of[where[picked]] * 4 + g
    assert np.array_equal(found.ranks, expected)


def test_selecting_deposit_matches_the_definition() -> None:
    """The stand-in for pdep where it is slow or missing (Zen 1 and 2, no BMI2), on
    random words and on the edges: empty and full masks, x with bits past the mask's
    count (they have no place), every single bit."""
    jit = pytest.importorskip("pipeline.codec.level3.chunked_jit")
    gen = np.random.default_rng(3)
    full = (1 << 64) - 1
    words = [int(v) for v in gen.integers(0, 1 << 63, size=400, dtype=np.int64)]
    words = [w | (int(gen.integers(0, 2)) << 63) for w in words]
    cases = list(zip(words[::2], words[1::2], strict=True))
    cases += [(full, 0), (full, full), (0, full), (1, 1 << 63), (1 << 63, full)]
    cases += [(1 << k, full) for k in range(64)] + [(full, 1 << k) for k in range(64)]
    cases += [(x & words[i] & words[i + 1], m) for i, (x, m) in enumerate(cases[:150])]
    for x, mask in cases:
        want, taken = 0, 0
        for bit in range(64):
            if mask >> bit & 1:
                want |= (x >> taken & 1) << bit
                taken += 1
        low = np.uint64(jit._low(np.uint64(x), np.uint64(mask.bit_count())))
        got = int(jit._select_deposit(low, np.uint64(mask)))
        assert got == want, (hex(x), hex(mask))


def test_every_inconsistent_chunk_table_is_named(small_chunks: None) -> None:
    """The compiled table check gives each kind of inconsistency its reason, and a
    consistent table the offsets the decoder needs."""
    gen = np.random.default_rng(5)
    base = weights(3 * 4096 + 100, gen, torch.bfloat16)
    new = conditioned_update(base, gen)
    info = BY_DTYPE[torch.bfloat16]
    old_u = bits(base).reshape(-1).numpy().view(np.uint16)
    new_u = bits(new).reshape(-1).numpy().view(np.uint16)
    where = np.flatnonzero(old_u != new_u)
    walker = chunked.compiled()
    found = chunked.scan(walker, old_u, new_u, info)
    assert np.array_equal(found.where, where)
    enc = chunked.encode(walker, old_u, found)
    numel, changed = base.numel(), int(where.size)
    good = chunked.layout(enc.streams, enc.params, changed, numel, info)
    assert isinstance(good, chunked.Layout)
    assert good.table.shape[0] == 4 and good.groups > 1
    assert good.changes.tolist() == [int(c) for c in np.bincount(where >> 12, minlength=4)]
    assert good.out_at.tolist() == [0, *np.cumsum(good.changes)[:-1].tolist()]
    assert good.starts.tolist() == [0, *np.cumsum(good.table[:, 0])[:-1].tolist()]
    # What each decode reads from the layout instead of working it out again.
    counts = good.table[:, 1::2]  # every group's count, large magnitudes last
    assert good.most_codes == int(counts.sum(axis=1).max()) > 0
    assert good.big == int(counts[:, -1].sum()) == enc.params["big"]
    assert good.padded.tolist() == chunked.padded_bounds(good.bounds, info).tolist()

    def edited(edit: object) -> dict[str, np.ndarray]:  # type: ignore[type-arg]
        table = good.table.copy()
        streams = dict(enc.streams)
        if callable(edit):
            edit(table)
            streams["table"] = chunked.write_varints(table.reshape(-1))
        else:
            streams["table"] = np.asarray(edit, np.uint8)
        return streams

    def reason(edit: object) -> object:
        return chunked.layout(edited(edit), enc.params, changed, numel, info)

    def refused_by_the_decoder(edit: object) -> None:
        """A table consistent in its sums: the layout passes, the decode refuses it
        and leaves the target as it was."""
        streams = edited(edit)
        found = chunked.layout(streams, enc.params, changed, numel, info)
        assert isinstance(found, chunked.Layout)
        target = old_u.copy()
        with pytest.raises(chunked.ChunkedError):
            chunked.decode(chunked.compiled(), streams, found, changed, target, info, write=True)
        assert np.array_equal(target, old_u)

    g = good.groups
    table_bytes = enc.streams["table"]
    assert reason(table_bytes[:-1]) == "chunk table does not hold its numbers"
    assert reason(np.append(table_bytes, 0)) == "chunk table does not hold its numbers"
    assert reason(np.append(table_bytes[:-1], [0x80, 0])) == "chunk table does not hold its numbers"
    assert reason(lambda t: t.__setitem__((0, 2), 41)) == "a Rice parameter is out of range"
    assert reason(lambda t: t.__setitem__((1, 1), 5000)) == "a chunk's counts exceed its elements"
    big_more = (0, 1 + 2 * g)
    assert reason(lambda t: t.__setitem__(big_more, t[0, 1 : 2 * g : 2].sum() + 1)) == (
        "a chunk's counts exceed its elements"
    )

    def move_a_change(t: np.ndarray) -> None:  # type: ignore[type-arg]
        t[0, 1] -= 1
        t[1, 1] += 1

    refused_by_the_decoder(move_a_change)
    assert reason(lambda t: t.__setitem__((0, 1), t[0, 1] - 1)) == (
        "chunk counts do not add up to the record's"
    )

    def move_bytes(t: np.ndarray) -> None:  # type: ignore[type-arg]
        t[0, 0] += 1
        t[1, 0] -= 1

    refused_by_the_decoder(move_bytes)
    assert reason(lambda t: t.__setitem__((3, 0), t[3, 0] + 1)) == (
        "chunk byte counts do not add up to the bit stream"
    )
    assert reason(lambda t: t.__setitem__((0, 0), 1 << 48)) == (
        "chunk byte counts do not add up to the bit stream"
    )
    assert reason(lambda t: t.__setitem__((0, 0), 0)) == (
        "a chunk has fewer bits than its codes need"
    )


@pytest.mark.parametrize(
    ("cpu", "features", "fast"),
    [
        ("znver1", "+avx2,+bmi2", False),
        ("znver2", "+avx2,+bmi2", False),
        ("znver3", "+avx2,+bmi2", True),
        ("skylake", "+avx2,+bmi2", True),
        ("skylake", "+avx2,-bmi2", False),
    ],
)
def test_pdep_only_where_it_is_one_instruction(
    monkeypatch: pytest.MonkeyPatch, cpu: str, features: str, fast: bool
) -> None:
    """Zen 1 and 2 run pdep as microcode (about 250 cycles): the selecting deposit
    serves there, as on CPUs without BMI2."""
    jit = pytest.importorskip("pipeline.codec.level3.chunked_jit")

    class Features:
        def flatten(self) -> str:
            return features

    monkeypatch.setattr(jit.llvm, "get_host_cpu_name", lambda: cpu)
    monkeypatch.setattr(jit.llvm, "get_host_cpu_features", Features)
    assert jit._fast_pdep() is fast
