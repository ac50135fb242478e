"""The fast paths taken for speed give the same bits and the same guarantees as the slow ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import chain
from pipeline.checkpoint import CheckpointReader
from pipeline.codec import TensorPatch, apply_patch
from pipeline.errors import MismatchError
from pipeline.hashing import content_hash
from pipeline.publish import publish_step
from pipeline.state_cache import StateCache
from pipeline.store.file import FileStore
from pipeline.synthetic import ModelConfig, UpdateGenerator, save_state
from pipeline.targets import patching
from pipeline.targets.patching import hash_patched
from tests.pipeline_helpers import bits

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("numel", [1, 7, 5000, 70001])
def test_hash_patched_equals_hash_of_patched_copy(
    dtype: torch.dtype, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patching, "_HASH_CHUNK_BYTES", 4096)  # many chunks, ragged end
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


def _publish(tmp: Path, steps: int) -> tuple[FileStore, StateCache, dict[str, torch.Tensor]]:
    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", "r")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=3)
    state = generator.state()
    for step in range(steps):
        if step:
            state = generator.step()
        path = tmp / f"s{step}.safetensors"
        save_state(state, path)
        result = publish_step(store, "r", step, path, cache, level=1)
        assert result.status == "published"
    return store, cache, state


def test_state_cache_advances_in_place_and_stays_exact(tmp_path: Path) -> None:
    store, cache, state = _publish(tmp_path, 4)
    head = chain.load_manifest(store, "r", "delta", 3)
    assert cache.version == 3 and cache.is_valid_for(head)
    folders = [p for p in cache.root.iterdir() if p.is_dir()]
    assert [p.name for p in folders] == ["v0000000003"]
    with cache.reader() as reader:
        for name, tensor in state.items():
            assert torch.equal(bits(reader.get(name)), bits(tensor)), name


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
    assert publish_step(store, "r", 2, path, cache, level=1).status == "published"
    for name, tensor in chain.reconstruct_tensors(store, "r", 2):
        assert torch.equal(bits(tensor), bits(nxt[name])), name
    with cache.reader() as reader:
        for name, tensor in nxt.items():
            assert torch.equal(bits(reader.get(name)), bits(tensor)), name
