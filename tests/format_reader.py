"""An independent reader of deltasync stores, written from docs/FORMAT.md alone.

It imports nothing of deltasync: only the standard library, numpy and zstandard
(tests/format/test_format_spec.py checks that). It reads manifests and ``run.json``, anchor
objects (both forms), and delta objects of levels 1 and 3, applies them to a base,
computes mixsum-128, opens signed envelopes (and gives the statement their signature
covers), and rebuilds a version of a run from a store folder. xxh3-128 (the delta
checksum, the state hash, the schema-1 content hash) is a hash this module does not
implement: the caller passes a function computing it (``bytes -> 32 hex``), or None to
skip those checks.

Tensors are held as their *bits*: a flat numpy array of the unsigned integer of their
width, with the dtype name and shape beside it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

Xxh3 = Callable[[bytes], str] | None
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

# name -> (safetensors code, width, floating)
DTYPES: dict[str, tuple[str, int, bool]] = {
    "bool": ("BOOL", 1, False),
    "uint8": ("U8", 1, False),
    "int8": ("I8", 1, False),
    "uint16": ("U16", 2, False),
    "int16": ("I16", 2, False),
    "uint32": ("U32", 4, False),
    "int32": ("I32", 4, False),
    "uint64": ("U64", 8, False),
    "int64": ("I64", 8, False),
    "float16": ("F16", 2, True),
    "bfloat16": ("BF16", 2, True),
    "float32": ("F32", 4, True),
    "float64": ("F64", 8, True),
    "float8_e4m3fn": ("F8_E4M3", 1, True),
    "float8_e5m2": ("F8_E5M2", 1, True),
    "float8_e8m0fnu": ("F8_E8M0", 1, True),
}
BY_CODE = {code: name for name, (code, _, _) in DTYPES.items()}
UNSIGNED = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class FormatError(Exception):
    """The bytes do not follow docs/FORMAT.md."""


@dataclass
class Bits:
    dtype: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any]  # flat, unsigned, of the dtype's width


def _width(dtype: str) -> int:
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}")
    return DTYPES[dtype][1]


# ------------------------------------------------------------------ safetensors


def read_safetensors(data: bytes) -> tuple[dict[str, str], dict[str, tuple[str, list[int], bytes]]]:
    """(metadata, name -> (dtype code, shape, bytes))."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    metadata = header.pop("__metadata__", {})
    entries = {}
    spans = []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        entries[name] = (entry["dtype"], list(entry["shape"]), body[begin:end])
        spans.append((begin, end))
    spans.sort()
    at = 0
    for begin, end in spans:
        if begin != at:
            raise FormatError("safetensors entries do not cover the data exactly")
        at = end
    if at != len(body):
        raise FormatError("safetensors entries do not cover the data exactly")
    return metadata, entries


def zstd_frame(frame: bytes, size: int) -> bytes:
    if zstandard.frame_content_size(frame) != size:
        raise FormatError(f"zstd frame does not record {size} bytes")
    out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    if len(out) != size:
        raise FormatError("zstd frame is short")
    return out


def planes(frame: bytes, count: int, width: int) -> npt.NDArray[Any]:
    """P(v, w) -> the values."""
    raw = np.frombuffer(zstd_frame(frame, count * width), np.uint8).reshape(width, count)
    return np.ascontiguousarray(raw.T).view(UNSIGNED[width]).reshape(count)


