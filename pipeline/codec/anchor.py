"""Anchor objects: plain safetensors, or the lossless byte-plane zstd form.

Plain anchors (``method="none"``) are ordinary safetensors files that any tool
loads. The compressed form (``method="zstd"``) is still a safetensors
container, told apart by its metadata key ``deltasync.anchor`` =
``planes-zstd/1``:

- each tensor is one 1-d uint8 entry of the same name holding its byte planes
  back to back;
- metadata ``deltasync.tensors`` is a JSON list, in stored order, of
  ``{"name", "dtype", "shape", "planes": [[method, bytes], ...]}`` with one plane
  per byte of the element width, method ``raw`` or ``zstd`` (a single zstd frame
  that records its content size);
- plane k holds byte k (little-endian) of every element's unsigned integer
  view. Floating dtypes are rotated left by one bit first, so that the sign
  moves to the lowest bit and the exponent field starts at the top: for bf16
  and fp32 the top byte is exactly the 8 exponent bits. Exponents of trained
  weights take few values and compress well; sign and mantissa bytes are close
  to random and stay ``raw`` whenever zstd would not shrink them.

Decoding is bit-exact for every dtype a manifest can name (NaN payloads, -0.0,
subnormals included). Readers accept both forms (:func:`anchor_tensors`); a
damaged or hostile object raises CorruptObjectError before anything larger
than its declared tensor is allocated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from pipeline.codec.names import ANCHOR_COMPRESSIONS
from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.bounded import load_json
from pipeline.format.checkpoints.checkpoint import (
    HeaderEntry,
    header_bytes,
    parse_header,
    tensors_from_bytes,
)
from pipeline.format.checkpoints.checkpoint_write import safetensors_bytes
from pipeline.format.manifest import MAX_ELEMENTS, MAX_NDIM, dtype_name
from pipeline.format.tensors import DTYPES

FORMAT_KEY = "deltasync.anchor"
TENSORS_KEY = "deltasync.tensors"
FORMAT = "planes-zstd/1"
# Level 1 beats 3..9 on exponent planes (longer match searches find short matches
# that cost more than literals) and is the fastest.
ZSTD_LEVEL = 1
# A zstd block decodes to at most 128 KiB and takes at least 4 bytes (an RLE block):
# no frame expands more than this, so a larger claim is a lie.
MAX_ZSTD_RATIO = 32768

_RAW, _ZSTD = "raw", "zstd"
_UNSIGNED: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}

Tensors = Iterable[tuple[str, torch.Tensor]]


def check_compression(method: str) -> str:
    if method not in ANCHOR_COMPRESSIONS:
        raise ConfigError(
            f"anchor compression {method!r} is not one of {', '.join(ANCHOR_COMPRESSIONS)}"
        )
    return method


def encode_anchor(
    tensors: Tensors, method: str = "none", metadata: Mapping[str, str] | None = None
) -> bytes:
    """One anchor object holding ``tensors`` (in the given order): plain safetensors for
    ``"none"``, byte planes with zstd for ``"zstd"``. Deterministic."""
    if check_compression(method) == "none":
        return safetensors_bytes(tensors, metadata=dict(metadata or {}))
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    records: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise MismatchError(f"tensor {name!r} is written twice")
        seen.add(name)
        planes: list[list[str | int]] = []
        for array in _planes(tensor):
            plane = array.data
            packed = compressor.compress(plane)
            if len(packed) < plane.nbytes:
                planes.append([_ZSTD, len(packed)])
                chunks.append(packed)
            else:
                planes.append([_RAW, plane.nbytes])
                chunks.append(plane)
        records.append(
            {
                "name": name,
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "planes": planes,
            }
        )
    meta = {
        **dict(metadata or {}),
        FORMAT_KEY: FORMAT,
        TENSORS_KEY: json.dumps(records, separators=(",", ":"), ensure_ascii=False),
    }
    fields = []
    offset = 0
    for record in records:
        size = sum(n for _, n in record["planes"])
        fields.append((record["name"], "U8", [size], offset, offset + size))
        offset += size
    return b"".join([header_bytes(fields, dict(sorted(meta.items()))), *chunks])


def _planes(tensor: torch.Tensor) -> list[npt.NDArray[np.uint8]]:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    width = t.element_size()
    flat = t.contiguous().reshape(-1)
    n = flat.numel()
    if n == 0:
        return [np.empty(0, dtype=np.uint8)] * width
    u = flat.view(torch.uint8).numpy().view(_UNSIGNED[width])
    if t.dtype.is_floating_point:
        rotated = u << u.dtype.type(1)
        rotated |= u >> u.dtype.type(8 * width - 1)
        u = rotated
    grid = u.view(np.uint8).reshape(n, width)
    return [np.ascontiguousarray(grid[:, k]) for k in range(width)]


Shapes = Mapping[str, tuple[str, tuple[int, ...]]]


def anchor_tensors(
    data: bytes, source: str, expected: Shapes | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of an anchor object in either form, in stored order, as owned writable
    CPU tensors; ``source`` names the object in errors. With ``expected`` (name ->
    (dtype name, shape), from the manifest) every declared tensor is checked against
    it before anything is decoded or allocated."""
    header = parse_header(data, len(data), source)
    tag = header.metadata.get(FORMAT_KEY)
    if tag is None:
        if expected is not None:
            _check_declared(((e.name, e.dtype, e.shape) for e in header.entries), expected, source)
        yield from tensors_from_bytes(data, source)
        return
    if tag != FORMAT:
        raise CorruptObjectError(f"{source}: unknown anchor format {tag!r}")
    records = _records(header.metadata.get(TENSORS_KEY), source)
    if expected is not None:
        _check_declared(((n, d, s) for n, d, s, _ in records), expected, source)
    entries = {e.name: e for e in header.entries}
    if sorted(entries) != sorted(r[0] for r in records):
        raise CorruptObjectError(f"{source}: tensor list does not match the stored entries")
    view = memoryview(data)
    for name, dtype, shape, planes in records:
        entry = entries[name]
        stored = view[header.data_start + entry.begin : header.data_start + entry.end]
        yield name, _decode(stored, entry, dtype, shape, planes, f"{source}: tensor {name!r}")


