"""Hashes: sha256 for objects, xxh3-128 for tensor contents."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import xxhash

OBJECT_HASH = "sha256"
CONTENT_HASH = "xxh3-128"


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


def state_hash(tensor_hashes: Iterable[tuple[str, str]]) -> str:
    """One hash for a whole state: names and content hashes, in name order."""
    h = xxhash.xxh3_128()
    for name, digest in sorted(tensor_hashes):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()
