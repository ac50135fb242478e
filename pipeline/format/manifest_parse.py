"""Parsing a manifest: every field a reader relies on is checked before it is trusted.

Object keys stay inside the version folder, sizes and shapes are sane, every tensor's
object is listed and the state hash agrees with the tensor hashes. Any fault is a
one-line ``CorruptObjectError`` naming the manifest and the field.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from typing import Any, cast

from pipeline.errors import CodecError, CorruptObjectError, DeltasyncError, MismatchError
from pipeline.format import sealed
from pipeline.format.bounded import load_json
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import (
    DTYPE_WIDTHS,
    KINDS,
    MAX_ELEMENTS,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_OBJECT_SIZE,
    MAX_PIECES,
    MAX_TENSOR_NAME,
    MAX_VERSION,
    PIECES_SCHEMA,
    RUN_PATTERN,
    SCHEMA1_CONTENT_HASH,
    SUPPORTED_SCHEMAS,
    CodecInfo,
    Kind,
    Manifest,
    ObjectEntry,
    Piece,
    TensorEntry,
    check_object_key,
    compute_state_hash,
)
from pipeline.format.regions import Region, tiling_error

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FORM = re.compile(r"^[a-z_]{1,32}$")  # checkpoint_names.TENSOR_FORMS, and later


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
        "instance",
        "tensor_form",
        "content_hash",
    }
)
_REQUIRED_KEYS = _TOP_KEYS - {
    "parent_state_hash",
    "extra",
    "signature",
    "instance",
    "tensor_form",
    "content_hash",
}


class FieldCheck:
    """Field validation that names the document (a ``kind`` from ``source``) and the
    field at fault. ``strict`` (rank layouts): every key present and patterns matched
    whole; else (manifests) only unknown keys refused, patterns matched from the start."""

    def __init__(
        self,
        source: str,
        kind: str = "manifest",
        error: type[DeltasyncError] = CorruptObjectError,
        strict: bool = False,
    ) -> None:
        self.source, self.kind, self.error, self.strict = source, kind, error, strict

    def fail(self, what: str) -> DeltasyncError:
        return self.error(f"{self.kind} {self.source}: {what}")

    def obj(self, value: object, what: str, keys: frozenset[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} is not an object")
        if self.strict and set(value) != keys:
            odd = sorted(set(value) ^ keys)[0]
            raise self.fail(f"{what} has a missing or unknown field {str(odd)[:40]!r}")
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
        if pattern is not None and not (pattern.fullmatch if self.strict else pattern.match)(value):
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
    """Parse and validate a manifest, plain or in its signed envelope (whose signature
    this does not check: see ``signing.verify_sealed``); CorruptObjectError (CodecError
    for an unknown schema)."""
    c = FieldCheck(source)
    raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_MANIFEST_BYTES + sealed.HEADER_BYTES:
        raise c.fail(f"{len(raw)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
    payload, signature = sealed.unwrap(raw, f"manifest {source}")
    doc = load_manifest_json(payload, source)
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
    algorithm = _parse_content_hash(c, schema, doc.get("content_hash"))
    tensors = _parse_tensors(c, doc["tensors"], object_keys, schema, algorithm)
    if schema >= PIECES_SCHEMA and not any(t.pieces for t in tensors):
        raise c.fail(f"schema {schema} is for tensors in pieces, and none is")

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
    # A "signature" member is the in-document signature of earlier releases: readable
    # without a key, never trusted (a reader with a key wants the envelope's).
    if doc.get("signature") is not None:
        c.obj(doc["signature"], "signature", frozenset({"alg", "key_id", "sig"}))
    instance_raw = doc.get("instance")
    instance = None if instance_raw is None else c.string(instance_raw, "instance", _HEX32)
    form = doc.get("tensor_form")
    tensor_form = None if form is None else c.string(form, "tensor_form", _FORM)

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
        instance=instance,
        tensor_form=tensor_form,
        content_hash=algorithm,
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


def load_manifest_json(data: bytes | str, source: str) -> Any:
    """A manifest's JSON, size- and depth-bounded; CorruptObjectError naming ``source``."""
    return load_json(
        data, max_bytes=MAX_MANIFEST_BYTES, what=f"manifest {source}", error=CorruptObjectError
    )


def _parse_content_hash(c: FieldCheck, schema: int, raw: object) -> str:
    """Schema 1 names no algorithm (xxh3-128); schema 2 names a known one."""
    if schema < 2:
        if raw is not None:
            raise c.fail(f"schema {schema} names no content_hash")
        return SCHEMA1_CONTENT_HASH
    name = c.string(raw, "content_hash")
    if name not in content_hashes.ALGORITHMS:
        raise c.fail(
            f"content_hash {name[:40]!r} is not one of {sorted(content_hashes.ALGORITHMS)}"
        )
    return name


