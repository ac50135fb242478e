"""Per-tensor records in a delta object's metadata, and their validation.

Everything a record claims is checked against hard limits and against the
bytes it names before any decoding allocates memory from its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.codec import contents, positions
from pipeline.codec.dtypes import BY_NAME, DtypeInfo
from pipeline.codec.level3 import chunked
from pipeline.codec.tensorcodec import ENCODINGS, roles
from pipeline.errors import CorruptObjectError

U8 = npt.NDArray[np.uint8]

MAX_NUMEL = 1 << 44


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a delta object. Its streams are stored back to back in one
    uint8 container entry named after the tensor, in the order of ``streams``."""

    name: str
    info: DtypeInfo
    shape: tuple[int, ...]
    encoding: str
    changed: int
    streams: dict[str, int]  # role -> size in bytes, in stored order
    params: dict[str, Any]
    # The validated chunk layout of a ``chunked`` record (not part of its JSON).
    layout: chunked.Layout | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(self.streams.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.info.name,
            "shape": list(self.shape),
            "encoding": self.encoding,
            "changed": self.changed,
            "streams": self.streams,
            "params": self.params,
        }

    def split(self, blob: U8) -> dict[str, U8]:
        """The record's streams as views into its container entry."""
        out: dict[str, U8] = {}
        offset = 0
        for role, size in self.streams.items():
            out[role] = blob[offset : offset + size]
            offset += size
        return out


def _is_int(x: object) -> bool:
    return type(x) is int


def parse_record(
    raw: object, entries: dict[str, U8], object_name: str, position: int
) -> TensorRecord:
    """Validate one record against the container entry holding its streams."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise CorruptObjectError(
            f"delta object {object_name}: tensor record {position} is malformed"
        )
    name: str = raw["name"]

    def bad(reason: str) -> CorruptObjectError:
        return CorruptObjectError(f"delta object {object_name}: tensor {name!r}: {reason}")

    dtype_name = raw.get("dtype")
    info = BY_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
    if info is None:
        raise bad(f"unknown dtype {dtype_name!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape is not a list of non-negative integers")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise bad(f"{numel} elements is absurd")
    encoding = raw.get("encoding")
    if encoding not in ENCODINGS:
        raise bad(f"unknown encoding {encoding!r}")
    changed = raw.get("changed")
    if not (isinstance(changed, int) and _is_int(changed) and 0 <= changed <= numel):
        raise bad(f"changed count {changed!r} is not within 0..{numel}")
    if (encoding == "same") != (changed == 0):
        raise bad(f"encoding {encoding!r} with {changed} changed elements")
    params = raw.get("params")
    if not isinstance(params, dict):
        raise bad("params are not a JSON object")
    sizes = raw.get("streams")
    expected = roles(encoding, params)
    if expected is None:
        raise bad(f"unknown contents method {params.get('contents')!r}")
    if (
        not isinstance(sizes, dict)
        or tuple(sizes) != expected
        or not all(_is_int(v) and v >= 0 for v in sizes.values())
    ):
        raise bad(f"streams {sizes!r} do not match encoding {encoding!r}")
    blob = entries.get(name)
    total = sum(sizes.values())
    if (blob is None and (total or encoding != "same")) or (
        blob is not None and blob.size != total
    ):
        raise bad(f"stream sizes add up to {total}, its container entry does not match")
    record = TensorRecord(name, info, tuple(shape), encoding, changed, dict(sizes), params)
    if blob is not None:
        streams = record.split(blob)
        if encoding == "chunked":
            found = chunked.layout(streams, params, changed, numel, info)
            if isinstance(found, str):
                raise bad(found)
            return TensorRecord(
                name, info, tuple(shape), encoding, changed, dict(sizes), params, found
            )
        reason = _check_streams(record, streams)
        if reason:
            raise bad(reason)
    return record


def _check_streams(rec: TensorRecord, streams: dict[str, U8]) -> str | None:
    width = rec.info.width
    if rec.encoding == "same":
        return None
    if rec.encoding == "dense":
        if contents.frame_content_size(streams["values"]) != rec.numel * width:
            return "contents frame does not declare the tensor's size"
        return None
    reason = positions.check_positions(
        rec.encoding, streams, rec.params, changed=rec.changed, numel=rec.numel
    )
    return reason or contents.check_contents(streams, rec.params, rec.changed, width)
