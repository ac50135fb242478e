"""Realistic multi-step chains from the update generator reconstruct exactly."""

from __future__ import annotations

import pytest
import torch

from pipeline.codec import DEFAULT_LEVEL, apply_patch, encode_delta, read_delta
from pipeline.format.hashes.hashing import content_hash
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)


@pytest.mark.parametrize(("level", "lr"), [(1, 1e-6), (3, 1e-5)])
def test_chain_reconstructs_every_version_bitwise(level: int, lr: float) -> None:
    gen = UpdateGenerator(ModelConfig.preset("tiny"), lr=lr, seed=11)
    published = gen.state()
    replica = {name: t.clone() for name, t in published.items()}
    for version in range(1, 4):
        new = gen.step()
        # Encoded in two shards, as a trainer with a sharded checkpoint would.
        names = list(new)
        shards = [names[: len(names) // 2], names[len(names) // 2 :]]
        objects = [
            encode_delta(((n, published[n], new[n]) for n in shard), level=level)
            for shard in shards
        ]
        total_changed = 0
        for index, data in enumerate(objects):
            obj = read_delta(data, object_name=f"v{version}/part-{index}")
            assert obj.level == level
            for info in obj.tensors:
                patch = obj.decode(info.name, replica[info.name])
                apply_patch(replica[info.name], patch)
                total_changed += info.changed
        for name, tensor in new.items():
            assert torch.equal(replica[name].view(torch.int16), tensor.view(torch.int16)), name
            assert content_hash(replica[name]) == content_hash(tensor)
        numel = sum(t.numel() for t in new.values())
        assert 0.002 * numel < total_changed < 0.3 * numel
        published = new


def test_level_three_is_smaller_on_realistic_updates() -> None:
    gen = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-6, seed=5)
    base = gen.state()
    gen.step()
    new = gen.step()
    pairs = [(n, base[n], new[n]) for n in new]
    sizes = {level: len(encode_delta(pairs, level=level)) for level in (1, 3)}
    changed = sum(int((base[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in new)
    assert sizes[3] < sizes[1] < 1.5 * changed
    assert DEFAULT_LEVEL == 1


def test_non_contiguous_inputs_use_logical_order() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(32, 24, generator=gen).to(torch.bfloat16).t()
    new = base.clone()
    new[3, 5] = 7.0
    new[20, 1] = -0.0
    data = encode_delta([("w", base, new)])
    patch = read_delta(data).decode("w", base)
    target = base.contiguous()
    apply_patch(target, patch)
    assert torch.equal(target.view(torch.int16), new.contiguous().view(torch.int16))
    assert patch.positions.tolist() == [3 * 32 + 5, 20 * 32 + 1]
