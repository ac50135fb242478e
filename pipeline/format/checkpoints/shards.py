"""The staging sidecar of one trainer rank in a sharded run: ``pieces.json``.

A rank of a sharded run stages only what it holds, in
``<staging>/<run>/step-<N>/rank-<R>/``: a checkpoint of 1-D tensors (each named by its
full checkpoint name) and this sidecar, which says where each of them lies in the full
tensor: flat elements [start, stop) of a tensor of ``shape``, or a box of it (per
dimension an offset and a size: a DTensor's local chunk; see pipeline.format.regions).
Pieces are listed in the checkpoint's tensor order; zero-size pieces are not staged.

The sidecar is written by the trainer and read by the diff workers of the same host;
it is parsed as untrusted input all the same (bounded, one-line errors).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.bounded import load_json
from pipeline.format.manifest import (
    MAX_ELEMENTS,
    MAX_NDIM,
    MAX_TENSOR_NAME,
    MAX_VERSION,
    RUN_PATTERN,
)
from pipeline.format.manifest_parse import FieldCheck
from pipeline.format.regions import Region
from pipeline.format.tensors import BY_NAME

LAYOUT_NAME = "pieces.json"
MAX_LAYOUT_BYTES = 64 << 20  # ~100 bytes a piece: far above any real model
MAX_WORLD = 100_000  # rank folders are numbered with 5 digits
# The host names a trainer host's diff queue with (pipeline.coord.keys.NODE_PATTERN).
HOST_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TOP_KEYS = frozenset({"run", "step", "rank", "world", "host", "tensors"})
_PIECE_KEYS = frozenset({"name", "dtype", "shape", "start", "stop"})
_BOX_KEYS = frozenset({"name", "dtype", "shape", "offset", "size"})


@dataclass(frozen=True)
class RankPiece:
    """Flat elements [start, stop) of tensor ``name`` (full ``shape``), or with ``size``
    the box ``offset``/``size`` (``start``/``stop`` its flat span), staged as a 1-D
    tensor of its elements of ``dtype`` (a name of pipeline.format.tensors)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    offset: tuple[int, ...] = ()
    size: tuple[int, ...] = ()

    @classmethod
    def at(cls, name: str, dtype: str, shape: tuple[int, ...], region: Region) -> RankPiece:
        """The piece at ``region`` of tensor ``name`` of full ``shape``."""
        if region.is_flat:
            return cls(name, dtype, shape, region.start, region.stop)
        return cls(name, dtype, shape, region.start, region.stop, region.offset, region.size)

    @property
    def region(self) -> Region:
        if self.size:
            return Region(self.shape, self.offset, self.size)
        return Region.flat(math.prod(self.shape), self.start, self.stop)

    @property
    def numel(self) -> int:
        return self.region.numel


@dataclass(frozen=True)
class RankLayout:
    """What one rank staged for one step, in its checkpoint's tensor order."""

    run: str
    step: int
    rank: int
    world: int
    host: str
    pieces: tuple[RankPiece, ...]