Record = tuple[str, torch.dtype, tuple[int, ...], list[tuple[str, int]]]


def _check_declared(
    declared: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], expected: Shapes, source: str
) -> None:
    for name, dtype, shape in declared:
        want = expected.get(name)
        if want is None:
            raise CorruptObjectError(
                f"{source}: holds tensor {name[:80]!r} that the manifest does not list"
            )
        if DTYPES.get(want[0]) != dtype or tuple(want[1]) != tuple(shape):
            raise CorruptObjectError(
                f"{source}: tensor {name[:80]!r} is declared {dtype} {tuple(shape)}, "
                f"the manifest says {want[0]} {tuple(want[1])}"
            )


def _records(raw: str | None, source: str) -> list[Record]:
    if raw is None:
        raise CorruptObjectError(f"{source}: compressed anchor without {TENSORS_KEY}")
    doc = load_json(
        raw, max_bytes=len(raw), what=f"{source}: {TENSORS_KEY}", error=CorruptObjectError
    )
    if not isinstance(doc, list):
        raise CorruptObjectError(f"{source}: {TENSORS_KEY} is not a list")
    out: list[Record] = []
    seen: set[str] = set()
    for item in doc:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name in seen:
            raise CorruptObjectError(f"{source}: a tensor record has a missing or repeated name")
        seen.add(name)
        out.append(_record(item, name, f"{source}: tensor {name!r}"))
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _record(item: dict[str, Any], name: str, where: str) -> Record:
    if set(item) != {"name", "dtype", "shape", "planes"}:
        raise CorruptObjectError(f"{where}: record has fields {sorted(item)}")
    dtype = DTYPES.get(item["dtype"]) if isinstance(item["dtype"], str) else None
    if dtype is None:
        raise CorruptObjectError(f"{where}: unknown dtype {item['dtype']!r}")
    shape = item["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_int(d) and 0 <= d <= MAX_ELEMENTS for d in shape)
        or math.prod(shape) > MAX_ELEMENTS
    ):
        raise CorruptObjectError(f"{where}: absurd shape {str(shape)[:80]}")
    planes = item["planes"]
    if not isinstance(planes, list) or len(planes) != dtype.itemsize:
        raise CorruptObjectError(f"{where}: {dtype} needs {dtype.itemsize} byte planes")
    parsed: list[tuple[str, int]] = []
    for plane in planes:
        if (
            not isinstance(plane, list)
            or len(plane) != 2
            or plane[0] not in (_RAW, _ZSTD)
            or not _is_int(plane[1])
            or plane[1] < 0
        ):
            raise CorruptObjectError(f"{where}: malformed plane {str(plane)[:80]}")
        parsed.append((plane[0], plane[1]))
    return name, dtype, tuple(shape), parsed


