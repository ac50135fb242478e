"""The key every manifest reader checks signatures with, bound to the store it reads.

A process that has a verify key (or a signing key, whose public half it derives)
opens its store through :func:`trusted`: every manifest then read from that store
(``chain.load_manifest``, and so resolve, rebuilds, compaction, GC, status, verify
and the diff job's head) must carry a valid signature by that key. There is no
second, unverified way to read a manifest from such a store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from pipeline.errors import ConfigError
from pipeline.format.signing import (
    key_id,
    private_key_from,
    public_key_from,
)
from pipeline.store.base import ObjectStore


class TrustedStore:
    """``store`` with the public key its manifests must be signed by; every other
    attribute is the wrapped store's."""

    def __init__(self, store: ObjectStore, public_key: Ed25519PublicKey) -> None:
        self.inner = store
        self.public_key = public_key
        self.url = store.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"TrustedStore({self.inner!r}, key {key_id(self.public_key)})"

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self.inner.put_file(key, path)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.inner.get_range(key, start, length)

    def get_file(self, key: str, path: Path) -> None:
        self.inner.get_file(key, path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def store_key(store: ObjectStore) -> Ed25519PublicKey | None:
    """The key manifests read from ``store`` must be signed by, or None."""
    return store.public_key if isinstance(store, TrustedStore) else None


def trusted(store: ObjectStore, public_key: Ed25519PublicKey | bytes | None) -> ObjectStore:
    """``store`` whose manifests must be signed by ``public_key`` (``store`` itself when
    None). ConfigError if ``store`` already trusts another key."""
    if public_key is None:
        return store
    key = public_key_from(public_key)
    held = store_key(store)
    if held is not None:
        if key_id(held) != key_id(key):
            raise ConfigError(
                f"store {store.url} is already read with key {key_id(held)}, not {key_id(key)}"
            )
        return store
    return TrustedStore(store, key)


def signer_store(store: ObjectStore, signing_key: Ed25519PrivateKey | bytes | None) -> ObjectStore:
    """``store`` trusting the public half of ``signing_key``: whoever signs a version
    first verifies what it builds on. ConfigError if the store trusts another key."""
    if signing_key is None:
        return store
    return trusted(store, private_key_from(signing_key).public_key())


def process_key(signing_pem: bytes | None, verify_pem: bytes | None) -> Ed25519PublicKey | None:
    """The key a process verifies with: its verify key, else the public half of its
    signing key. ConfigError when both are set and do not belong together."""
    verify = public_key_from(verify_pem) if verify_pem is not None else None
    signing = private_key_from(signing_pem).public_key() if signing_pem is not None else None
    if verify is not None and signing is not None and key_id(verify) != key_id(signing):
        raise ConfigError(
            f"DELTASYNC_SIGNING_KEY (key {key_id(signing)}) does not belong to "
            f"DELTASYNC_VERIFY_KEY (key {key_id(verify)}): this process would refuse "
            "what it signs"
        )
    return verify or signing
