"""Ed25519 signatures over manifests and run records, and the keys that make and check them.

A signed document is stored in an envelope (:mod:`pipeline.format.sealed`): its raw
canonical JSON behind a small header whose signature covers the document's sha256
and size. A reader checks the header before it reads, let alone parses, the
document; any change to a signed document breaks it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from pipeline.errors import ConfigError, SignatureError
from pipeline.format import sealed
from pipeline.format.manifest import Manifest, signing_payload

SIGNATURE_ALG = "ed25519"
PRIVATE_KEY_NAME = "signing.key"
PUBLIC_KEY_NAME = "verify.pub"
SIGNS_MANIFEST = "manifest"
SIGNS_RUN_RECORD = "run record"
# What a reader holding a key says of a manifest or record without an envelope: it may
# be one signed inside the document, the form of earlier releases, no longer accepted.
UNSIGNED_FIX = (
    "(a signature inside the manifest, as earlier releases wrote, is no longer accepted: "
    "re-sign the run with `deltasync resign --run RUN` and DELTASYNC_SIGNING_KEY)"
)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the start of the sha256 of its raw bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def signature_for(
    payload: bytes, what: str, private_key: Ed25519PrivateKey | bytes
) -> dict[str, Any]:
    """The envelope header that signs ``payload`` (a ``what``: manifest, run record)."""
    private_key = private_key_from(private_key)
    sha256, size = sealed.digest(payload)
    sig = private_key.sign(sealed.statement(what, sha256, size))
    return {
        "alg": SIGNATURE_ALG,
        "key_id": key_id(private_key.public_key()),
        "sha256": sha256,
        "sig": base64.b64encode(sig).decode("ascii"),
        "size": size,
    }


def seal(payload: bytes, what: str, private_key: Ed25519PrivateKey | bytes) -> bytes:
    """``payload`` in a signed envelope."""
    return sealed.wrap(signature_for(payload, what, private_key), payload)


def check_header(
    signature: dict[str, Any], what: str, public_key: Ed25519PublicKey | bytes, name: str
) -> None:
    """SignatureError unless ``signature`` (an envelope header) is a valid signature by
    ``public_key`` of a ``what`` of the sha256 and size it names. Bounded work: the
    document itself is not looked at (``sealed.unwrap`` checks it against the header)."""
    public_key = public_key_from(public_key)
    alg, signer = str(signature.get("alg", "")), str(signature.get("key_id", ""))
    if alg != SIGNATURE_ALG:
        raise SignatureError(f"{name} is signed with unsupported algorithm {alg[:40]!r}")
    if signer != key_id(public_key):
        raise SignatureError(f"{name} is signed by key {signer[:40]!r}, not the trusted key")
    try:
        raw = base64.b64decode(str(signature.get("sig", "")), validate=True)
        size = signature.get("size")
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError("size")
        public_key.verify(raw, sealed.statement(what, str(signature.get("sha256")), size))
    except (InvalidSignature, binascii.Error, ValueError):
        raise SignatureError(f"{name} has an invalid signature") from None


def verify_sealed(
    prefix: bytes, what: str, public_key: Ed25519PublicKey | bytes, name: str
) -> sealed.Header:
    """The header at the start of ``prefix`` (an object's first bytes) once its signature
    is checked; SignatureError for an object that is not signed, or not by this key."""
    found = sealed.header(prefix, name)
    if found is None:
        raise SignatureError(f"{name} is not signed {UNSIGNED_FIX}")
    check_header(found.signature, what, public_key, name)
    return found


def sign(manifest: Manifest, private_key: Ed25519PrivateKey | bytes) -> Manifest:
    """Return the manifest with an Ed25519 signature over its canonical JSON (written
    as an envelope by ``to_json``)."""
    signature = signature_for(signing_payload(manifest), SIGNS_MANIFEST, private_key)
    return replace(manifest, signature=signature)


def verify_signature(manifest: Manifest, public_key: Ed25519PublicKey | bytes) -> None:
    """SignatureError unless the manifest carries a valid signature by ``public_key``."""
    name = f"{manifest.kind} {manifest.version} of run {manifest.run}"
    sig = manifest.signature
    if sig is None:
        raise SignatureError(f"{name} is not signed")
    check_header(sig, SIGNS_MANIFEST, public_key, name)
    if sealed.digest(signing_payload(manifest)) != (sig.get("sha256"), sig.get("size")):
        raise SignatureError(f"{name} has an invalid signature")


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
