"""Version manifests: the versioned JSON document that makes a version exist.

A manifest names the run, the version, its parent, the anchor its chain
starts from, the codec, every object (size, sha256) and every tensor (name,
dtype, shape, content hash, the object that holds it). It is written last;
a version exists when, and only when, its manifest does.

Serialisation is canonical (sorted keys, no whitespace) so that the same
manifest always gives the same bytes, which is what a signature covers.
Parsing validates everything a reader relies on before it trusts a field:
object keys stay inside the version folder, sizes and shapes are sane, every
tensor's object is listed and the state hash agrees with the tensor hashes.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from pipeline.errors import (
    CodecError,
    ConfigError,
    CorruptObjectError,
    MismatchError,
)
from pipeline.hashing import state_hash

SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = frozenset({1})
MANIFEST_NAME = "manifest.json"

Kind = Literal["delta", "anchor"]
KINDS: tuple[Kind, ...] = ("delta", "anchor")
KIND_FOLDERS: dict[str, str] = {"delta": "deltas", "anchor": "anchors"}

RUN_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OBJECT_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

MAX_VERSION = 10**10 - 1  # folder names are 10 digits
MAX_OBJECT_SIZE = 1 << 44  # 16 TiB: far above any real part, far below overflow
MAX_ELEMENTS = 1 << 44
MAX_NDIM = 16
MAX_TENSOR_NAME = 1024
MAX_MANIFEST_BYTES = 256 << 20


# Every dtype deltasync moves, by its torch name without "torch.".
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["float8_e8m0fnu"] = torch.float8_e8m0fnu
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; MismatchError for dtypes deltasync cannot move."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise MismatchError(f"unsupported dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise MismatchError(f"unknown dtype {name!r}") from None


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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


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
    parent_state_hash: str | None = None  # state hash of the parent version

    @property
    def key(self) -> str:
        """The store key of this manifest."""
        return manifest_key(self.run, self.kind, self.version)

    def object_key(self, key: str) -> str:
        """The store key of one of this manifest's objects."""
        return object_key(self.run, self.kind, self.version, key)

    def tensor(self, name: str) -> TensorEntry:
        for entry in self.tensors:
            if entry.name == name:
                return entry
        raise MismatchError(f"tensor {name!r} is not in {self.kind} {self.version} of {self.run}")

    def object_entry(self, key: str) -> ObjectEntry:
        for entry in self.objects:
            if entry.key == key:
                return entry
        raise CorruptObjectError(f"object {key!r} is not listed in manifest {self.key}")

    def parts(self) -> list[tuple[str, list[str]]]:
        """Objects in order of first use, each with the tensors it holds in manifest order."""
        groups: dict[str, list[str]] = {}
        for entry in self.tensors:
            groups.setdefault(entry.object, []).append(entry.name)
        return list(groups.items())

    @property
    def total_bytes(self) -> int:
        """Bytes of all objects this version stores."""
        return sum(o.size for o in self.objects)


# ---------------------------------------------------------------- keys


def check_run(run: str) -> str:
    if not isinstance(run, str) or not RUN_PATTERN.match(run):
        raise ConfigError(f"invalid run name {run!r}: use [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return run


def version_prefix(run: str, kind: Kind | str, version: int) -> str:
    """``<run>/deltas/<version:010d>/`` (or ``anchors``), the folder of one version."""
    check_run(run)
    if kind not in KIND_FOLDERS:
        raise ConfigError(f"unknown version kind {kind!r}")
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or not (0 <= version <= MAX_VERSION)
    ):
        raise ConfigError(f"invalid version {version!r} for run {run}")
    return f"{run}/{KIND_FOLDERS[kind]}/{version:010d}/"


def manifest_key(run: str, kind: Kind | str, version: int) -> str:
    return version_prefix(run, kind, version) + MANIFEST_NAME


def object_key(run: str, kind: Kind | str, version: int, key: str) -> str:
    _check_object_key(key, f"{run}/{kind}/{version}")
    return version_prefix(run, kind, version) + key


def _check_object_key(key: str, source: str) -> None:
    if (
        not isinstance(key, str)
        or not OBJECT_KEY_PATTERN.match(key)
        or ".." in key
        or key == MANIFEST_NAME
    ):
        raise CorruptObjectError(f"manifest {source}: object key {key!r} is not a plain name")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def compute_state_hash(tensors: tuple[TensorEntry, ...] | list[TensorEntry]) -> str:
    return state_hash((t.name, t.hash) for t in tensors)


# ---------------------------------------------------------------- JSON