def _decode(
    stored: memoryview,
    entry: HeaderEntry,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    planes: list[tuple[str, int]],
    where: str,
) -> torch.Tensor:
    if entry.dtype != torch.uint8 or len(entry.shape) != 1:
        raise CorruptObjectError(f"{where}: stored entry is not a 1-d uint8 tensor")
    total = sum(size for _, size in planes)
    if total != len(stored):
        raise CorruptObjectError(
            f"{where}: planes add up to {total} bytes, {len(stored)} are stored"
        )
    n = math.prod(shape)
    chunks: list[tuple[str, memoryview]] = []
    offset = 0
    for method, size in planes:
        chunk = stored[offset : offset + size]
        offset += size
        if method == _RAW and size != n:
            raise CorruptObjectError(f"{where}: a raw plane of {size} bytes for {n} elements")
        if method == _ZSTD:
            _check_frame(chunk, n, where)
        chunks.append((method, chunk))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    # Every plane's size is now known to be n: this is the declared tensor, no more.
    grid: npt.NDArray[np.uint8] = np.empty((n, dtype.itemsize), dtype=np.uint8)
    for k, (method, chunk) in enumerate(chunks):
        plane = _unzstd(chunk, n, where) if method == _ZSTD else chunk
        grid[:, k] = np.frombuffer(plane, dtype=np.uint8)
    u = grid.reshape(-1).view(_UNSIGNED[dtype.itemsize])
    if dtype.is_floating_point:  # undo the rotation: right by one bit
        low = u << u.dtype.type(8 * dtype.itemsize - 1)
        u >>= u.dtype.type(1)
        u |= low
    return torch.from_numpy(grid.reshape(-1)).view(dtype).reshape(shape)


def _check_frame(chunk: memoryview, n: int, where: str) -> None:
    """A zstd plane must be one frame that records its content size, ``n``, and could
    hold it (refused before any output is allocated)."""
    if n > MAX_ZSTD_RATIO * len(chunk):
        raise CorruptObjectError(
            f"{where}: a zstd plane of {len(chunk)} bytes cannot hold {n} elements"
        )
    try:
        declared = zstandard.frame_content_size(chunk)
    except zstandard.ZstdError:
        raise CorruptObjectError(f"{where}: a zstd plane has no valid frame header") from None
    if declared != n:  # -1: size not recorded (the writer always records it)
        raise CorruptObjectError(f"{where}: a zstd plane declares {declared} bytes, not {n}")


def _unzstd(chunk: memoryview, n: int, where: str) -> bytes:
    try:
        # The output is sized by the frame's content size, checked to be n.
        out = zstandard.ZstdDecompressor().decompress(
            chunk, max_output_size=n, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"{where}: a zstd plane does not decode ({exc})") from None
    if len(out) != n:
        raise CorruptObjectError(f"{where}: a zstd plane decodes to {len(out)} bytes, not {n}")
    return out