def unzigzag(z: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return (z >> z.dtype.type(1)) ^ (np.zeros_like(z) - (z & z.dtype.type(1)))


# ------------------------------------------------------------------ anchors


def read_anchor(data: bytes) -> dict[str, Bits]:
    metadata, entries = read_safetensors(data)
    out: dict[str, Bits] = {}
    tag = metadata.get("deltasync.anchor")
    if tag is None:
        for name, (code, shape, raw) in entries.items():
            dtype = BY_CODE[code]
            out[name] = Bits(dtype, tuple(shape), np.frombuffer(raw, UNSIGNED[_width(dtype)]))
        return out
    if tag != "planes-zstd/1":
        raise FormatError(f"unknown anchor form {tag!r}")
    for record in json.loads(metadata["deltasync.tensors"]):
        name, dtype, shape = record["name"], record["dtype"], tuple(record["shape"])
        width, floating = _width(dtype), DTYPES[dtype][2]
        n = int(np.prod(shape, dtype=np.int64))
        raw = entries[name][2]
        grid = np.empty((n, width), np.uint8)
        at = 0
        for k, (method, size) in enumerate(record["planes"]):
            chunk = raw[at : at + size]
            at += size
            grid[:, k] = np.frombuffer(
                zstd_frame(chunk, n) if method == "zstd" else chunk, np.uint8
            )
        if at != len(raw):
            raise FormatError(f"planes of {name!r} do not fill its entry")
        bits = grid.reshape(-1).view(UNSIGNED[width]).copy()
        if floating:  # undo the rotation left by one bit
            top = bits.dtype.type(8 * width - 1)
            bits = (bits >> bits.dtype.type(1)) | (bits << top)
        out[name] = Bits(dtype, shape, bits)
    return out


# ------------------------------------------------------------------ bit streams


def stream_bits(data: bytes) -> U8:
    return np.unpackbits(np.frombuffer(data, np.uint8))


def fixed_values(bits: U8, start: int, count: int, r: int) -> I64:
    """``count`` r-bit numbers, MSB first, from bit ``start`` on."""
    if r == 0 or count == 0:
        return np.zeros(count, np.int64)
    block = bits[start : start + count * r].astype(np.int64).reshape(count, r)
    return (block << np.arange(r - 1, -1, -1, dtype=np.int64)).sum(axis=1)


def rice(unary: bytes, fixed: bytes, n: int, r: int, limit: int) -> I64:
    """R(unary, fixed, n, r, limit)."""
    if n == 0:
        if unary or fixed:
            raise FormatError("Rice streams of no positions are not empty")
        return np.zeros(0, np.int64)
    if not 0 <= r <= 40 or len(fixed) != (n * r + 7) // 8:
        raise FormatError("Rice fixed stream has the wrong size")
    ends = np.flatnonzero(stream_bits(unary))
    if ends.size != n or ends[-1] // 8 != len(unary) - 1:
        raise FormatError("unary stream does not hold its codes")
    q = np.diff(ends, prepend=-1) - 1
    if int(q.max()) > limit >> r:
        raise FormatError("Rice quotient out of range")
    gaps = (q << r) | fixed_values(stream_bits(fixed), 0, n, r)
    positions = np.cumsum(gaps + 1) - 1
    if int(positions[-1]) >= limit:
        raise FormatError("position out of range")
    return positions


def differences(
    streams: dict[str, bytes], params: dict[str, Any], n: int, width: int
) -> npt.NDArray[Any]:
    """d_k of the n changed elements, from the contents' streams."""
    unsigned = UNSIGNED[width]
    if params["contents"] == "planes":
        d = unzigzag(planes(streams["values"], n, width))
    elif params["contents"] == "signmag":
        m = params["big"]
        if len(streams["sign"]) != (n + 7) // 8:
            raise FormatError("sign stream has the wrong size")
        negative = stream_bits(streams["sign"])[:n].astype(bool)
        big = rice(streams["big_unary"], streams["big_fixed"], m, params["big_rice"], n)
        magnitude = np.ones(n, unsigned)
        if m:
            magnitude[big] = planes(streams["mags"], m, width) + unsigned.type(2)
        elif streams["mags"]:
            raise FormatError("magnitudes without large differences")
        d = np.where(negative, np.zeros_like(magnitude) - magnitude, magnitude)
    else:
        raise FormatError(f"unknown contents {params['contents']!r}")
    if not d.all():
        raise FormatError("a changed element has difference 0")
    return d


# ------------------------------------------------------------------ delta objects

ROLES = {
    "same": (),
    "sparse": ("unary", "fixed"),
    "bitmap": ("mask",),
    "dense": ("values",),
    "chunked": ("table", "bits", "mags"),
}
CONTENTS = {"planes": ("values",), "signmag": ("sign", "big_unary", "big_fixed", "mags")}


def roles(encoding: str, params: dict[str, Any]) -> tuple[str, ...]:
    if encoding in ("same", "dense", "chunked"):
        return ROLES[encoding]
    return ROLES[encoding] + CONTENTS[params["contents"]]


@dataclass
class Record:
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    changed: int
    streams: dict[str, bytes]
    params: dict[str, Any]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def read_delta(data: bytes, xxh3: Xxh3 = None) -> tuple[int, list[Record]]:
    """(level, records) of a delta object."""
    metadata, entries = read_safetensors(data)
    if metadata.get("codec") != "deltasync-bitdelta" or metadata.get("codec_version") != "1":
        raise FormatError("not a deltasync-bitdelta version 1 object")
    level_text, tensors = metadata["level"], metadata["tensors"]
    if xxh3 is not None:
        payload = b"".join(
            [
                f"{level_text}\0{tensors}\0".encode(),
                *(f"{n}\0{len(entries[n][2])}\0".encode() + entries[n][2] for n in sorted(entries)),
            ]
        )
        if metadata["checksum"] != "xxh3-128:" + xxh3(payload):
            raise FormatError("checksum mismatch")
    if level_text not in ("1", "3"):
        raise FormatError(f"delta level {level_text!r} is not 1 or 3")
    level = int(level_text)
    rows = json.loads(tensors)
    records: list[Record] = []
    if level == 3:
        body = entries["streams"][2] if "streams" in entries else b""
        at = 0
        for name, dtype, shape, encoding, changed, sizes, params in rows:
            names = roles(encoding, params)
            streams = {}
            for role, size in zip(names, sizes, strict=True):
                streams[role] = body[at : at + size]
                at += size
            records.append(Record(name, dtype, tuple(shape), encoding, changed, streams, params))
        if at != len(body):
            raise FormatError("records do not cover the streams entry")
        return level, records
    for row in rows:
        sizes = row["streams"]
        if tuple(sizes) != roles(row["encoding"], row["params"]):
            raise FormatError(f"streams of {row['name']!r} do not match its encoding")
        blob = entries[row["name"]][2] if row["name"] in entries else b""
        if sum(sizes.values()) != len(blob):
            raise FormatError(f"entry of {row['name']!r} does not hold its streams")
        streams, at = {}, 0
        for role, size in sizes.items():
            streams[role] = blob[at : at + size]
            at += size
        records.append(
            Record(
                row["name"],
                row["dtype"],
                tuple(row["shape"]),
                row["encoding"],
                row["changed"],
                streams,
                row["params"],
            )
        )
    return level, records


def decode(record: Record, base: npt.NDArray[Any]) -> tuple[I64, npt.NDArray[Any]]:
    """(positions, new bits) of the record's changed elements over ``base`` (its bits)."""
    width, n, numel = _width(record.dtype), record.changed, record.numel
    if base.size != numel:
        raise FormatError(f"base of {record.name!r} has {base.size} elements, not {numel}")
    s, p = record.streams, record.params
    if record.encoding == "same":
        if n:
            raise FormatError("a same record with changes")
        return np.zeros(0, np.int64), base[:0]
    if record.encoding == "dense":
        d_all = unzigzag(planes(s["values"], numel, width))
        where = np.flatnonzero(d_all).astype(np.int64)
        d = d_all[where]
    elif record.encoding == "chunked":
        where, d = chunked(record, base)
    else:
        if record.encoding == "sparse":
            where = rice(s["unary"], s["fixed"], n, p["rice"], numel)
        elif record.encoding == "bitmap":
            mask = stream_bits(zstd_frame(s["mask"], (numel + 7) // 8))
            if mask[numel:].any():
                raise FormatError("mask bits past the tensor")
            where = np.flatnonzero(mask).astype(np.int64)
        else:
            raise FormatError(f"encoding {record.encoding!r} is not read here")
        d = differences(s, p, n, width)
    if where.size != n:
        raise FormatError(f"{record.name!r}: {where.size} changes decoded, record says {n}")
    return where, base[where] + d  # unsigned: wraps modulo 2^(8w)


def read_varints(data: bytes, count: int) -> I64:
    out = np.empty(count, np.int64)
    at = 0
    for i in range(count):
        value = shift = 0
        while True:
            if at >= len(data) or shift == 49:
                raise FormatError("chunk table is short")
            byte = data[at]
            at += 1
            value |= (byte & 127) << shift
            shift += 7
            if byte < 128:
                if byte == 0 and shift > 7:
                    raise FormatError("chunk table varint is not canonical")
                break
        out[i] = value
    if at != len(data):
        raise FormatError("chunk table has trailing bytes")
    return out


def chunked(record: Record, base: npt.NDArray[Any]) -> tuple[I64, npt.NDArray[Any]]:
    """Level 3: (positions, differences) of a chunked record."""
    width, numel, p, s = _width(record.dtype), record.numel, record.params, record.streams
    c, bounds, m = p["chunk"], p["bounds"], p["big"]
    if not 6 <= c <= 30 or len(bounds) > 3:
        raise FormatError("chunk or bounds out of range")
    size = 1 << c
    groups = len(bounds) + 1
    nchunks = -(-numel // size)
    table = read_varints(s["table"], nchunks * (2 * groups + 3)).reshape(nchunks, 2 * groups + 3)
    if int(table[:, 0].sum()) != len(s["bits"]):
        raise FormatError("chunk byte counts do not add up")
    mags = planes(s["mags"], m, width) if m else np.zeros(0, UNSIGNED[width])
    top = np.uint64((1 << (8 * width - 1)) - 1)
    bucket = np.zeros(numel, np.int64)
    for b in bounds:
        bucket += (base.astype(np.uint64) & top) >= np.uint64(b)
    positions: list[I64] = []
    diffs: list[npt.NDArray[Any]] = []
    byte = big_at = 0
    unsigned = UNSIGNED[width]
    for j in range(nchunks):
        row = [int(x) for x in table[j]]
        lo, hi = j * size, min(numel, (j + 1) * size)
        bits = stream_bits(s["bits"][byte : byte + row[0]])
        byte += row[0]
        counts, params = row[1::2], row[2::2]  # groups + 1 each (last: large magnitudes)
        k = sum(counts[:groups])
        if any(r > 40 for r in params) or k > hi - lo or counts[groups] > k:
            raise FormatError("chunk counts out of range")
        codes = sum(counts)
        ends = np.flatnonzero(bits)[:codes]
        if ends.size != codes:
            raise FormatError("a chunk's unary codes run past its bytes")
        quotients = np.diff(ends, prepend=-1) - 1
        at = int(ends[-1]) + 1 if codes else 0
        gaps, code = [], 0
        for g in range(groups + 1):
            q = quotients[code : code + counts[g]]
            limit = (size if g < groups else k) >> params[g]
            if q.size and int(q.max()) > limit:
                raise FormatError("Rice quotient out of range")
            gaps.append((q << params[g]) | fixed_values(bits, at, counts[g], params[g]))
            at += counts[g] * params[g]
            code += counts[g]
        signs = bits[at : at + k].astype(bool)
        if at + k > bits.size or bits.size - (at + k) >= 8 or bits[at + k :].any():
            raise FormatError("a chunk's bits do not match its counts")
        where = []
        for g in range(groups):
            ranks = np.cumsum(gaps[g] + 1) - 1
            members = np.flatnonzero(bucket[lo:hi] == g) if groups > 1 else np.arange(hi - lo)
            if ranks.size and int(ranks[-1]) >= members.size:
                raise FormatError("a chunk's positions fall outside it")
            where.append(members[ranks] + lo)
        chunk_where = np.sort(np.concatenate(where)) if where else np.zeros(0, np.int64)
        magnitude = np.ones(k, unsigned)
        big = np.cumsum(gaps[groups] + 1) - 1
        if big.size:
            if int(big[-1]) >= k:
                raise FormatError("a large magnitude's index is outside the chunk")
            magnitude[big] = mags[big_at : big_at + big.size] + unsigned.type(2)
        big_at += big.size
        positions.append(chunk_where.astype(np.int64))
        diffs.append(np.where(signs, np.zeros_like(magnitude) - magnitude, magnitude))
    if big_at != m:
        raise FormatError("large magnitudes do not add up")
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, unsigned)
    return np.concatenate(positions), np.concatenate(diffs)


# ------------------------------------------------------------------ hashes

K0, K1, K2, K3 = 0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89


def _u64(x: int) -> np.uint64:
    return np.uint64(x)


def _splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> _u64(30))) * _u64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _u64(27))) * _u64(0x94D049BB133111EB)
    return x ^ (x >> _u64(31))


