"""What crosses the vLLM RPC boundary between ``VllmTarget`` and the worker extension.

``collective_rpc`` carries plain data only: an in-process worker gets the objects
as they are, spawned workers get them pickled, the engine-core process of a served
``AsyncLLM`` gets them msgpack-encoded by msgspec (a dataclass arrives there as a
plain dict), and the server's ``POST /collective_rpc`` carries JSON. So requests
travel as the TypedDicts below, and each end works with frozen dataclasses: the
sender builds one and sends ``.wire()``, the receiver ``parse``s what arrived, with a
one-line TargetError naming the field that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict, TypeVar, cast

from pipeline.errors import MismatchError, TargetError
from pipeline.format.manifest import Manifest, Piece, TensorEntry, dtype_name, piece_dict
from pipeline.format.matching import spec_of
from pipeline.format.regions import Region, tiling_error
from pipeline.format.tensors import TensorSpec
from pipeline.targets.base import VerifyMode
from pipeline.targets.patching import check_objects
from pipeline.targets.proving import DEFAULT_PATCH_MEMORY_BYTES

_T = TypeVar("_T")
_VERIFY_MODES: tuple[VerifyMode, ...] = ("touched", "all", "none")


class WireSpec(TypedDict):
    dtype: str  # torch dtype name without "torch.", as in manifests
    shape: list[int]


class WirePiece(TypedDict, total=False):
    """A piece of a tensor of a sharded run (``Piece``), as the manifest writes it: a
    flat range (start, stop) or a box (offset, size)."""

    object: str
    start: int
    stop: int
    offset: list[int]
    size: list[int]
    hash: str
    changed: int


class _WireEntryFields(TypedDict):
    name: str
    dtype: str
    shape: list[int]
    hash: str
    object: str
    changed: int


class WireEntry(_WireEntryFields, total=False):
    """A manifest tensor entry (``TensorEntry``), field by field; ``pieces`` only for
    a tensor stored in pieces."""

    pieces: list[WirePiece]


class PrepareWire(TypedDict, total=False):
    version: int
    verify: str
    parent_state_hash: str | None
    content_hash: str | None
    entries: list[WireEntry]
    objects: dict[str, Any]  # key -> bytes (a file path on the JSON route)
    sha256: dict[str, str]
    early: dict[str, str]
    patch_memory_bytes: int


class SummaryWire(TypedDict):
    tensors: int
    changed: int
    early_tensors: int
    walked: int


def _bad(what: str, problem: str) -> TargetError:
    return TargetError(f"vLLM RPC: bad {what}: {problem}")


def _get(doc: Mapping[str, Any], key: str, kind: type[_T], what: str) -> _T:
    if key not in doc:
        raise _bad(what, f"no {key}")
    value = doc[key]
    # bool is an int to Python, never a count or a version here.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(what, f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _optional_str(doc: Mapping[str, Any], key: str, what: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(what, f"{key} is {type(value).__name__}, not str or null")
    return value


def _mapping(value: object, key: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(what, f"{key} is {type(value).__name__}, not a mapping")
    return value


def _str_map(doc: Mapping[str, Any], key: str, what: str) -> dict[str, str]:
    found = _mapping(doc.get(key) or {}, key, what)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise _bad(what, f"{key} must map str to str")
    return dict(found)


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in value
    ):
        raise _bad(what, f"shape {value!r} is not a list of ints")
    return tuple(value)


# -- specs ------------------------------------------------------------------------------


def specs_to_wire(specs: Mapping[str, TensorSpec]) -> dict[str, WireSpec]:
    return {n: {"dtype": dtype_name(s.dtype), "shape": list(s.shape)} for n, s in specs.items()}


def specs_from_wire(doc: object, what: str = "specs") -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    for name, item in _mapping(doc, what, what).items():
        spec = _mapping(item, f"spec of {name!r}", what)
        entry = TensorEntry(
            str(name), _get(spec, "dtype", str, what), _shape(spec.get("shape"), what), "", ""
        )
        specs[entry.name] = _checked_spec(entry, what)
    return specs


def _checked_spec(entry: TensorEntry, what: str) -> TensorSpec:
    try:
        return spec_of(entry)
    except Exception as exc:  # MismatchError for an unknown dtype
        raise _bad(what, str(exc)) from None


# -- entries ----------------------------------------------------------------------------


def entry_to_wire(entry: TensorEntry) -> WireEntry:
    wire: WireEntry = {
        "name": entry.name,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "hash": entry.hash,
        "object": entry.object,
        "changed": entry.changed,
    }
    if entry.pieces:
        wire["pieces"] = [cast(WirePiece, piece_dict(p)) for p in entry.pieces]
    return wire


def _pieces(item: Mapping[str, Any], entry: TensorEntry, what: str) -> tuple[Piece, ...]:
    """The entry's pieces, if it has any: in order, covering it once, their changes
    adding up (the hashes are proven against the entry's when applied)."""
    raw = item.get("pieces")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise _bad(what, f"pieces of tensor {entry.name!r} are not a list")
    pieces: list[Piece] = []
    for doc in raw:
        p = _mapping(doc, "piece", what)
        try:
            if "size" in p:
                region = Region(
                    entry.shape, _shape(p.get("offset"), what), _shape(p.get("size"), what)
                )
            else:
                start, stop = _get(p, "start", int, what), _get(p, "stop", int, what)
                if not 0 <= start < stop <= entry.numel:
                    raise MismatchError(f"range [{start}, {stop}) is outside the tensor")
                region = Region.flat(entry.numel, start, stop)
        except MismatchError as exc:
            raise _bad(what, f"a piece of tensor {entry.name!r}: {exc}") from None
        piece = Piece.at(
            _get(p, "object", str, what),
            region,
            _get(p, "hash", str, what),
            _get(p, "changed", int, what),
        )
        if not 0 <= piece.changed <= piece.numel:
            raise _bad(what, f"a piece of tensor {entry.name!r} changes {piece.changed}")
        pieces.append(piece)
    gap = tiling_error(entry.numel, [p.region(entry.shape) for p in pieces])
    if gap is not None:
        raise _bad(what, f"pieces of tensor {entry.name!r}: {gap}")
    if sum(p.changed for p in pieces) != entry.changed:
        raise _bad(what, f"pieces of tensor {entry.name!r} do not add up to it")
    if len({p.object for p in pieces}) != len(pieces):
        raise _bad(what, f"tensor {entry.name!r} has two pieces in one object")
    return tuple(pieces)


def entry_from_wire(doc: object, what: str = "prepare request") -> TensorEntry:
    item = _mapping(doc, "entry", what)
    entry = TensorEntry(
        _get(item, "name", str, what),
        _get(item, "dtype", str, what),
        _shape(item.get("shape"), what),
        _get(item, "hash", str, what),
        _get(item, "object", str, what),
        _get(item, "changed", int, what),
    )
    _checked_spec(entry, what)
    pieces = _pieces(item, entry, what)
    return replace(entry, pieces=pieces) if pieces else entry


# -- prepare ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareRequest:
    """A delta for the workers' ``deltasync_prepare``: its entries and objects, how to
    verify it, which objects' early proofs may stand in for their decode, and how much
    host memory its decoded patches may take (above it, tensors the compiled walk
    reads are written by walking their deltas: ``DELTASYNC_PATCH_MEMORY_MB``)."""

    version: int
    verify: VerifyMode
    entries: tuple[TensorEntry, ...]
    objects: Mapping[str, bytes]
    parent_state_hash: str | None = None
    content_hash: str | None = None  # None: keep the algorithm in use
    sha256: Mapping[str, str] = field(default_factory=dict)  # key -> digest, checked there
    early: Mapping[str, str] = field(default_factory=dict)  # key -> sha256 proved early
    patch_memory_bytes: int = DEFAULT_PATCH_MEMORY_BYTES

    @classmethod
    def for_delta(
        cls,
        manifest: Manifest,
        objects: Mapping[str, bytes],
        verify: VerifyMode,
        early: Mapping[str, str] | None = None,
        patch_memory_bytes: int = DEFAULT_PATCH_MEMORY_BYTES,
    ) -> PrepareRequest:
        """The request for a delta whose objects were downloaded (checked here:
        present, sizes and sha256). ``early``: key -> sha256 of the objects the
        workers proved early."""
        check_objects(manifest, objects)
        early = early or {}
        return cls(
            version=manifest.version,
            verify=verify,
            entries=tuple(manifest.tensors),
            objects={o.key: objects[o.key] for o in manifest.objects},
            parent_state_hash=manifest.parent_state_hash,
            content_hash=manifest.content_hash,
            early={o.key: o.sha256 for o in manifest.objects if early.get(o.key) == o.sha256},
            patch_memory_bytes=patch_memory_bytes,
        )

    def wire(self) -> PrepareWire:
        return {
            "version": self.version,
            "verify": self.verify,
            "parent_state_hash": self.parent_state_hash,
            "content_hash": self.content_hash,
            "entries": [entry_to_wire(e) for e in self.entries],
            "objects": dict(self.objects),
            "sha256": dict(self.sha256),
            "early": dict(self.early),
            "patch_memory_bytes": self.patch_memory_bytes,
        }

    @classmethod
    def parse(cls, doc: object) -> PrepareRequest:
        what = "prepare request"
        request = _mapping(doc, "request", what)
        verify = _get(request, "verify", str, what)
        mode = next((m for m in _VERIFY_MODES if m == verify), None)
        if mode is None:
            raise _bad(what, f"verify {verify!r} is not one of {', '.join(_VERIFY_MODES)}")
        entries = _get(request, "entries", list, what)
        objects = _mapping(request.get("objects"), "objects", what)
        for key, data in objects.items():
            if not isinstance(data, bytes | bytearray | memoryview):
                raise _bad(what, f"object {key!r} is {type(data).__name__}, not bytes")
        budget = DEFAULT_PATCH_MEMORY_BYTES
        if "patch_memory_bytes" in request:
            budget = _get(request, "patch_memory_bytes", int, what)
            if budget < 0:
                raise _bad(what, f"patch_memory_bytes is {budget}, not >= 0")
        return cls(
            version=_get(request, "version", int, what),
            verify=mode,
            entries=tuple(entry_from_wire(item, what) for item in entries),
            objects={str(k): bytes(v) for k, v in objects.items()},
            parent_state_hash=_optional_str(request, "parent_state_hash", what),
            content_hash=_optional_str(request, "content_hash", what),
            sha256=_str_map(request, "sha256", what),
            early=_str_map(request, "early", what),
            patch_memory_bytes=budget,
        )


@dataclass(frozen=True)
class PrepareSummary:
    """A worker's answer to a prepare: tensors patched, elements written, tensors
    whose early proofs were used, tensors walked into the shadow (no patch kept)."""

    tensors: int
    changed: int
    early_tensors: int = 0
    walked: int = 0

    def wire(self) -> SummaryWire:
        return cast(SummaryWire, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def parse(cls, doc: object) -> PrepareSummary:
        summary = _mapping(doc, "answer", "prepare answer")
        return cls(*(_get(summary, f.name, int, "prepare answer") for f in fields(cls)))


__all__ = [
    "PrepareRequest",
    "PrepareSummary",
    "PrepareWire",
    "SummaryWire",
    "WireEntry",
    "WirePiece",
    "WireSpec",
    "entry_from_wire",
    "entry_to_wire",
    "specs_from_wire",
    "specs_to_wire",
]
