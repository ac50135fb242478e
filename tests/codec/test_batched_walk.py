"""Many small tensors walked in one compiled call (``DeltaObject.gathered_many``) and
their hashes updated in one (``HashAlgorithm.updated_many``): the same positions,
contents and digests as one tensor at a time, every dtype the walk takes; a damaged
record named, nothing after it used; damaged streams never escape as anything but a
DeltasyncError, and nothing held is written."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec import TensorPatch, encode_delta, read_delta
from pipeline.codec.api import _checksum
from pipeline.codec.container import read_container, write_container
from pipeline.errors import CorruptObjectError, DeltasyncError
from pipeline.format.hashes import content_hashes, mixsum
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
)
from pipeline.targets import confirmed, proving
from pipeline.targets.torch import TorchTarget
from tests.hostile.test_hostile_input import FUZZ

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

MIXSUM = content_hashes.get(content_hashes.MIXSUM)
# Every dtype of at most 4 bytes (what the walk takes), float ones with edge bit
# patterns (NaN payloads, -0.0, infinities) among the changes.
WALKED = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.bool,
    torch.float8_e4m3fn,
]


def _changed(base: torch.Tensor, rng: np.random.Generator, big: bool) -> torch.Tensor:
    """``base`` with a few elements changed, the first and last among them; small steps
    in the integer view (sign-magnitude contents) or, with ``big``, arbitrary new bits
    (byte planes)."""
    flat = base.reshape(-1).clone()
    if base.dtype == torch.bool:
        where = np.unique(np.r_[0, flat.numel() - 1, rng.choice(flat.numel(), 9)])
        flat[torch.from_numpy(where)] = ~flat[torch.from_numpy(where)]
        return flat.view(base.shape)
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[base.element_size()])
    where = np.unique(np.r_[0, flat.numel() - 1, rng.choice(flat.numel(), 40)])
    at = torch.from_numpy(where)
    if big:
        steps = rng.integers(1, 120, where.size)
    else:
        steps = rng.choice(np.array([-2, -1, 1, 1, 1, 2]), where.size)
    ints[at] = (ints[at].to(torch.int64) + torch.from_numpy(steps)).to(ints.dtype)
    if base.dtype.is_floating_point and base.element_size() >= 2:
        edges = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")], dtype=base.dtype)
        flat[1:5] = edges
        ints[5] = ints[5] | 0x3  # a NaN payload when element 5 is a NaN
    return flat.view(base.shape)


def small_tensors(seed: int, count: int = 24) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, base, new) of ``count`` small tensors, every walked dtype, both contents
    methods."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for k in range(count):
        dtype = WALKED[k % len(WALKED)]
        shape = (int(rng.integers(8, 40)), int(rng.integers(8, 70)))
        if dtype == torch.bool:
            base = torch.rand(shape, generator=gen) < 0.5
        elif dtype.is_floating_point:
            base = torch.randn(shape, generator=gen).to(dtype)
        else:
            low = -100 if dtype.is_signed else 0
            base = torch.randint(low, 100, shape, generator=gen).to(dtype)
        pairs.append((f"layers.{k}.w", base, _changed(base, rng, big=k % 3 == 2)))
    return pairs


def walked_names(data: bytes, bases: dict[str, torch.Tensor]) -> list[str]:
    delta = read_delta(data)
    return [t.name for t in delta.tensors if delta.walks(t.name, bases[t.name])]


@pytest.mark.parametrize("level", [1, 3])
def test_a_batch_gathers_what_one_at_a_time_does_and_its_digests_are_full_hashes(
    level: int,
) -> None:
    pairs = small_tensors(seed=level)
    data = encode_delta(pairs, level)
    bases = {name: base for name, base, _ in pairs}
    news = {name: new for name, _, new in pairs}
    delta = read_delta(data)
    walked = walked_names(data, bases)
    methods = {t.name: r for t in delta.tensors for r in [delta._records[t.name].params]}
    # Other encodings (level 3 codes float positions per bucket of the base) are taken
    # one at a time.
    assert len(walked) >= len(pairs) // 2
    assert {methods[n].get("contents") for n in walked} == {"signmag", "planes"}
    held = {name: base.clone() for name, base in bases.items()}
    batches, errors = delta.gathered_many(list(held.items()))
    assert errors == {}
    seen: list[str] = []
    for batch in batches:
        width = held[batch.names[0]].element_size()
        digests = MIXSUM.updated_many(
            [mixsum.full(held[n]) for n in batch.names],
            batch.positions,
            batch.old,
            batch.new,
            batch.bounds,
            width,
        )
        for k, name in enumerate(batch.names):
            seen.append(name)
            one = delta.gathered(name, held[name])
            assert one is not None
            for got, want in zip(batch.tensors(k), one, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), name
            assert digests[k] == mixsum.full(news[name]), name
    assert sorted(seen) == sorted(walked)
    for name, base in bases.items():  # a gather writes nothing
        assert torch.equal(held[name].view(torch.uint8), base.view(torch.uint8)), name


def rebuild(data: bytes, edit: Callable[[dict[str, np.ndarray]], None]) -> bytes:  # type: ignore[type-arg]
    """``data`` with its entries edited and a valid checksum."""
    container = read_container(data, "x")
    meta = dict(container.metadata)
    entries = {k: v.copy() for k, v in container.streams.items()}
    edit(entries)
    meta["checksum"] = _checksum(meta["level"], meta["tensors"], entries)
    return write_container(entries, meta)


def test_a_damaged_record_is_named_those_before_it_are_exact_none_after_it_is_used() -> None:
    pairs = [(n, b, new) for n, b, new in small_tensors(seed=5) if b.dtype == torch.bfloat16]
    pairs += [(f"more.{k}", b, n) for k, (_, b, n) in enumerate(small_tensors(seed=6))
              if b.dtype == torch.bfloat16]  # fmt: skip
    data = encode_delta(pairs, 1)
    bases = {name: base for name, base, _ in pairs}
    walked = walked_names(data, bases)
    victim = walked[len(walked) // 2]

    def smash(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        entries[victim][:2] = 0xFF  # extra unary terminators

    delta = read_delta(rebuild(data, smash), object_name="obj")
    held = {name: base.clone() for name, base in bases.items()}
    batches, errors = delta.gathered_many(list(held.items()))
    assert list(errors) == [victim]
    assert f"obj: tensor {victim!r}" in str(errors[victim])
    (batch,) = batches
    assert batch.names == walked[: walked.index(victim)]
    good = read_delta(data)
    for k, name in enumerate(batch.names):
        one = good.gathered(name, bases[name])
        assert one is not None
        assert all(torch.equal(a, b) for a, b in zip(batch.tensors(k), one, strict=True)), name


def manifest_for(
    data: bytes, pairs: list[tuple[str, torch.Tensor, torch.Tensor]], sha256: str | None = None
) -> Manifest:
    changed = {i.name: i.changed for i in read_delta(data).tensors}
    entries = [
        TensorEntry(n, dtype_name(t.dtype), tuple(t.shape), mixsum.full(t), "part", changed[n])
        for n, _, t in pairs
    ]
    parents = [TensorEntry(n, "", (), mixsum.full(base), "") for n, base, _ in pairs]
    return Manifest(
        run="batched",
        version=1,
        kind="delta",
        parent=0,
        anchor=0,
        codec=CodecInfo("deltasync-bitdelta", 1, 1),
        objects=(ObjectEntry("part", len(data), sha256 or sha256_bytes(data)),),
        tensors=tuple(entries),
        state_hash=compute_state_hash(entries),
        created=now_iso(),
        parent_state_hash=compute_state_hash(parents),
        content_hash=content_hashes.MIXSUM,
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_a_replica_applies_many_small_tensors_bit_exact_and_refuses_a_damaged_one_unwritten(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(proving, "PROVE_THREADS", threads)
    monkeypatch.setattr(proving, "BATCH_CHANGES", 200)  # several batches, shared by threads
    pairs = small_tensors(seed=7, count=40)
    data = encode_delta(pairs, 1)
    target = TorchTarget({name: base.clone() for name, base, _ in pairs})
    target.hashes(algorithm=content_hashes.MIXSUM)
    target.apply_delta(manifest_for(data, pairs), {"part": data}, "touched")
    for name, _, new in pairs:
        assert torch.equal(target.tensor(name).view(torch.uint8), new.view(torch.uint8)), name

    back = [(name, new, base) for name, base, new in pairs]
    data_back = encode_delta(back, 1)
    walked = walked_names(data_back, {n: t for n, t, _ in back})
    victim = walked[-2]

    def smash(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        entries[victim][:2] = 0xFF

    damaged = rebuild(data_back, smash)
    manifest = manifest_for(data_back, back, sha256_bytes(damaged))
    with pytest.raises(CorruptObjectError, match=rf"tensor '{victim}'"):
        target.apply_delta(manifest, {"part": damaged}, "touched")
    for name, _, new in pairs:  # refused before any write
        assert torch.equal(target.tensor(name).view(torch.uint8), new.view(torch.uint8)), name


@pytest.fixture(scope="module")
def fuzz_case() -> tuple[bytes, dict[str, torch.Tensor], dict[str, list[str]]]:
    pairs = small_tensors(seed=9, count=18)
    data = encode_delta(pairs, 1)
    records = json.loads(read_container(data, "x").metadata["tensors"])
    roles = {r["name"]: list(r["streams"]) for r in records}
    return data, {name: base for name, base, _ in pairs}, roles


def resealed_damage(blob: bytes, data: st.DataObject) -> bytes:
    """``blob`` with up to six stream bytes changed under a valid checksum (what a
    writer to the store with the codec in hand could send)."""
    names = sorted(read_container(blob, "x").streams)
    edits = data.draw(
        st.lists(
            st.tuples(st.sampled_from(names), st.integers(0, 10**4), st.integers(0, 255)),
            min_size=1,
            max_size=6,
        )
    )

    def change(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        for name, at, value in edits:
            if entries[name].size:
                entries[name][at % entries[name].size] = value

    return rebuild(blob, change)


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_fuzz_batched_walk_of_resealed_damaged_streams(
    fuzz_case: tuple[bytes, dict[str, torch.Tensor], dict[str, list[str]]], data: st.DataObject
) -> None:
    """Stream bytes changed under a valid checksum (what a writer to the store with the
    codec in hand could send): only DeltasyncError escapes, and the held tensors are
    not written."""
    blob, bases, _ = fuzz_case
    damaged = resealed_damage(blob, data)
    held = {name: base.clone() for name, base in bases.items()}
    with contextlib.suppress(DeltasyncError):
        delta = read_delta(damaged, object_name="fuzzed")
        batches, _ = delta.gathered_many(list(held.items()))
        for batch in batches:
            for k, name in enumerate(batch.names):
                at, _, old = batch.tensors(k)
                assert at.numel() == 0 or (int(at[0]) >= 0 and int(at[-1]) < held[name].numel())
                assert bool((at[1:] > at[:-1]).all())
                flat = held[name].reshape(-1).view(old.dtype)
                assert torch.equal(flat[at], old), name
    for name, base in bases.items():
        assert torch.equal(held[name].view(torch.uint8), base.view(torch.uint8)), name


def _patch(name: str, positions: list[int], values: torch.Tensor) -> TensorPatch:
    return TensorPatch(name, values.dtype, (0,), torch.tensor(positions, dtype=torch.int64), values)


def test_confirmed_writes_of_many_tensors_in_one_call_equal_apply_patch() -> None:
    pairs = small_tensors(seed=11, count=30)
    data = encode_delta(pairs, 1)
    delta = read_delta(data)
    held = {name: base.clone() for name, base, _ in pairs}
    patches = [delta.decode(name, held[name]) for name, _, _ in pairs]
    confirmed.write_confirmed_all([(held[p.name], p) for p in patches])
    for name, _, new in pairs:
        assert torch.equal(held[name].view(torch.uint8), new.view(torch.uint8)), name


@pytest.mark.parametrize(
    "positions",
    [[3, 2], [1, 1], [0, 64]],
    ids=["descending", "repeated", "out of range"],
)
def test_a_bad_patch_among_many_is_named_and_left_unwritten(positions: list[int]) -> None:
    held = {n: torch.zeros(64, dtype=torch.int16) for n in ("a", "b", "c")}
    good = _patch("a", [1, 5], torch.tensor([7, 8], dtype=torch.int16))
    bad = _patch("b", positions, torch.tensor([9, 9], dtype=torch.int16))
    late = _patch("c", [0], torch.tensor([3], dtype=torch.int16))
    with pytest.raises(CorruptObjectError, match="tensor b: patch positions"):
        confirmed.write_confirmed_all([(held[p.name], p) for p in (good, bad, late)])
    assert held["a"][[1, 5]].tolist() == [7, 8]  # written before it: the caller rolls back
    assert not held["b"].any() and not held["c"].any()


def test_a_malformed_patch_is_refused_before_anything_is_written() -> None:
    held = {n: torch.zeros(8, dtype=torch.int16) for n in ("a", "b")}
    good = _patch("a", [1], torch.tensor([7], dtype=torch.int16))
    wide = _patch("b", [1], torch.tensor([7], dtype=torch.int32))  # not the tensor's width
    with pytest.raises(CorruptObjectError, match="tensor b: malformed patch"):
        confirmed.write_confirmed_all([(held["a"], good), (held["b"], wide)])
    assert not held["a"].any() and not held["b"].any()


@pytest.mark.parametrize("confirm", [False, True])
def test_many_tensors_walked_into_place_in_one_call_equal_the_new_version(confirm: bool) -> None:
    pairs = small_tensors(seed=12, count=30)
    data = encode_delta(pairs, 1)
    delta = read_delta(data)
    held = {name: base.clone() for name, base, _ in pairs}
    walked = walked_names(data, held)
    written, error = delta.apply_many([(n, held[n]) for n in walked], confirm=confirm)
    assert error is None and sorted(written) == sorted(walked)  # (grouped by dtype)
    for name, base, new in pairs:
        want = new if name in walked else base
        assert torch.equal(held[name].view(torch.uint8), want.view(torch.uint8)), name
    for name in reversed(written):  # and back, by walking the same streams
        delta.undo_apply(name, held[name])
    for name, base, _ in pairs:
        assert torch.equal(held[name].view(torch.uint8), base.view(torch.uint8)), name


def test_a_damaged_record_in_a_walked_batch_is_left_as_it_was_and_named() -> None:
    pairs = [(n, b, new) for n, b, new in small_tensors(seed=13, count=40)
             if b.dtype == torch.bfloat16]  # fmt: skip
    # The victim has thousands of changes: batches of them are written before the
    # damage is met, and walked back.
    victim = "layers.victim"
    base = torch.randn(400, 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ints = base.reshape(-1).view(torch.int16).clone()
    ints[::40] += 1
    pairs.insert(len(pairs) // 2, (victim, base, ints.view(torch.bfloat16).view(400, 100)))
    data = encode_delta(pairs, 1)
    bases = {name: base for name, base, _ in pairs}
    walked = walked_names(data, bases)

    records = json.loads(read_container(data, "x").metadata["tensors"])
    unary = next(r["streams"]["unary"] for r in records if r["name"] == victim)

    def smash(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        entries[victim][unary * 3 // 4 : unary] = 0xFF  # its positions decode partway, then fail

    delta = read_delta(rebuild(data, smash), object_name="obj")
    held = {name: base.clone() for name, base in bases.items()}
    written, error = delta.apply_many([(n, held[n]) for n in walked], confirm=True)
    assert written == walked[: walked.index(victim)]
    assert isinstance(error, CorruptObjectError) and f"obj: tensor {victim!r}" in str(error)
    news = {name: new for name, _, new in pairs}
    for name in walked:
        want = news[name] if name in written else bases[name]
        assert torch.equal(held[name].view(torch.uint8), want.view(torch.uint8)), name


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_fuzz_batched_writes_of_resealed_damaged_streams_walk_back_to_the_base(
    fuzz_case: tuple[bytes, dict[str, torch.Tensor], dict[str, list[str]]], data: st.DataObject
) -> None:
    """Whatever damaged streams decode to, a batched write stops at the first bad
    record with that record as it was, and walking back what it reports written
    restores every tensor bit for bit."""
    blob, bases, _ = fuzz_case
    damaged = resealed_damage(blob, data)
    held = {name: base.clone() for name, base in bases.items()}
    with contextlib.suppress(DeltasyncError):
        delta = read_delta(damaged, object_name="fuzzed")
        items = [(n, t) for n, t in held.items() if delta.walks(n, t)]
        written, error = delta.apply_many(items, confirm=data.draw(st.booleans()))
        assert error is None or isinstance(error, DeltasyncError)
        for name in reversed(written):
            delta.undo_apply(name, held[name])
    for name, base in bases.items():
        assert torch.equal(held[name].view(torch.uint8), base.view(torch.uint8)), name