def _murmur(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> _u64(33))) * _u64(0xFF51AFD7ED558CCD)
    x = (x ^ (x >> _u64(33))) * _u64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> _u64(33))


def mixsum_lanes(positions: npt.NDArray[Any], bits: npt.NDArray[Any]) -> tuple[int, int]:
    """(Σ A, Σ B) mod 2^64 of elements with these bits at these flat positions."""
    i = positions.astype(np.uint64)
    b = bits.astype(np.uint64)
    s = _splitmix(i ^ _u64(K0))
    a = _murmur(s ^ b ^ _u64(K1))
    rot = (s << _u64(29)) | (s >> _u64(35))
    c = _splitmix(rot + b * _u64(K3) + _u64(K2))
    return int(a.sum(dtype=np.uint64)), int(c.sum(dtype=np.uint64))


def mixsum(bits: npt.NDArray[Any], positions: npt.NDArray[Any] | None = None) -> str:
    """The mixsum-128 digest of a tensor's bits (or a piece's, at ``positions``)."""
    at = np.arange(bits.size, dtype=np.uint64) if positions is None else positions
    a, b = mixsum_lanes(at, bits)
    return f"{a:016x}{b:016x}"


def lane_sum(digests: list[str]) -> str:
    a = sum(int(d[:16], 16) for d in digests) % (1 << 64)
    b = sum(int(d[16:], 16) for d in digests) % (1 << 64)
    return f"{a:016x}{b:016x}"


