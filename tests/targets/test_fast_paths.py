"""The fast paths taken for speed give the same bits and the same guarantees as the slow ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipeline.codec import TensorPatch, apply_patch, encode_delta, read_delta
from pipeline.errors import CorruptObjectError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.hashes import hashing
from pipeline.format.hashes.content_hashes import XXH3
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.manifest import Manifest, TensorEntry, object_key
from pipeline.publish.caches import state_cache
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore
from pipeline.targets import patching, proving
from pipeline.targets.base import TensorSpec
from pipeline.targets.patching import hash_patched
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.versions import chain
from tests.pipeline_helpers import bits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("numel", [1, 7, 5000, 70001])
def test_hash_patched_equals_hash_of_patched_copy(
    dtype: torch.dtype, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashing, "PATCHED_CHUNK_BYTES", 4096)  # many chunks, ragged end
    gen = torch.Generator().manual_seed(numel)
    held = torch.randint(0, 255, (numel * torch.empty(0, dtype=dtype).element_size(),),
                         dtype=torch.uint8, generator=gen).view(dtype)  # fmt: skip
    view = INT[held.element_size()]
    count = max(1, numel // 20)
    positions = torch.randperm(numel, generator=gen)[:count].sort().values
    values = torch.randint(0, 255, (count * held.element_size(),), dtype=torch.uint8,
                           generator=gen).view(view)  # fmt: skip
    patch = TensorPatch("w", dtype, (numel,), positions, values)
    before = bits(held).clone()
    copy = held.clone()
    apply_patch(copy, patch)
    assert hash_patched([patch], lambda _n: held, {"w": content_hash(copy)}) == {
        "w": content_hash(copy)
    }
    assert torch.equal(bits(held), before)  # the held tensor was not written
    with pytest.raises(MismatchError, match="tensor w"):
        hash_patched([patch], lambda _n: held, {"w": content_hash(held)})


def _publish(
    tmp: Path, steps: int, content_hash: str | None = None
) -> tuple[FileStore, StateCache, dict[str, torch.Tensor]]:
    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", "r")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=3)
    state = generator.state()
    for step in range(steps):
        if step:
            state = generator.step()
        path = tmp / f"s{step}.safetensors"
        save_state(state, path)
        result = publish_step(
            store, "r", step, path, cache, PublishOptions(content_hash=content_hash)
        )
        assert result.status == "published"
    return store, cache, state


@pytest.mark.parametrize("in_kernel", [True, False])
def test_state_cache_advances_in_place_and_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_kernel: bool
) -> None:
    if not in_kernel:  # a system without copy_file_range: through a small buffer
        monkeypatch.delattr(os, "copy_file_range", raising=False)
        monkeypatch.setattr(state_cache, "COPY_STEP", 4093)
    store, cache, state = _publish(tmp_path, 4)
    head = chain.load_manifest(store, "r", "delta", 3)
    assert cache.version == 3 and cache.is_valid_for(head)
    folders = [p for p in cache.root.iterdir() if p.is_dir()]
    assert [p.name for p in folders] == ["v0000000003"]
    with cache.reader() as reader:
        for name, tensor in state.items():
            assert torch.equal(bits(reader.get(name)), bits(tensor)), name


@pytest.mark.parametrize("in_kernel", [True, False])
def test_copy_range_moves_exactly_its_bytes_and_refuses_a_short_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_kernel: bool
) -> None:
    if not in_kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    monkeypatch.setattr(state_cache, "COPY_STEP", 1000)  # many steps
    data = os.urandom(10_000)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(bytes(12_000))
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY)
    try:
        state_cache.copy_range(src, 123, dst, 1000, 9_000, "src")
        out = (tmp_path / "dst").read_bytes()
        assert out[:1000] == bytes(1000)
        assert out[1000:10_000] == data[123:9_123]
        assert out[10_000:] == bytes(2000)
        with pytest.raises(CorruptObjectError, match="ends before its header says"):
            state_cache.copy_range(src, 5_000, dst, 0, 6_000, "src")
    finally:
        os.close(src)
        os.close(dst)


def test_state_cache_with_wrong_bytes_is_caught_and_rebuilt(tmp_path: Path) -> None:
    store, cache, state = _publish(tmp_path, 2)
    parent = chain.load_manifest(store, "r", "delta", 1)
    # The checkpoint changed after it was published: the cache takes bytes that do not
    # hold the manifest's state. The next diff must notice, rebuild from the store and
    # publish a delta against the published state.
    wrong = {n: t.clone() for n, t in state.items()}
    first = next(iter(wrong))
    bits(wrong[first])[0] ^= 1
    path = tmp_path / "wrong.safetensors"
    save_state(wrong, path)
    cache.rebuild(store, "r", 0)  # an older version, so the update goes in place
    with CheckpointReader(path) as reader:
        cache.advance(reader, parent)
    assert cache.version == 1
    with cache.reader() as reader:
        assert not torch.equal(bits(reader.get(first)), bits(state[first]))
    nxt = {n: t.clone() for n, t in state.items()}
    bits(nxt[first])[1] ^= 1
    path = tmp_path / "s2.safetensors"
    save_state(nxt, path)
    assert publish_step(store, "r", 2, path, cache).status == "published"
    for name, tensor in chain.reconstruct_tensors(store, "r", 2):
        assert torch.equal(bits(tensor), bits(nxt[name])), name
    with cache.reader() as reader:
        for name, tensor in nxt.items():
            assert torch.equal(bits(reader.get(name)), bits(tensor)), name


def test_owned_checkpoints_move_into_the_cache_after_the_announcement(tmp_path: Path) -> None:
    """An adopted checkpoint (deltasync's own staging copy, a file or a sharded folder)
    is renamed into the state cache, not copied; ``on_published`` runs with the
    manifest in the store while the cache still holds the parent."""
    store = FileStore(tmp_path / "store")
    cache = StateCache(tmp_path / "cache", "r")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=4)
    seen: list[tuple[int, bool, int | None]] = []

    def published(manifest: Manifest) -> None:
        seen.append((manifest.version, store.exists(manifest.key), cache.version))

    state = generator.state()
    for step in range(4):
        if step:
            state = generator.step()
        path = tmp_path / "staging" / f"step-{step}"
        if step == 2:  # a sharded folder
            write_checkpoint(path, state.items(), max_shard_bytes=64 << 10)
        else:
            write_checkpoint(path, state.items())
        adopt = step != 3
        result = publish_step(store, "r", step, path, cache, on_published=published, adopt=adopt)
        assert result.status == "published"
        assert path.exists() is not adopt
        assert cache.version == step
        with cache.reader() as reader:
            for name, tensor in state.items():
                assert torch.equal(bits(reader.get(name)), bits(tensor)), (step, name)
        for name, tensor in chain.reconstruct_tensors(store, "r", step):
            assert torch.equal(bits(tensor), bits(state[name])), (step, name)
    assert seen == [(0, True, None), (1, True, 0), (2, True, 1), (3, True, 2)]
    assert [p.name for p in cache.root.iterdir() if p.is_dir()] == ["v0000000003"]


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn],
)
@pytest.mark.parametrize("numel", [1, 5000, 70001])
@pytest.mark.parametrize("density", [0.001, 0.02, 0.3])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_hashed_equals_decode_then_hash_then_gather(
    dtype: torch.dtype, numel: int, density: float, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-pass proof (codec.decode_hashed, via proving.prove_entries) gives the
    same patch, old contents and hash as decoding, hashing a patched copy and gathering
    separately, for many chunks with a ragged end; a wrong base is refused. A GPU
    tensor's chunks are copied to the host; the results are host tensors."""
    monkeypatch.setattr(hashing, "PATCHED_CHUNK_BYTES", 4096)
    monkeypatch.setattr(hashing, "DEVICE_CHUNK_BYTES", 4096)
    gen = torch.Generator().manual_seed(numel + int(density * 1000))
    width = torch.empty(0, dtype=dtype).element_size()
    base = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=gen).view(dtype)
    new = base.clone()
    count = max(1, int(numel * density))
    where = torch.randperm(numel, generator=gen)[:count]
    flat = bits(new).view(-1)
    # Mostly +-1 steps of the bit pattern, some large jumps (wrapping at the ends).
    steps = torch.randint(-1, 2, (count,), generator=gen).to(flat.dtype)
    steps[steps == 0] = 1
    steps[::7] = 77 if count > 20 else steps[::7]
    flat[where] += steps
    before = content_hash(base)
    obj = read_delta(encode_delta([("w", base, new)], level=1))
    hashed = obj.decode_hashed("w", base.to(device))
    if hashed is None:  # another encoding than sparse + sign-magnitude: decode only
        assert not (dtype is torch.bfloat16 and density < 0.03 and numel > 1000), "must walk"
        return
    reference = obj.decode("w", base)
    assert torch.equal(hashed.patch.positions, reference.positions)
    assert torch.equal(hashed.patch.values, reference.values)
    assert torch.equal(bits(hashed.old), bits(base).view(-1)[reference.positions])
    assert hashed.digest == content_hash(new)
    assert content_hash(base) == before  # not written
    wrong = base.clone()
    bits(wrong).view(-1)[int(reference.positions[0])] ^= 1
    other = obj.decode_hashed("w", wrong.to(device))
    assert other is not None and other.digest != content_hash(new)