def _check_piece(c: FieldCheck, doc: object, i: int) -> RankPiece:
    what = f"tensors[{i}]"
    boxed = isinstance(doc, dict) and "size" in doc
    d = c.obj(doc, what, _BOX_KEYS if boxed else _PIECE_KEYS)
    name = d["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME or _CONTROL.search(name):
        raise c.fail(f"{what}.name is not a tensor name")
    dtype = d["dtype"]
    if not isinstance(dtype, str) or dtype not in BY_NAME:
        raise c.fail(f"{what} ({name[:80]!r}) has unknown dtype {str(dtype)[:40]!r}")
    shape = _dims(c, d["shape"], f"{what} ({name[:80]!r}) shape")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise c.fail(f"{what} ({name[:80]!r}) has {numel} elements, over {MAX_ELEMENTS}")
    if boxed:
        offset = _dims(c, d["offset"], f"{what} ({name[:80]!r}) offset")
        size = _dims(c, d["size"], f"{what} ({name[:80]!r}) size")
        try:
            region = Region(shape, offset, size)
        except MismatchError as exc:
            raise c.fail(f"{what} ({name[:80]!r}): {exc}") from None
        return RankPiece(name, dtype, shape, region.start, region.stop, offset, size)
    start = c.integer(d["start"], f"{what}.start", 0, numel)
    stop = c.integer(d["stop"], f"{what}.stop", 0, numel)
    if stop <= start:
        raise c.fail(f"{what} ({name[:80]!r}) is empty or reversed: [{start}, {stop})")
    return RankPiece(name, dtype, shape, start, stop)


def _dims(c: FieldCheck, value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_NDIM:
        raise c.fail(f"{what} is not a list of at most {MAX_NDIM}")
    return tuple(c.integer(n, what, 0, MAX_ELEMENTS) for n in value)


def _check_layout(c: FieldCheck, doc: object) -> RankLayout:
    d = c.obj(doc, "the document", _TOP_KEYS)
    run = c.string(d["run"], "run", RUN_PATTERN)
    step = c.integer(d["step"], "step", 0, MAX_VERSION)
    world = c.integer(d["world"], "world", 1, MAX_WORLD)
    rank = c.integer(d["rank"], "rank", 0, world - 1)
    host = c.string(d["host"], "host", HOST_PATTERN)
    tensors = d["tensors"]
    if not isinstance(tensors, list | tuple):
        raise c.fail("tensors is not a list")
    pieces = tuple(_check_piece(c, t, i) for i, t in enumerate(tensors))
    seen: set[str] = set()
    for p in pieces:
        if p.name in seen:  # a rank's checkpoint holds one piece per tensor
            raise c.fail(f"tensor {p.name[:80]!r} is listed twice")
        seen.add(p.name)
    return RankLayout(run, step, rank, world, host, pieces)


def _piece_doc(p: RankPiece) -> dict[str, Any]:
    where: dict[str, Any] = (
        {"offset": list(p.offset), "size": list(p.size)}
        if p.size
        else {"start": p.start, "stop": p.stop}
    )
    return {"name": p.name, "dtype": p.dtype, "shape": list(p.shape), **where}


def _layout_doc(layout: RankLayout) -> dict[str, Any]:
    return {
        "run": layout.run,
        "step": layout.step,
        "rank": layout.rank,
        "world": layout.world,
        "host": layout.host,
        "tensors": [_piece_doc(p) for p in layout.pieces],
    }


def write_layout(folder: str | os.PathLike[str], layout: RankLayout) -> Path:
    """Write ``layout`` as ``folder/pieces.json`` (checked first: ConfigError for a
    layout that read_layout would refuse), atomically (temp file + rename)."""
    target = Path(folder) / LAYOUT_NAME
    doc = _layout_doc(layout)
    _check_layout(FieldCheck(str(target), "rank layout", ConfigError, strict=True), doc)
    tmp = target.with_name(f".{LAYOUT_NAME}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with tmp.open("w") as out:
            json.dump(doc, out, separators=(",", ":"))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def read_layout(folder: str | os.PathLike[str]) -> RankLayout:
    """The sidecar of a rank folder; CorruptObjectError (one line) when it is missing,
    too large, not JSON or not a valid layout."""
    path = Path(folder) / LAYOUT_NAME
    try:
        size = path.stat().st_size
        if size > MAX_LAYOUT_BYTES:
            raise CorruptObjectError(
                f"rank layout {path}: {size} bytes exceeds the limit of {MAX_LAYOUT_BYTES}"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptObjectError(
            f"rank layout {path} cannot be read ({exc.strerror or type(exc).__name__})"
        ) from None
    doc = load_json(
        data, max_bytes=MAX_LAYOUT_BYTES, what=f"rank layout {path}", error=CorruptObjectError
    )
    return _check_layout(FieldCheck(str(path), "rank layout", CorruptObjectError, strict=True), doc)


def layout_digest(layout: RankLayout) -> str:
    """sha256 (hex) of the canonical pieces list: equal for two steps (or hosts) of a rank
    exactly when they stage the same pieces."""
    canonical = json.dumps(
        [_piece_doc(p) for p in layout.pieces], separators=(",", ":"), sort_keys=True
    )
    return hashlib.sha256(canonical.encode()).hexdigest()
