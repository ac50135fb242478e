"""Hashes: sha256 for objects, xxh3-128 for tensor contents."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import xxhash

OBJECT_HASH = "sha256"
CONTENT_HASH = "xxh3-128"
PATCHED_CHUNK_BYTES = 4 << 20  # scratch for hashing a patched tensor: stays in cache


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


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


def state_hash(tensor_hashes: Iterable[tuple[str, str]]) -> str:
    """One hash for a whole state: names and content hashes, in name order."""
    h = xxhash.xxh3_128()
    for name, digest in sorted(tensor_hashes):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()
