"""The hashes that need no tensor: sha256 of objects and the state hash of a version.
Importable without torch (commands that read manifests only)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import xxhash

OBJECT_HASH = "sha256"
CONTENT_HASH = "xxh3-128"


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def state_hash(tensor_hashes: Iterable[tuple[str, str]]) -> str:
    """One hash for a whole state: names and content hashes, in name order."""
    h = xxhash.xxh3_128()
    for name, digest in sorted(tensor_hashes):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()