def to_dict(manifest: Manifest, *, with_signature: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": manifest.schema,
        "run": manifest.run,
        "version": manifest.version,
        "kind": manifest.kind,
        "parent": manifest.parent,
        "anchor": manifest.anchor,
        "codec": {
            "name": manifest.codec.name,
            "version": manifest.codec.version,
            "level": manifest.codec.level,
        },
        "objects": [{"key": o.key, "size": o.size, "sha256": o.sha256} for o in manifest.objects],
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "hash": t.hash,
                "object": t.object,
                "changed": t.changed,
            }
            for t in manifest.tensors
        ],
        "state_hash": manifest.state_hash,
        "parent_state_hash": manifest.parent_state_hash,
        "created": manifest.created,
        "extra": manifest.extra,
    }
    if with_signature and manifest.signature is not None:
        doc["signature"] = dict(manifest.signature)
    return doc


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def to_json(manifest: Manifest) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, ASCII only."""
    try:
        return _dumps(to_dict(manifest))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"manifest {manifest.run}/{manifest.version} is not JSON: {e}") from e


def signing_payload(manifest: Manifest) -> bytes:
    """The bytes a signature covers: the canonical JSON without the signature field."""
    return _dumps(to_dict(manifest, with_signature=False))


_TOP_KEYS = frozenset(
    {
        "schema",
        "run",
        "version",
        "kind",
        "parent",
        "anchor",
        "codec",
        "objects",
        "tensors",
        "state_hash",
        "parent_state_hash",
        "created",
        "extra",
        "signature",
    }
)
_REQUIRED_KEYS = _TOP_KEYS - {"parent_state_hash", "extra", "signature"}


class _Checker:
    """Field validation that names the manifest and the field at fault."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, what: str) -> CorruptObjectError:
        return CorruptObjectError(f"manifest {self.source}: {what}")

    def obj(self, value: object, what: str, keys: frozenset[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} is not an object")
        unknown = set(value) - keys
        if unknown:
            raise self.fail(f"{what} has unknown field {sorted(unknown)[0]!r}")
        return cast(dict[str, Any], value)

    def integer(self, value: object, what: str, lo: int = 0, hi: int = MAX_OBJECT_SIZE) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{what} is not an integer")
        if not lo <= value <= hi:
            raise self.fail(f"{what} {value} is out of range [{lo}, {hi}]")
        return value

    def string(self, value: object, what: str, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{what} is not a string")
        if pattern is not None and not pattern.match(value):
            raise self.fail(f"{what} {value[:80]!r} is malformed")
        return value


def parse_manifest(
    data: bytes | str,
    *,
    expected_run: str | None = None,
    expected_version: int | None = None,
    expected_kind: Kind | None = None,
    source: str = "<manifest>",
) -> Manifest:
    """Parse and validate a manifest; CorruptObjectError (CodecError for an unknown schema)."""
    c = _Checker(source)
    if len(data) > MAX_MANIFEST_BYTES:
        raise c.fail(f"{len(data)} bytes is too large")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise c.fail(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise c.fail("is not a JSON object")
    schema = doc.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise c.fail("schema is missing or not an integer")
    if schema not in SUPPORTED_SCHEMAS:
        raise CodecError(
            f"manifest {source}: unsupported schema {schema} "
            f"(supported: {', '.join(map(str, sorted(SUPPORTED_SCHEMAS)))})"
        )
    doc = c.obj(doc, "manifest", _TOP_KEYS)
    missing = _REQUIRED_KEYS - set(doc)
    if missing:
        raise c.fail(f"field {sorted(missing)[0]!r} is missing")

    run = c.string(doc["run"], "run", RUN_PATTERN)
    version = c.integer(doc["version"], "version", 0, MAX_VERSION)
    kind = doc["kind"]
    if kind not in KINDS:
        raise c.fail(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    parent_raw = doc["parent"]
    parent = None if parent_raw is None else c.integer(parent_raw, "parent", 0, MAX_VERSION)
    anchor = c.integer(doc["anchor"], "anchor", 0, MAX_VERSION)
    if parent is not None and parent >= version:
        raise c.fail(f"parent {parent} is not older than version {version}")
    if kind == "delta" and parent is None:
        raise c.fail("a delta has no parent")
    if kind == "anchor" and anchor != version:
        raise c.fail(f"anchor {version} names anchor {anchor}")
    if kind == "delta" and (parent is None or anchor > parent):
        raise c.fail(f"delta {version} names anchor {anchor} newer than its parent")

    codec_doc = c.obj(doc["codec"], "codec", frozenset({"name", "version", "level"}))
    codec = CodecInfo(
        name=c.string(codec_doc.get("name"), "codec name", re.compile(r"^[A-Za-z0-9._-]{1,64}$")),
        version=c.integer(codec_doc.get("version"), "codec version", 0, 1 << 20),
        level=c.integer(codec_doc.get("level", 0), "codec level", 0, 1 << 20),
    )

    objects = _parse_objects(c, doc["objects"])
    object_keys = {o.key for o in objects}
    tensors = _parse_tensors(c, doc["tensors"], object_keys)

    digest = c.string(doc["state_hash"], "state_hash", _HEX32)
    if compute_state_hash(tensors) != digest:
        raise c.fail("state_hash does not match the tensor hashes")
    psh_raw = doc.get("parent_state_hash")
    parent_state = None if psh_raw is None else c.string(psh_raw, "parent_state_hash", _HEX32)
    created = c.string(doc["created"], "created")
    try:
        dt.datetime.fromisoformat(created)
    except ValueError:
        raise c.fail(f"created {created[:40]!r} is not an ISO 8601 time") from None
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise c.fail("extra is not an object")
    signature = _parse_signature(c, doc.get("signature"))

    manifest = Manifest(
        run=run,
        version=version,
        kind=kind,
        parent=parent,
        anchor=anchor,
        codec=codec,
        objects=objects,
        tensors=tensors,
        state_hash=digest,
        created=created,
        schema=schema,
        signature=signature,
        extra=extra,
        parent_state_hash=parent_state,
    )
    if expected_run is not None and run != expected_run:
        raise CorruptObjectError(f"manifest {source} is for run {run!r}, expected {expected_run!r}")
    if expected_version is not None and version != expected_version:
        raise CorruptObjectError(
            f"manifest {source} is for version {version}, expected {expected_version}"
        )
    if expected_kind is not None and kind != expected_kind:
        raise CorruptObjectError(f"manifest {source} is a {kind}, expected a {expected_kind}")
    return manifest


def _parse_objects(c: _Checker, raw: object) -> tuple[ObjectEntry, ...]:
    if not isinstance(raw, list):
        raise c.fail("objects is not a list")
    out: list[ObjectEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        o = c.obj(item, f"objects[{i}]", frozenset({"key", "size", "sha256"}))
        key = o.get("key")
        _check_object_key(cast(str, key), c.source)
        if key in seen:
            raise c.fail(f"object {key!r} is listed twice")
        seen.add(cast(str, key))
        out.append(
            ObjectEntry(
                key=cast(str, key),
                size=c.integer(o.get("size"), f"size of object {key}"),
                sha256=c.string(o.get("sha256"), f"sha256 of object {key}", _HEX64),
            )
        )
    return tuple(out)


def check_tensor_name(name: object, source: str) -> str:
    """``name`` if a manifest may carry it, else CorruptObjectError naming ``source``."""
    return _check_tensor_name(_Checker(source), name)


def _check_tensor_name(c: _Checker, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise c.fail("a tensor name is empty or not a string")
    if len(name) > MAX_TENSOR_NAME or not name.isprintable():
        raise c.fail(f"tensor name {name[:80]!r} is too long or has control characters")
    return name


def _parse_tensors(c: _Checker, raw: object, object_keys: set[str]) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list):
        raise c.fail("tensors is not a list")
    fields = frozenset({"name", "dtype", "shape", "hash", "object", "changed"})
    out: list[TensorEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        t = c.obj(item, f"tensors[{i}]", fields)
        name = _check_tensor_name(c, t.get("name"))
        if name in seen:
            raise c.fail(f"tensor {name!r} is listed twice")
        seen.add(name)
        dtype = t.get("dtype")
        if dtype not in DTYPES:
            raise c.fail(f"tensor {name!r} has unknown dtype {dtype!r}")
        shape_raw = t.get("shape")
        if not isinstance(shape_raw, list) or len(shape_raw) > MAX_NDIM:
            raise c.fail(f"tensor {name!r} has a malformed shape")
        shape = tuple(c.integer(d, f"shape of tensor {name!r}", 0, MAX_ELEMENTS) for d in shape_raw)
        numel = math.prod(shape)
        if numel > MAX_ELEMENTS:
            raise c.fail(f"tensor {name!r} has an absurd size {numel}")
        obj = t.get("object")
        if obj not in object_keys:
            raise c.fail(f"tensor {name!r} names object {obj!r}, which is not listed")
        out.append(
            TensorEntry(
                name=name,
                dtype=cast(str, dtype),
                shape=shape,
                hash=c.string(t.get("hash"), f"hash of tensor {name!r}", _HEX32),
                object=cast(str, obj),
                changed=c.integer(t.get("changed", 0), f"changed of tensor {name!r}", 0, numel),
            )
        )
    return tuple(out)


def _parse_signature(c: _Checker, raw: object) -> dict[str, str] | None:
    if raw is None:
        return None
    sig = c.obj(raw, "signature", frozenset({"alg", "key_id", "sig"}))
    return {k: c.string(sig.get(k), f"signature {k}") for k in ("alg", "key_id", "sig")}
