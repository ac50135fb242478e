"""The run's partition of tensors into parts: one object per part in every version.

A version's tensors are split into parts of at most ``part_bytes`` of weights in
checkpoint order. The run's first anchor fixes that partition and every later delta
and anchor reuses it (each manifest names the object of every tensor), so parts can
be diffed, stored, fetched and applied independently.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pipeline.errors import ConfigError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.publish.uploads import Clock, PublishTimings

DEFAULT_PART_BYTES = 512 << 20

Layout = list[tuple[str, list[str]]]  # (object key, tensor names) per part


def part_key(index: int) -> str:
    return f"part-{index:05d}.safetensors"


def plan_parts(sizes: Iterable[tuple[str, int]], part_bytes: int = DEFAULT_PART_BYTES) -> Layout:
    """Split (name, bytes) in order into parts of at most ``part_bytes`` (a larger tensor
    gets a part of its own)."""
    if part_bytes <= 0:
        raise ConfigError(f"part_bytes must be positive, not {part_bytes}")
    parts: Layout = []
    size = 0
    for name, n in sizes:
        if not parts or (size + n > part_bytes and parts[-1][1]):
            parts.append((part_key(len(parts)), []))
            size = 0
        parts[-1][1].append(name)
        size += n
    return parts


def read_parts(
    tensors: CheckpointReader | Iterable[tuple[str, torch.Tensor]],
    layout: Layout | None,
    part_bytes: int,
    timings: PublishTimings,
) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Group tensors into the run's parts, reading one part at a time."""
    clock = Clock()
    if isinstance(tensors, CheckpointReader):
        reader = tensors
        layout = layout or plan_parts(((n, reader.nbytes(n)) for n in reader.names()), part_bytes)
        for key, names in layout:
            clock.lap()
            part = [(n, reader.get(n)) for n in names]
            timings.read_s += clock.lap()
            yield key, part
            # Unmap what this part touched: mapped pages stay resident until unmapped.
            del part
            reader.close()
        return
    stream = iter(tensors)
    if layout is None:
        group: list[tuple[str, torch.Tensor]] = []
        size, index = 0, 0
        for name, tensor in stream:
            n = tensor.numel() * tensor.element_size()
            if group and size + n > part_bytes:
                timings.read_s += clock.lap()
                yield part_key(index), group
                clock.lap()
                group, size, index = [], 0, index + 1
            group.append((name, tensor))
            size += n
        if group:
            timings.read_s += clock.lap()
            yield part_key(index), group
        return
    for key, names in layout:
        part = []
        for expected in names:
            item = next(stream, None)
            if item is None or item[0] != expected:
                got = None if item is None else item[0]
                raise MismatchError(f"part {key}: expected tensor {expected!r}, got {got!r}")
            part.append(item)
        timings.read_s += clock.lap()
        yield key, part
        clock.lap()
    extra = next(stream, None)
    if extra is not None:
        raise MismatchError(f"tensor {extra[0]!r} is not in the run's partition")