def test_two_writers_write_everything_and_roll_everything_back() -> None:
    """Large writes are split over two threads; a hash mismatch still restores every
    written element of every tensor, and a good write lands in full."""
    gen = torch.Generator().manual_seed(9)
    held = {f"w{i}": torch.randn(200_000, generator=gen).to(torch.bfloat16) for i in range(4)}
    before = {n: bits(t).clone() for n, t in held.items()}
    patches = []
    for i, name in enumerate(held):
        positions = torch.randperm(200_000, generator=gen)[: 30_000 + 5_000 * i].sort().values
        values = bits(held[name]).view(-1)[positions] + 1
        patches.append(TensorPatch(name, torch.bfloat16, (200_000,), positions, values))
    assert sum(p.positions.numel() for p in patches) >= patching._PARALLEL_WRITE_MIN
    mine, other = patching.split_for_two_writers(
        patches, lambda p: p.positions.numel(), on_cpu=True
    )
    assert mine and other and {p.name for p in mine + other} == set(held)

    expected = {}
    for patch in patches:
        copy = held[patch.name].clone()
        apply_patch(copy, patch)
        expected[patch.name] = content_hash(copy)
    wrong = dict(expected, w3="0" * 32)
    with pytest.raises(MismatchError, match="tensor w3"):
        patching.apply_verified(patches, held.__getitem__, wrong)
    for name, tensor in held.items():
        assert torch.equal(bits(tensor), before[name]), name

    applied = patching.apply_verified(patches, held.__getitem__, expected)
    assert applied.hashes == expected
    for name, tensor in held.items():
        assert content_hash(tensor) == expected[name], name


