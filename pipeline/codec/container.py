"""The delta object container: a safetensors file of uint8 streams plus metadata.

Writing goes through safetensors so any safetensors tool can inspect an object.
Reading parses the header here first, with hard limits, so that a damaged or
hostile object is rejected before anything is allocated from its numbers.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipeline.errors import CorruptObjectError
from pipeline.format.bounded import load_json
from pipeline.format.checkpoint import header_bytes

MAX_HEADER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Container:
    metadata: dict[str, str]
    streams: dict[str, npt.NDArray[np.uint8]]  # read-only views into the object's bytes


def write_container(streams: dict[str, npt.NDArray[np.uint8]], metadata: dict[str, str]) -> bytes:
    """A safetensors file of 1-d uint8 tensors, laid out deterministically (same
    input, same bytes) so that re-encoding a version yields the same object."""
    ends = list(itertools.accumulate(int(v.size) for v in streams.values()))
    fields = (
        (key, "U8", [end - begin], begin, end)
        for key, begin, end in zip(streams, [0, *ends], ends, strict=False)
    )
    parts = [header_bytes(fields, dict(sorted(metadata.items())), ensure_ascii=True)]
    parts.extend(np.ascontiguousarray(value).tobytes() for value in streams.values())
    return b"".join(parts)


def read_container(data: bytes | memoryview, object_name: str) -> Container:
    """Parse and bounds-check a safetensors file of uint8 tensors without copying them."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size < 8:
        raise CorruptObjectError(f"delta object {object_name}: {size} bytes, too short")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > MAX_HEADER_BYTES or header_len > size - 8:
        raise CorruptObjectError(
            f"delta object {object_name}: header length {header_len} is absurd for a "
            f"{size}-byte object"
        )
    header = load_json(
        bytes(view[8 : 8 + header_len]),
        max_bytes=MAX_HEADER_BYTES,
        what=f"delta object {object_name}: header",
        error=CorruptObjectError,
    )
    if not isinstance(header, dict):
        raise CorruptObjectError(f"delta object {object_name}: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptObjectError(f"delta object {object_name}: metadata is not a str->str map")
    body_start = 8 + header_len
    body_len = size - body_start
    body = (
        np.frombuffer(view, dtype=np.uint8, offset=body_start)
        if body_len
        else np.zeros(0, np.uint8)
    )
    body.flags.writeable = False
    streams: dict[str, npt.NDArray[np.uint8]] = {}
    spans: list[tuple[int, int]] = []
    for key, entry in header.items():
        streams[key] = _stream(entry, key, body, object_name)
        begin, end = entry["data_offsets"]
        if end > begin:
            spans.append((begin, end))
    spans.sort()
    for (_, end_a), (begin_b, _) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CorruptObjectError(f"delta object {object_name}: streams overlap")
    covered = sum(end - begin for begin, end in spans)
    if covered != body_len:
        raise CorruptObjectError(
            f"delta object {object_name}: streams cover {covered} of {body_len} data bytes"
        )
    return Container(metadata=metadata, streams=streams)


def _stream(
    entry: object, key: str, body: npt.NDArray[np.uint8], object_name: str
) -> npt.NDArray[np.uint8]:
    bad = CorruptObjectError(f"delta object {object_name}: stream {key!r} has a bad header entry")
    if not isinstance(entry, dict) or entry.get("dtype") != "U8":
        raise bad
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not (
        isinstance(shape, list)
        and len(shape) == 1
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(x) is int for x in [*shape, *offsets])
    ):
        raise bad
    begin, end = offsets
    if not 0 <= begin <= end <= body.size or end - begin != shape[0]:
        raise CorruptObjectError(
            f"delta object {object_name}: stream {key!r} lies outside the data "
            f"({begin}..{end} of {body.size} bytes)"
        )
    return body[begin:end]
