"""The delta object container: a safetensors file of uint8 streams plus metadata.

Writing goes through safetensors so any safetensors tool can inspect an object.
Reading parses the header first (format.checkpoint.parse_header, with hard limits), so
that a damaged or hostile object is rejected before anything is allocated from its
numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pipeline.errors import CorruptObjectError
from pipeline.format.checkpoints.checkpoint import header_bytes, parse_header


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
    """Parse and bounds-check a safetensors file of 1-d uint8 tensors without copying
    them (the header through the one safetensors header parser)."""
    view = memoryview(data).cast("B")
    source = f"delta object {object_name}"
    header = parse_header(view, len(view), source)
    body = (
        np.frombuffer(view, dtype=np.uint8, offset=header.data_start)
        if len(view) > header.data_start
        else np.zeros(0, np.uint8)
    )
    body.flags.writeable = False
    streams: dict[str, npt.NDArray[np.uint8]] = {}
    for entry in header.entries:
        if entry.dtype != torch.uint8 or len(entry.shape) != 1:
            raise CorruptObjectError(f"{source}: stream {entry.name!r} is not a 1-d U8 stream")
        streams[entry.name] = body[entry.begin : entry.end]
    return Container(metadata=header.metadata, streams=streams)
