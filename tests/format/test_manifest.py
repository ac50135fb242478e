"""Manifests: canonical JSON, strict validation, keys, Ed25519 signatures."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.errors import CodecError, ConfigError, CorruptObjectError, SignatureError
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    manifest_key,
    object_key,
    to_json,
)
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.signing import (
    generate_keypair,
    load_public_key,
    private_key_from,
    sign,
    verify_signature,
)

SHA = "ab" * 32


def sample(**changes: Any) -> Manifest:
    tensors = (
        TensorEntry(
            "model.layers.0.w",
            "bfloat16",
            (4, 8),
            content_hash(torch.zeros(4, 8)),
            "part-00000.safetensors",
            3,
        ),
        TensorEntry(
            "lm_head.weight",
            "float32",
            (0,),
            content_hash(torch.zeros(0)),
            "part-00001.safetensors",
        ),
    )
    base = Manifest(
        run="run-1",
        version=12,
        kind="delta",
        parent=10,
        anchor=0,
        codec=CodecInfo("deltasync-bitdelta", 1, 2),
        objects=(
            ObjectEntry("part-00000.safetensors", 123, SHA),
            ObjectEntry("part-00001.safetensors", 45, "cd" * 32),
        ),
        tensors=tensors,
        state_hash=compute_state_hash(tensors),
        created="2026-11-29T08:00:00.000Z",
        extra={"changed": 3},
        parent_state_hash="0" * 32,
    )
    return replace(base, **changes)


def test_round_trip_and_canonical_bytes() -> None:
    m = sample()
    data = to_json(m)
    assert data == to_json(parse_manifest(data))
    assert parse_manifest(data) == m
    doc = json.loads(data)
    assert list(doc) == sorted(doc)
    assert b" " not in data and b"\n" not in data
    # Field order in the source does not change the canonical form.
    shuffled = json.dumps(dict(reversed(list(doc.items())))).encode()
    assert to_json(parse_manifest(shuffled)) == data


def test_first_anchor_has_no_parent() -> None:
    m = sample(kind="anchor", parent=None, anchor=12, codec=CodecInfo("safetensors", 1))
    assert parse_manifest(to_json(m)).parent is None


def test_keys() -> None:
    assert manifest_key("run-1", "delta", 42) == "run-1/deltas/0000000042/manifest.json"
    assert manifest_key("r", "anchor", 0) == "r/anchors/0000000000/manifest.json"
    assert object_key("r", "delta", 7, "part-00003.safetensors") == (
        "r/deltas/0000000007/part-00003.safetensors"
    )
    assert sample().key == "run-1/deltas/0000000012/manifest.json"
    for bad_run in ("", "-x", "a/b", "a" * 129, "ü"):
        with pytest.raises(ConfigError):
            manifest_key(bad_run, "delta", 1)
    with pytest.raises(ConfigError):
        manifest_key("r", "delta", -1)
    with pytest.raises(CorruptObjectError):
        object_key("r", "delta", 1, "../escape")


Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        target: Any = doc
        parts = path.split(".")
        for p in parts[:-1]:
            target = target[int(p)] if p.isdigit() else target[p]
        last = parts[-1]
        if last.isdigit():
            target[int(last)] = value
        else:
            target[last] = value

    return edit


BAD: dict[str, tuple[Edit, str]] = {
    "traversal key": (_set("objects.0.key", "../../etc/passwd"), "not a plain name"),
    "slash key": (_set("objects.0.key", "sub/part.safetensors"), "not a plain name"),
    "control key": (_set("objects.0.key", "part\n.safetensors"), "not a plain name"),
    "manifest as object": (_set("objects.0.key", "manifest.json"), "not a plain name"),
    "control in name": (_set("tensors.0.name", "evil\x1b[2Jname"), "control characters"),
    "empty name": (_set("tensors.0.name", ""), "empty"),
    "unknown dtype": (_set("tensors.0.dtype", "float128"), "unknown dtype"),
    "negative dim": (_set("tensors.0.shape", [4, -8]), "out of range"),
    "absurd size": (_set("tensors.0.shape", [1 << 30, 1 << 30]), "absurd"),
    "float dim": (_set("tensors.0.shape", [4.0, 8]), "not an integer"),
    "unlisted object": (_set("tensors.0.object", "part-00099.safetensors"), "not listed"),
    "negative size": (_set("objects.0.size", -1), "out of range"),
    "huge size": (_set("objects.0.size", 1 << 60), "out of range"),
    "bad sha": (_set("objects.0.sha256", "xyz"), "malformed"),
    "bad hash": (_set("tensors.0.hash", "00"), "malformed"),
    "state hash": (_set("state_hash", "f" * 32), "state_hash"),
    "run name": (_set("run", "../other"), "run"),
    "version bool": (_set("version", True), "version"),
    "parent newer": (_set("parent", 13), "parent"),
    "delta without parent": (_set("parent", None), "no parent"),
    "changed > numel": (_set("tensors.0.changed", 33), "out of range"),
    "unknown field": (_set("surprise", 1), "unknown field"),
    "kind": (_set("kind", "snapshot"), "kind"),
    "created": (_set("created", "yesterday"), "ISO"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_rejects_bad_fields(case: str) -> None:
    edit, message = BAD[case]
    doc = json.loads(to_json(sample()))
    edit(doc)
    with pytest.raises(CorruptObjectError, match=message) as info:
        parse_manifest(json.dumps(doc).encode(), source="r/deltas/12/manifest.json")
    assert "r/deltas/12/manifest.json" in str(info.value)
    assert "\n" not in str(info.value)


def test_duplicates_are_rejected() -> None:
    doc = json.loads(to_json(sample()))
    doc["tensors"].append(dict(doc["tensors"][0]))
    with pytest.raises(CorruptObjectError, match="twice"):
        parse_manifest(json.dumps(doc))
    doc = json.loads(to_json(sample()))
    doc["objects"].append(dict(doc["objects"][0]))
    with pytest.raises(CorruptObjectError, match="twice"):
        parse_manifest(json.dumps(doc))


def test_unknown_schema_is_a_codec_error() -> None:
    doc = json.loads(to_json(sample()))
    doc["schema"] = 99
    with pytest.raises(CodecError, match="schema 99"):
        parse_manifest(json.dumps(doc), source="m.json")


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"\xff\xfe", b'{"schema": 1}'])
def test_garbage_is_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptObjectError, match=r"m\.json"):
        parse_manifest(data, source="m.json")


def test_expected_run_version_kind() -> None:
    data = to_json(sample())
    parse_manifest(data, expected_run="run-1", expected_version=12, expected_kind="delta")
    with pytest.raises(CorruptObjectError, match="run 'run-1'"):
        parse_manifest(data, expected_run="run-2")
    with pytest.raises(CorruptObjectError, match="version 12"):
        parse_manifest(data, expected_version=13)
    with pytest.raises(CorruptObjectError, match="anchor"):
        parse_manifest(data, expected_kind="anchor")


def test_parts_group_tensors_by_object() -> None:
    assert sample().parts() == [
        ("part-00000.safetensors", ["model.layers.0.w"]),
        ("part-00001.safetensors", ["lm_head.weight"]),
    ]


def test_sign_and_verify_round_trip(tmp_path: Path) -> None:
    private_path, public_path = generate_keypair(tmp_path / "keys")
    assert private_path.stat().st_mode & 0o077 == 0
    key, pub = private_key_from(private_path.read_bytes()), load_public_key(public_path)
    signed = sign(sample(), key)
    assert signed.signature is not None and signed.signature["alg"] == "ed25519"
    reparsed = parse_manifest(to_json(signed))
    verify_signature(reparsed, pub)
    verify_signature(reparsed, public_path.read_bytes())  # PEM bytes as settings hold them
    sign(sample(), private_path.read_bytes())  # likewise for the private key
    with pytest.raises(ConfigError, match="already exists"):
        generate_keypair(tmp_path / "keys")


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: replace(m, version=13),
        lambda m: replace(m, parent=9),
        lambda m: replace(m, objects=(replace(m.objects[0], sha256="ee" * 32), m.objects[1])),
        lambda m: replace(m, extra={"changed": 4}),
        lambda m: replace(m, parent_state_hash="1" * 32),
    ],
)
def test_tampering_is_detected(tamper: Callable[[Manifest], Manifest]) -> None:
    key = Ed25519PrivateKey.generate()
    signed = sign(sample(), key)
    verify_signature(signed, key.public_key())
    with pytest.raises(SignatureError, match="invalid signature"):
        verify_signature(tamper(signed), key.public_key())


def test_wrong_key_unsigned_and_bad_signature() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    signed = sign(sample(), key)
    with pytest.raises(SignatureError, match="not the trusted key"):
        verify_signature(signed, other.public_key())
    with pytest.raises(SignatureError, match="not signed"):
        verify_signature(sample(), key.public_key())
    assert signed.signature is not None
    garbled = replace(signed, signature={**signed.signature, "sig": "%%%"})
    with pytest.raises(SignatureError, match="invalid signature"):
        verify_signature(garbled, key.public_key())
    forged = replace(signed, signature={**signed.signature, "alg": "none"})
    with pytest.raises(SignatureError, match="algorithm"):
        verify_signature(forged, key.public_key())
