"""Hashes: sha256 for objects, xxh3-128 for tensor contents (the torch-free ones live in
:mod:`pipeline.format.hashes.digests`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from pipeline.format.hashes.digests import CONTENT_HASH, OBJECT_HASH, sha256_bytes, state_hash

# Re-exported: most callers hash tensors and objects alike from here.
__all__ = ["CONTENT_HASH", "OBJECT_HASH", "sha256_bytes", "state_hash"]

PATCHED_CHUNK_BYTES = 4 << 20  # scratch for hashing a patched tensor: stays in cache
# Host staging for hashing a patched tensor held on a GPU: two such buffers per
# thread, pinned, so one chunk's copy runs while the other is patched and hashed.
DEVICE_CHUNK_BYTES = 16 << 20


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (copied to CPU if needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def content_hash(tensor: torch.Tensor) -> str:
    """Hash of a tensor's bytes; dtype and shape are checked separately."""
    return xxhash.xxh3_128_hexdigest(tensor_bytes(tensor))


def patched_content_hash(
    flat: npt.NDArray[Any],
    positions: npt.NDArray[np.int64],
    patch: Callable[[npt.NDArray[Any], int, int, int], None],
) -> str:
    """The content hash of ``flat`` (a tensor's elements as integers) with changes at
    the ascending ``positions`` applied, without writing ``flat``: each chunk is copied
    into one small scratch buffer, ``patch(chunk, start, lo, hi)`` writes the changes
    ``lo:hi`` (those between element ``start`` and the chunk's end) into it, and it is
    hashed while in cache. The same digest as hashing a patched full copy."""
    step = max(1, PATCHED_CHUNK_BYTES // flat.itemsize)
    scratch = np.empty(min(step, flat.size), flat.dtype)
    bounds = np.searchsorted(positions, np.arange(0, flat.size + step, step)).tolist()
    hasher = xxhash.xxh3_128()
    for k, start in enumerate(range(0, flat.size, step)):
        chunk = scratch[: min(step, flat.size - start)]
        np.copyto(chunk, flat[start : start + chunk.size])  # memcpy speed
        patch(chunk, start, bounds[k], bounds[k + 1])
        hasher.update(chunk.data)
    return hasher.hexdigest()


class _Staging(threading.local):
    """Per-thread host buffers and copy streams for :func:`patched_device_hash`."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.streams: dict[torch.device, Any] = {}
        self.pinning_failed = False

    def host_buffers(self, nbytes: int, pinned: bool) -> list[torch.Tensor]:
        """Two host buffers of at least ``nbytes``; pinned if asked and possible (a
        host that refuses to lock memory gets pageable ones: slower copies, same
        bytes)."""
        pinned = pinned and not self.pinning_failed
        if (
            not self.buffers
            or self.buffers[0].numel() < nbytes
            or (pinned and not self.buffers[0].is_pinned())
        ):
            self.buffers = []
            if pinned:  # pinning is slow: done once, at the full chunk size
                try:
                    size = max(nbytes, DEVICE_CHUNK_BYTES)
                    self.buffers = [
                        torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)
                    ]
                except RuntimeError:
                    self.pinning_failed = True
            if not self.buffers:
                self.buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
        return self.buffers

    def stream(self, device: torch.device) -> Any:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return self.streams[device]


_staging = _Staging()


def patched_device_hash(
    flat: torch.Tensor,
    positions: npt.NDArray[np.int64],
    patch: Callable[[npt.NDArray[Any], int, int, int], None],
    chunk_bytes: int | None = None,
) -> str:
    """:func:`patched_content_hash` of ``flat`` (a flat integer tensor, on any device),
    with no scratch copy on its device: chunks are copied into host buffers, patched
    there and hashed. On a GPU the buffers are pinned and the copy of the next chunk
    runs on a side stream while this one is patched and hashed."""
    n = flat.numel()
    itemsize = flat.element_size()
    step = max(1, (chunk_bytes or DEVICE_CHUNK_BYTES) // itemsize)
    cuda = flat.device.type == "cuda"
    buffers = [
        b[: min(step, n) * itemsize].view(flat.dtype)
        for b in _staging.host_buffers(min(step, n) * itemsize, cuda)
    ]
    starts = list(range(0, n, step))
    bounds = np.searchsorted(positions, np.arange(0, n + step, step)).tolist()
    done: list[Any] = [None, None]
    if cuda:
        stream = _staging.stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))  # earlier writes land

    def copy(k: int) -> None:
        start = starts[k]
        size = min(step, n - start)
        if not cuda:
            buffers[k % 2][:size].copy_(flat[start : start + size])
            return
        with torch.cuda.stream(stream):
            buffers[k % 2][:size].copy_(flat[start : start + size], non_blocking=True)
            done[k % 2] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done[k % 2].record(stream)

    hasher = xxhash.xxh3_128()
    if starts:
        copy(0)
    for k, start in enumerate(starts):
        if k + 1 < len(starts):
            copy(k + 1)  # into the other buffer, hashed in the previous round
        if cuda:
            done[k % 2].synchronize()
        chunk = buffers[k % 2][: min(step, n - start)].numpy()
        patch(chunk, start, bounds[k], bounds[k + 1])
        hasher.update(chunk.data)
    return hasher.hexdigest()


def patched_tensor_hash(
    flat: torch.Tensor,
    positions: npt.NDArray[np.int64],
    patch: Callable[[npt.NDArray[Any], int, int, int], None],
) -> str:
    """:func:`patched_content_hash` of a flat integer tensor on any device: a CPU
    tensor's chunks are copied from its own memory, another device's through
    :func:`patched_device_hash`."""
    if flat.device.type == "cpu":
        return patched_content_hash(flat.numpy(), positions, patch)
    return patched_device_hash(flat, positions, patch)