def _parse_objects(c: FieldCheck, raw: object) -> tuple[ObjectEntry, ...]:
    if not isinstance(raw, list):
        raise c.fail("objects is not a list")
    out: list[ObjectEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        o = c.obj(item, f"objects[{i}]", frozenset({"key", "size", "sha256"}))
        key = o.get("key")
        check_object_key(cast(str, key), c.source)
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
    return _check_tensor_name(FieldCheck(source), name)


def _check_tensor_name(c: FieldCheck, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise c.fail("a tensor name is empty or not a string")
    if len(name) > MAX_TENSOR_NAME or not name.isprintable():
        raise c.fail(f"tensor name {name[:80]!r} is too long or has control characters")
    return name


def _parse_tensors(
    c: FieldCheck, raw: object, object_keys: set[str], schema: int, algorithm: str
) -> tuple[TensorEntry, ...]:
    if not isinstance(raw, list):
        raise c.fail("tensors is not a list")
    fields = frozenset({"name", "dtype", "shape", "hash", "object", "changed"})
    if schema >= PIECES_SCHEMA:
        fields |= {"pieces"}
    out: list[TensorEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        t = c.obj(item, f"tensors[{i}]", fields)
        name = _check_tensor_name(c, t.get("name"))
        if name in seen:
            raise c.fail(f"tensor {name!r} is listed twice")
        seen.add(name)
        dtype = t.get("dtype")
        if dtype not in DTYPE_WIDTHS:
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
        entry = TensorEntry(
            name=name,
            dtype=cast(str, dtype),
            shape=shape,
            hash=c.string(t.get("hash"), f"hash of tensor {name!r}", _HEX32),
            object=cast(str, obj),
            changed=c.integer(t.get("changed", 0), f"changed of tensor {name!r}", 0, numel),
        )
        if "pieces" in t:
            pieces = _parse_pieces(c, t["pieces"], entry, object_keys, algorithm)
            entry = dataclasses.replace(entry, pieces=pieces)
        out.append(entry)
    return tuple(out)


def _parse_pieces(
    c: FieldCheck, raw: object, entry: TensorEntry, object_keys: set[str], algorithm: str
) -> tuple[Piece, ...]:
    """A tensor's pieces: in order, covering every element once, in listed objects (one
    piece per object), their hashes and changes summing to the tensor's."""
    name = entry.name
    if not isinstance(raw, list) or not raw or len(raw) > MAX_PIECES:
        raise c.fail(f"tensor {name!r} has a malformed piece list")
    if not content_hashes.get(algorithm).incremental:
        raise c.fail(f"tensor {name!r} is in pieces, which content hash {algorithm} cannot sum")
    flat_fields = frozenset({"object", "start", "stop", "hash", "changed"})
    box_fields = frozenset({"object", "offset", "size", "hash", "changed"})
    pieces: list[Piece] = []
    for i, item in enumerate(raw):
        what = f"piece {i} of tensor {name!r}"
        boxed = isinstance(item, dict) and "size" in item
        p = c.obj(item, what, box_fields if boxed else flat_fields)
        obj = p.get("object")
        if obj not in object_keys:
            raise c.fail(f"{what} names object {obj!r}, which is not listed")
        if boxed:
            offset, size = (
                tuple(c.integer(n, f"{key} of {what}", 0, MAX_ELEMENTS) for n in _dims(c, p, key))
                for key in ("offset", "size")
            )
            try:
                region = Region(entry.shape, offset, size)
            except MismatchError as exc:
                raise c.fail(f"{what}: {exc}") from None
        else:
            start = c.integer(p.get("start"), f"start of {what}", 0, MAX_ELEMENTS)
            stop = c.integer(p.get("stop"), f"stop of {what}", 0, MAX_ELEMENTS)
            if not start < stop <= entry.numel:
                raise c.fail(f"pieces of tensor {name!r} do not cover it in order")
            region = Region.flat(entry.numel, start, stop)
        piece = Piece.at(
            cast(str, obj),
            region,
            c.string(p.get("hash"), f"hash of {what}", _HEX32),
            c.integer(p.get("changed", 0), f"changed of {what}", 0),
        )
        if pieces and piece.start <= pieces[-1].start:
            raise c.fail(f"pieces of tensor {name!r} do not cover it in order")
        pieces.append(piece)
    gap = tiling_error(entry.numel, [p.region(entry.shape) for p in pieces])
    if gap is not None:
        raise c.fail(f"pieces of tensor {name!r}: {gap}")
    if len({p.object for p in pieces}) != len(pieces):
        raise c.fail(f"tensor {name!r} has two pieces in one object")
    if pieces[0].object != entry.object:
        raise c.fail(f"tensor {name!r} names object {entry.object!r}, not its first piece's")
    if any(p.changed > p.numel for p in pieces) or sum(p.changed for p in pieces) != entry.changed:
        raise c.fail(f"changed counts of the pieces of tensor {name!r} do not add up")
    if content_hashes.get(algorithm).combine([p.hash for p in pieces]) != entry.hash:
        raise c.fail(f"hashes of the pieces of tensor {name!r} do not sum to its hash")
    return tuple(pieces)


def _dims(c: FieldCheck, p: dict[str, Any], key: str) -> list[object]:
    dims = p.get(key)
    if not isinstance(dims, list) or len(dims) > MAX_NDIM:
        raise c.fail(f"a piece's {key} is not a list of at most {MAX_NDIM} integers")
    return dims