@pytest.mark.parametrize("threads", [1, 3])
def test_proof_on_threads_equals_the_sequential_proof_and_names_the_first_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Tensors proven on several threads give the same patches, hashes and old
    contents as one thread; with two tensors at fault, the first in manifest order
    is reported, and the held weights are not written. (The one-pass proof of an
    xxh3-128 run.)"""
    store, _, _ = _publish(tmp_path, 2, XXH3)
    manifest = chain.load_manifest(store, "r", "delta", 1)
    objects = {o.key: store.get(object_key("r", "delta", 1, o.key)) for o in manifest.objects}
    held = dict(chain.reconstruct_tensors(store, "r", 0))
    specs = {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in held.items()}
    monkeypatch.setattr(proving, "PROVE_THREADS", 1)
    want = proving.prove_entries(manifest.tensors, objects, held.__getitem__, specs)
    monkeypatch.setattr(proving, "PROVE_THREADS", threads)
    monkeypatch.setattr(proving, "_prove_pool", None)
    got = proving.prove_entries(manifest.tensors, objects, held.__getitem__, specs)
    assert [p.name for p in got.patches] == [p.name for p in want.patches]
    for a, b in zip(got.patches, want.patches, strict=True):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
        assert torch.equal(got.old_values[a.name], want.old_values[b.name])
    assert got.hashes == want.hashes and len(got.hashes) > 2

    touched = [e.name for e in manifest.tensors if e.changed > 0]
    first, later = touched[1], touched[-1]
    for name in (later, first):  # damage a later tensor too: the first must be named
        bits(held[name]).view(-1)[-1] ^= 1
    before = {n: bits(t).clone() for n, t in held.items()}
    with pytest.raises(MismatchError, match=f"tensor {first}:"):
        proving.prove_entries(manifest.tensors, objects, held.__getitem__, specs)
    assert all(torch.equal(bits(held[n]), before[n]) for n in held)


@pytest.mark.parametrize(
    ("positions", "fine"),
    [
        ([0, 5, 11], True),
        ([3], True),
        ([], True),
        ([-1, 4], False),
        ([2, 12], False),
        ([12], False),
    ],
)
def test_check_patch_bounds_positions_by_their_ends(positions: list[int], fine: bool) -> None:
    """A decoded patch's sorted positions are checked against the tensor's size by
    their first and last; on CPU they are read through numpy."""
    where = torch.tensor(positions, dtype=torch.int64)
    values = torch.ones(len(positions), dtype=torch.int16)
    patch = TensorPatch("w", torch.bfloat16, (3, 4), where, values)
    entry = TensorEntry("w", "bfloat16", (3, 4), "", "part-00000", len(positions))
    spec = TensorSpec(torch.bfloat16, (3, 4))
    if fine:
        patching.check_patch(patch, entry, spec)
    else:
        with pytest.raises(CorruptObjectError, match="decoded position out of range"):
            patching.check_patch(patch, entry, spec)
