"""Hashing a tensor as it will be after a patch, without writing it: chunk by chunk
on the host, for tensors held on the CPU or on a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pipeline.format.hashes import hashing
from pipeline.format.hashes.hashing import content_hash, patched_content_hash, patched_device_hash
from pipeline.targets.patching import int_view

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def patched_copy(flat: torch.Tensor, where: np.ndarray, values: np.ndarray) -> torch.Tensor:
    out = flat.detach().cpu().clone()
    out[torch.from_numpy(where)] = torch.from_numpy(values)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 999, 1000, 1001, 4097])
@pytest.mark.parametrize("chunk_bytes", [8, 1000, 1 << 20])
def test_chunked_hash_of_a_patched_tensor_equals_the_hash_of_a_patched_copy(
    device: str, dtype: torch.dtype, numel: int, chunk_bytes: int
) -> None:
    gen = np.random.default_rng(numel + chunk_bytes)
    flat = int_view(torch.randn(numel).to(dtype)).reshape(-1)
    count = int(gen.integers(0, numel + 1)) if numel else 0
    where = np.sort(gen.choice(numel, size=count, replace=False)).astype(np.int64)
    if numel > 2:  # changes on chunk edges and at both ends
        step = max(1, chunk_bytes // flat.element_size())
        edges = [0, numel - 1, *range(step - 1, numel, step), *range(step, numel, step)]
        where = np.union1d(where, np.array(edges, dtype=np.int64))
    info = np.iinfo(flat.numpy().dtype)
    values = gen.integers(info.min, info.max, size=where.size, dtype=flat.numpy().dtype)
    want = content_hash(patched_copy(flat, where, values))
    held = flat.to(device)
    before = flat.clone()

    def put(chunk: np.ndarray[Any, Any], start: int, lo: int, hi: int) -> None:
        chunk[where[lo:hi] - start] = values[lo:hi]

    assert patched_device_hash(held, where, put, chunk_bytes=chunk_bytes) == want
    assert patched_content_hash(flat.numpy(), where, put) == want
    assert torch.equal(held.cpu(), before)  # nothing written
    if where.size:
        assert want != content_hash(before) or bool((values == before.numpy()[where]).all())


def test_staging_buffers_are_pinned_where_possible_and_pageable_elsewhere() -> None:
    """A host that cannot lock memory (no GPU, or a locked-memory limit) still gets
    buffers, once: copies are then synchronous, the hashes the same."""
    staging = hashing._Staging()
    buffers = staging.host_buffers(1000, pinned=True)
    assert len(buffers) == 2 and all(b.numel() >= 1000 for b in buffers)
    assert buffers[0].data_ptr() != buffers[1].data_ptr()
    pinned = [b.is_pinned() for b in buffers]
    if torch.cuda.is_available():
        assert all(pinned) and not staging.pinning_failed
    else:
        assert not any(pinned) and staging.pinning_failed
    assert staging.host_buffers(1000, pinned=True) is buffers  # not made again
