"""Ed25519 signatures over manifests, and the keys that make and check them.

A signature covers the manifest's canonical JSON without the signature field
(``manifest.signing_payload``), so any change to a signed manifest breaks it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import replace
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from pipeline.errors import ConfigError, SignatureError
from pipeline.format.manifest import Manifest, signing_payload

SIGNATURE_ALG = "ed25519"
PRIVATE_KEY_NAME = "signing.key"
PUBLIC_KEY_NAME = "verify.pub"


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the start of the sha256 of its raw bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(manifest: Manifest, private_key: Ed25519PrivateKey | bytes) -> Manifest:
    """Return the manifest with an Ed25519 signature over its canonical JSON."""
    private_key = private_key_from(private_key)
    sig = private_key.sign(signing_payload(manifest))
    return replace(
        manifest,
        signature={
            "alg": SIGNATURE_ALG,
            "key_id": key_id(private_key.public_key()),
            "sig": base64.b64encode(sig).decode("ascii"),
        },
    )


def verify_signature(manifest: Manifest, public_key: Ed25519PublicKey | bytes) -> None:
    """SignatureError unless the manifest carries a valid signature by ``public_key``."""
    public_key = public_key_from(public_key)
    name = f"{manifest.kind} {manifest.version} of run {manifest.run}"
    sig = manifest.signature
    if sig is None:
        raise SignatureError(f"{name} is not signed")
    if sig.get("alg") != SIGNATURE_ALG:
        raise SignatureError(f"{name} is signed with unsupported algorithm {sig.get('alg')!r}")
    if sig.get("key_id") != key_id(public_key):
        raise SignatureError(f"{name} is signed by key {sig.get('key_id')!r}, not the trusted key")
    try:
        raw = base64.b64decode(sig.get("sig", ""), validate=True)
        public_key.verify(raw, signing_payload(manifest))
    except (InvalidSignature, binascii.Error, ValueError):
        raise SignatureError(f"{name} has an invalid signature") from None


def private_key_from(key: Ed25519PrivateKey | bytes) -> Ed25519PrivateKey:
    """A private key object from itself or from PEM bytes (as settings hold it)."""
    if isinstance(key, Ed25519PrivateKey):
        return key
    try:
        loaded = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"signing key is not a PEM private key: {e}") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ConfigError("signing key is not an Ed25519 key")
    return loaded


def public_key_from(key: Ed25519PublicKey | bytes) -> Ed25519PublicKey:
    """A public key object from itself or from PEM bytes (as settings hold it)."""
    if isinstance(key, Ed25519PublicKey):
        return key
    try:
        loaded = serialization.load_pem_public_key(key)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"verify key is not a PEM public key: {e}") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise ConfigError("verify key is not an Ed25519 key")
    return loaded


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot load private key {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"private key {path} is not an Ed25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot load public key {path}: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key {path} is not an Ed25519 key")
    return key


def generate_keypair(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair (PEM) into ``directory``; returns (private, public) paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    private_path, public_path = d / PRIVATE_KEY_NAME, d / PUBLIC_KEY_NAME
    if private_path.exists():
        raise ConfigError(f"{private_path} already exists; refusing to overwrite a signing key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path
