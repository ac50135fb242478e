"""Version manifests: the versioned JSON document that makes a version exist.

A manifest names the run, the version, its parent, the anchor its chain
starts from, the codec, every object (size, sha256) and every tensor (name,
dtype, shape, content hash, the object that holds it). It is written last;
a version exists when, and only when, its manifest does.

Serialisation is canonical (sorted keys, no whitespace) so that the same
manifest always gives the same bytes, which is what a signature covers.
Parsing, which checks every field before a reader trusts it, is in
``manifest_parse``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format import sealed
from pipeline.format.dtype_names import WIDTHS
from pipeline.format.hashes.digests import state_hash
from pipeline.format.regions import Region

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 2
# Schema 3: tensors of a sharded run may be stored in pieces (``TensorEntry.pieces``);
# written only by such runs, so every other manifest stays readable by older builds.
PIECES_SCHEMA = 3
SUPPORTED_SCHEMAS = frozenset({1, 2, 3})
# Schema 1 names no content hash: its tensors carry xxh3-128 (see hashes.content_hashes).
SCHEMA1_CONTENT_HASH = "xxh3-128"
MANIFEST_NAME = "manifest.json"

Kind = Literal["delta", "anchor"]
KINDS: tuple[Kind, ...] = ("delta", "anchor")
KIND_FOLDERS: dict[str, str] = {"delta": "deltas", "anchor": "anchors"}

RUN_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OBJECT_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")

MAX_VERSION = 10**10 - 1  # folder names are 10 digits
MAX_OBJECT_SIZE = 1 << 44  # 16 TiB: far above any real part, far below overflow
MAX_ELEMENTS = 1 << 44
MAX_NDIM = 16
MAX_TENSOR_NAME = 1024
MAX_PIECES = 1 << 16  # of one tensor: one per trainer rank holding some of it
MAX_MANIFEST_BYTES = 256 << 20


# Every dtype a manifest may name (its torch name without "torch."), by element width;
# the torch dtypes are in pipeline/format/tensors.py, looked up when a tensor is built.
DTYPE_WIDTHS = WIDTHS


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; MismatchError for dtypes deltasync cannot move."""
    from pipeline.format.tensors import BY_TORCH

    try:
        return BY_TORCH[dtype].name
    except KeyError:
        raise MismatchError(f"unsupported dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    from pipeline.format.tensors import DTYPES

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
class Piece:
    """What one trainer rank holds of a tensor (a sharded run), stored in ``object`` as
    a 1-D tensor of the tensor's name: flat elements ``[start, stop)``, or with
    ``size`` the box ``offset``/``size`` (per dimension, a DTensor's local chunk), whose
    flat span ``start``/``stop`` then only orders and names it. See
    :mod:`pipeline.format.regions`."""

    object: str
    start: int
    stop: int
    hash: str  # content hash of these elements at their flat positions in the whole tensor
    changed: int = 0  # of these elements, changed against the parent
    offset: tuple[int, ...] = ()
    size: tuple[int, ...] = ()

    @classmethod
    def at(cls, object: str, region: Region, hash: str, changed: int = 0) -> Piece:
        """The piece of ``region``: a flat range, or a box."""
        if region.is_flat:
            return cls(object, region.start, region.stop, hash, changed)
        return cls(object, region.start, region.stop, hash, changed, region.offset, region.size)

    @property
    def is_box(self) -> bool:
        return bool(self.size)

    @property
    def numel(self) -> int:
        return math.prod(self.size) if self.size else self.stop - self.start

    def region(self, shape: tuple[int, ...]) -> Region:
        """Where the piece lies in a tensor of ``shape``."""
        if self.size:
            return Region(tuple(shape), self.offset, self.size)
        return Region.flat(math.prod(shape), self.start, self.stop)

    def describe(self) -> str:
        """``elements [a, b)`` or ``box offset [..] size [..]``, for messages."""
        if self.size:
            return f"box offset {list(self.offset)} size {list(self.size)}"
        return f"elements [{self.start}, {self.stop})"


@dataclass(frozen=True)
class TensorEntry:
    name: str  # checkpoint (HF) name
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    hash: str  # content hash (the manifest's ``content_hash``) at this version
    object: str  # key of the object that holds this tensor's data or delta
    changed: int = 0  # elements changed against the parent (anchors: 0)
    # Schema 3: the tensor stored in pieces over several objects, in order, covering every
    # element once; ``object`` is the first piece's, ``hash`` and ``changed`` their sums.
    pieces: tuple[Piece, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored(self) -> tuple[Piece, ...]:
        """Where the tensor's elements are: its pieces, or one piece of it all."""
        if self.pieces:
            return self.pieces
        return (Piece(self.object, 0, self.numel, self.hash, self.changed),)

    def region(self, piece: Piece) -> Region:
        """Where ``piece`` (one of :attr:`stored`) lies in this tensor."""
        return piece.region(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_WIDTHS[self.dtype]


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
    state_hash: str  # pipeline.format.hashes.hashing.state_hash over (name, hash) of all tensors
    created: str  # ISO 8601 UTC
    schema: int = SCHEMA_VERSION
    # The envelope header that signs it (pipeline.format.sealed), or None: unsigned.
    signature: dict[str, Any] | None = None
    extra: dict[str, object] = field(default_factory=dict)  # stats; never needed to decode
    parent_state_hash: str | None = None  # state hash of the parent version
    instance: str | None = None  # the run instance (pipeline/versions/binding.py); optional
    # How the trainer's tensors were named (format.checkpoints.checkpoint_names); None: unknown.
    tensor_form: str | None = None
    content_hash: str = SCHEMA1_CONTENT_HASH  # algorithm of the tensor hashes (schema 2)

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
        """Objects in order of first use, each with the tensors it holds (whole or a
        piece) in manifest order."""
        return [(key, [e.name for e, _ in held]) for key, held in self.layout()]

    def layout(self) -> list[tuple[str, list[tuple[TensorEntry, Piece]]]]:
        """Objects in order of first use, each with what it holds: (tensor, piece) in
        manifest order, the piece being the whole tensor outside sharded runs."""
        groups: dict[str, list[tuple[TensorEntry, Piece]]] = {}
        for entry in self.tensors:
            for piece in entry.stored:
                groups.setdefault(piece.object, []).append((entry, piece))
        return list(groups.items())

    @property
    def is_pieced(self) -> bool:
        """Whether any tensor is stored in pieces (a sharded run)."""
        return any(t.pieces for t in self.tensors)

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
    check_object_key(key, f"{run}/{kind}/{version}")
    return version_prefix(run, kind, version) + key


def check_object_key(key: str, source: str) -> None:
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


def to_dict(manifest: Manifest) -> dict[str, Any]:
    """The manifest document, without its signature (which is the envelope's)."""
    if manifest.is_pieced and manifest.schema < PIECES_SCHEMA:
        raise ConfigError(f"manifest {manifest.key} has tensors in pieces: schema 3 or later")
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
                **({"pieces": [piece_dict(p) for p in t.pieces]} if t.pieces else {}),
            }
            for t in manifest.tensors
        ],
        "state_hash": manifest.state_hash,
        "parent_state_hash": manifest.parent_state_hash,
        "created": manifest.created,
        "extra": manifest.extra,
    }
    if manifest.instance is not None:  # absent from older manifests, as their signature
        doc["instance"] = manifest.instance
    if manifest.tensor_form is not None:
        doc["tensor_form"] = manifest.tensor_form
    if manifest.schema >= 2:
        doc["content_hash"] = manifest.content_hash
    return doc


def piece_dict(piece: Piece) -> dict[str, Any]:
    """A piece as the manifest (and the vLLM worker protocol) writes it."""
    where: dict[str, Any] = (
        {"offset": list(piece.offset), "size": list(piece.size)}
        if piece.size
        else {"start": piece.start, "stop": piece.stop}
    )
    return {"object": piece.object, **where, "hash": piece.hash, "changed": piece.changed}


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def to_json(manifest: Manifest) -> bytes:
    """Canonical JSON (sorted keys, no whitespace, ASCII only); a signed manifest in its
    envelope (:mod:`pipeline.format.sealed`), the signed bytes being this JSON."""
    payload = signing_payload(manifest)
    if manifest.signature is None:
        return payload
    return sealed.wrap(manifest.signature, payload)


def signing_payload(manifest: Manifest) -> bytes:
    """The manifest's canonical JSON: the bytes its signature covers."""
    try:
        return _dumps(to_dict(manifest))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"manifest {manifest.run}/{manifest.version} is not JSON: {e}") from e