def state_hash(tensors: list[dict[str, Any]], xxh3: Callable[[bytes], str]) -> str:
    payload = b"".join(
        t["name"].encode() + b"\0" + t["hash"].encode() + b"\n"
        for t in sorted(tensors, key=lambda t: (t["name"], t["hash"]))
    )
    return xxh3(payload)


def content_hash(algorithm: str, t: Bits, xxh3: Xxh3) -> str | None:
    if algorithm == "mixsum-128":
        return mixsum(t.data)
    if xxh3 is None:
        return None
    return xxh3(t.data.tobytes())  # little-endian already


# ------------------------------------------------------------------ manifests and signatures


def canonical(doc: Any) -> bytes:
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


ENVELOPE_PREFIX = b'{"signature":{'


def open_envelope(raw: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """(the document's bytes, the signature header or None) of a stored manifest or
    ``run.json``: a signed one is ``{"signature":{...},"signed":<document>}``, the
    document's bytes being exactly those the header's ``size`` and ``sha256`` name."""
    if not raw.startswith(ENVELOPE_PREFIX):
        return raw, None
    envelope = json.loads(raw)
    if raw != canonical(envelope) or set(envelope) != {"signature", "signed"}:
        raise FormatError("signed envelope is not canonical JSON")
    header = envelope["signature"]
    start = len(b'{"signature":' + canonical(header) + b',"signed":')
    payload = raw[start:-1]
    if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise FormatError("signed bytes are not those the signature names")
    return payload, header


def signed_statement(header: dict[str, Any], signs: str) -> bytes:
    """The bytes an envelope's Ed25519 signature covers (``signs``: ``manifest`` or
    ``run record``)."""
    return canonical({"sha256": header["sha256"], "signs": signs, "size": header["size"]})


def key_id(raw_public_key: bytes) -> str:
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def box_positions(shape: list[int], offset: list[int], size: list[int]) -> npt.NDArray[np.int64]:
    """Flat positions of a box piece's elements, in the piece's order."""
    strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    partial = [d for d in range(len(shape)) if size[d] != shape[d]]
    k = max(partial, default=0)
    width = size[k] * strides[k]
    starts = np.array([offset[k] * strides[k]], np.int64)
    for d in range(k - 1, -1, -1):
        outer = (offset[d] + np.arange(size[d], dtype=np.int64)) * strides[d]
        starts = (outer[:, None] + starts[None, :]).reshape(-1)
    return (starts[:, None] + np.arange(width, dtype=np.int64)[None, :]).reshape(-1)


def piece_positions(entry: dict[str, Any], piece: dict[str, Any]) -> npt.NDArray[np.int64]:
    if "size" in piece:
        return box_positions(entry["shape"], piece["offset"], piece["size"])
    return np.arange(piece["start"], piece["stop"], dtype=np.int64)


def stored(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A tensor entry's pieces (one piece of it all for a whole tensor)."""
    if "pieces" in entry:
        return list(entry["pieces"])
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    return [{"object": entry["object"], "start": 0, "stop": numel}]


class Store:
    """A store folder (the ``file://`` backend) read per docs/FORMAT.md."""

    def __init__(self, root: Path, xxh3: Xxh3 = None) -> None:
        self.root, self.xxh3 = Path(root), xxh3

    def versions(self, run: str, kind: str) -> list[int]:
        folder = self.root / run / kind
        if not folder.is_dir():
            return []
        return sorted(
            int(p.name)
            for p in folder.iterdir()
            if len(p.name) == 10 and p.name.isdigit() and (p / "manifest.json").is_file()
        )

    def manifest(self, run: str, kind: str, version: int) -> dict[str, Any]:
        stored = (self.root / run / kind / f"{version:010d}" / "manifest.json").read_bytes()
        raw, _ = open_envelope(stored)
        doc: dict[str, Any] = json.loads(raw)
        if raw != canonical(doc):
            raise FormatError("manifest is not canonical JSON")
        if doc["schema"] not in (1, 2, 3) or doc["run"] != run or doc["version"] != version:
            raise FormatError("manifest does not name its run and version")
        if doc["kind"] != {"deltas": "delta", "anchors": "anchor"}[kind]:
            raise FormatError("manifest is in another kind's folder")
        if self.xxh3 is not None and state_hash(doc["tensors"], self.xxh3) != doc["state_hash"]:
            raise FormatError("state hash does not match the tensor hashes")
        record = self.root / run / "run.json"
        if record.is_file():
            instance = json.loads(open_envelope(record.read_bytes())[0])
            if version >= instance["since"] and doc.get("instance") != instance["instance"]:
                raise FormatError("manifest belongs to another run instance")
        return doc

    def object(self, run: str, kind: str, version: int, entry: dict[str, Any]) -> bytes:
        data = (self.root / run / kind / f"{version:010d}" / entry["key"]).read_bytes()
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FormatError(f"object {entry['key']} does not match its manifest")
        return data

    def chain(self, run: str, version: int) -> list[tuple[str, dict[str, Any]]]:
        """(kind folder, manifest) from the anchor up to ``version``."""
        anchors = set(self.versions(run, "anchors"))
        out: list[tuple[str, dict[str, Any]]] = []
        current = version
        while current not in anchors:
            delta = self.manifest(run, "deltas", current)
            out.append(("deltas", delta))
            current = delta["parent"]
        out.append(("anchors", self.manifest(run, "anchors", current)))
        out.reverse()
        for (_, below), (_, above) in itertools.pairwise(out):
            if above["parent_state_hash"] != below["state_hash"]:
                raise FormatError(f"delta {above['version']} continues another state")
        return out

    def rebuild(self, run: str, version: int) -> dict[str, Bits]:
        """Every tensor of ``version``, its content hash checked against the manifest."""
        plan = self.chain(run, version)
        _, anchor = plan[0]
        tensors: dict[str, Bits] = {}
        objects = {o["key"]: o for o in anchor["objects"]}
        held: dict[str, dict[str, Bits]] = {}
        for entry in anchor["tensors"]:
            numel = int(np.prod(entry["shape"], dtype=np.int64))
            data = np.zeros(numel, UNSIGNED[_width(entry["dtype"])])
            for piece in stored(entry):
                key = piece["object"]
                if key not in held:
                    held[key] = read_anchor(
                        self.object(run, "anchors", anchor["version"], objects[key])
                    )
                found = held[key][entry["name"]]
                if found.dtype != entry["dtype"]:
                    raise FormatError(f"anchor tensor {entry['name']!r} has another dtype")
                data[piece_positions(entry, piece)] = found.data
            tensors[entry["name"]] = Bits(entry["dtype"], tuple(entry["shape"]), data)
        for _, delta in plan[1:]:
            self.apply(run, delta, tensors)
        target = plan[-1][1]
        for entry in target["tensors"]:
            t = tensors[entry["name"]]
            if (t.dtype, list(t.shape)) != (entry["dtype"], entry["shape"]):
                raise FormatError(f"tensor {entry['name']!r} changed dtype or shape")
            algorithm = target.get("content_hash", "xxh3-128")
            digest = content_hash(algorithm, t, self.xxh3)
            if digest is not None and digest != entry["hash"]:
                raise FormatError(f"tensor {entry['name']!r} does not match its hash")
        return tensors

    def apply(self, run: str, delta: dict[str, Any], tensors: dict[str, Bits]) -> None:
        objects = {o["key"]: o for o in delta["objects"]}
        parsed: dict[str, dict[str, Record]] = {}
        for entry in delta["tensors"]:
            if not entry["changed"]:
                continue
            t = tensors[entry["name"]]
            for piece in stored(entry):
                key = piece["object"]
                if key not in parsed:
                    data = self.object(run, "deltas", delta["version"], objects[key])
                    parsed[key] = {r.name: r for r in read_delta(data, self.xxh3)[1]}
                at = piece_positions(entry, piece)
                where, new = decode(parsed[key][entry["name"]], t.data[at])
                t.data[at[where]] = new
