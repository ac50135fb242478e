"""Version manifests: the versioned JSON document that makes a version exist.

STUB of the data model: field names are final; (de)serialisation and
validation are being written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

Kind = Literal["delta", "anchor"]


@dataclass(frozen=True)
class ObjectEntry:
    key: str  # relative to the manifest's folder, e.g. "part-00000.safetensors"
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    name: str  # checkpoint (HF) name
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    hash: str  # xxh3-128 hex of the tensor's bytes at this version
    object: str  # key of the object that holds this tensor's data or delta
    changed: int = 0  # elements changed against the parent (anchors: 0)


@dataclass(frozen=True)
class CodecInfo:
    name: str  # "deltasync-bitdelta" for deltas, "safetensors" for anchors
    version: int
    level: int = 0


@dataclass(frozen=True)
class Manifest:
    run: str
    version: int
    kind: Kind
    parent: int | None  # previous published version (None only for the first anchor)
    anchor: int  # the anchor version this delta's chain starts from (anchors: own version)
    codec: CodecInfo
    objects: tuple[ObjectEntry, ...]
    tensors: tuple[TensorEntry, ...]
    state_hash: str  # pipeline.hashing.state_hash over (name, hash) of all tensors
    created: str  # ISO 8601 UTC
    schema: int = SCHEMA_VERSION
    signature: dict[str, str] | None = None
    extra: dict[str, object] = field(default_factory=dict)  # stats; never needed to decode
