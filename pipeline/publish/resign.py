"""Re-signing a run stored by an earlier release: its manifests signed inside the
document (a ``signature`` member) move to the signed envelope readers now require
(docs/FORMAT.md, Signatures), and its ``run.json`` is signed.

A manifest is re-signed only when its old signature is valid for the key's public
half and it belongs to the run's instance (or predates instance ids, when it is given
the instance): an unsigned or foreign manifest is left as it is, and stays refused by
nodes with the verify key. Nothing else of a version changes.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.errors import DeltasyncError
from pipeline.format import sealed
from pipeline.format.manifest import KIND_FOLDERS, MAX_MANIFEST_BYTES, manifest_key, to_json
from pipeline.format.manifest_parse import load_manifest_json, parse_manifest
from pipeline.format.signing import (
    SIGNATURE_ALG,
    SIGNS_MANIFEST,
    check_header,
    key_id,
    private_key_from,
    sign,
)
from pipeline.store.base import ObjectStore, read_bounded
from pipeline.versions import binding as run_binding
from pipeline.versions.index import list_versions


@dataclass
class Resigned:
    run: str
    resigned: list[str] = field(default_factory=list)  # manifest keys moved to the envelope
    current: int = 0  # already in the envelope, signed by this key
    refused: list[str] = field(default_factory=list)  # "key: why", left as they are

    def describe(self) -> str:
        return (
            f"run {self.run}: {len(self.resigned)} manifest(s) re-signed, {self.current} "
            f"already signed, {len(self.refused)} left unsigned"
        )


def old_signature_valid(doc: object, private_key: Ed25519PrivateKey) -> bool:
    """Whether ``doc`` (a decoded manifest) carries an in-document signature of an earlier
    release by ``private_key``'s public half, over its canonical JSON less that member."""
    if not isinstance(doc, dict) or not isinstance(doc.get("signature"), dict):
        return False
    sig = doc["signature"]
    public = private_key.public_key()
    if sig.get("alg") != SIGNATURE_ALG or sig.get("key_id") != key_id(public):
        return False
    try:
        payload = sealed.canonical({k: v for k, v in doc.items() if k != "signature"})
        public.verify(base64.b64decode(str(sig.get("sig", "")), validate=True), payload)
    except (InvalidSignature, binascii.Error, ValueError, TypeError, RecursionError):
        return False
    return True


def resign_run(store: ObjectStore, run: str, signing_key: Ed25519PrivateKey | bytes) -> Resigned:
    """Move every manifest of ``run`` validly signed by ``signing_key`` in the old form
    to the envelope, and sign the run's record."""
    key = private_key_from(signing_key)
    out = Resigned(run)
    record = run_binding.instance_for_publish(store, run, key)
    index = list_versions(store, run)
    for kind, versions in (("anchor", index.anchors), ("delta", index.deltas)):
        assert kind in KIND_FOLDERS
        for version in versions:
            name = manifest_key(run, kind, version)
            data = read_bounded(store, name, MAX_MANIFEST_BYTES, what="manifest")
            found = sealed.header(data, name) if sealed.is_sealed(data) else None
            if found is not None:
                try:
                    check_header(found.signature, SIGNS_MANIFEST, key.public_key(), name)
                    out.current += 1
                except DeltasyncError as exc:
                    out.refused.append(f"{name}: {exc}")
                continue
            try:
                doc = load_manifest_json(data, name)
                if not old_signature_valid(doc, key):
                    out.refused.append(f"{name}: not signed by this key")
                    continue
                manifest = parse_manifest(
                    data, expected_run=run, expected_version=version, source=name
                )
            except DeltasyncError as exc:
                out.refused.append(f"{name}: {exc}")
                continue
            if manifest.instance not in (None, record.instance):
                out.refused.append(f"{name}: of another instance of the run")
                continue
            # Signed now, it binds to the run's instance like every new manifest.
            manifest = replace(manifest, instance=record.instance)
            store.put(name, to_json(sign(manifest, key)))
            out.resigned.append(name)
    return out
