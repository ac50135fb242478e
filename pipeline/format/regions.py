"""Where a piece of a tensor lies in the whole tensor: a *region*.

A region is a box: per dimension an offset and a size, what torch calls a DTensor's
local chunk (``Shard`` on any dimension, on meshes of any rank). A flat element range
``[start, stop)`` is the box of the tensor's 1-D view, so the pieces of Shard(0) and
row-sliced ranks, and those of every schema-3 store written before boxes, are regions
too: one definition of where a piece's elements go, for the hash, the decoder and
every target.

A piece is stored as a 1-D tensor of its elements in the box's own C order. Element
``k`` of it sits at flat position ``positions(k)`` of the whole tensor: the box is cut
into ``runs`` of ``width`` consecutive elements (the innermost partial dimension times
every full one inside it), each starting at a known flat position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, overload

from pipeline.errors import MismatchError

if TYPE_CHECKING:  # manifests name regions in processes that load neither (status)
    import numpy as np
    import numpy.typing as npt
    import torch


@dataclass(frozen=True)
class Region:
    """Elements ``[offset[d], offset[d] + size[d])`` of every dimension ``d`` of a tensor
    viewed as ``shape``: its own shape for a box, ``(numel,)`` for a flat range."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.shape) == len(self.offset) == len(self.size):
            raise MismatchError(
                f"a region of {list(self.shape)} needs one offset and size per dimension"
            )
        for n, o, s in zip(self.shape, self.offset, self.size, strict=True):
            if o < 0 or s < 1 or o + s > n:
                raise MismatchError(
                    f"box offset {list(self.offset)} size {list(self.size)} is not "
                    f"inside {list(self.shape)}"
                )

    @classmethod
    def flat(cls, numel: int, start: int, stop: int) -> Region:
        """Flat elements ``[start, stop)`` of a tensor of ``numel`` elements."""
        return cls((numel,), (start,), (stop - start,))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def is_flat(self) -> bool:
        """Whether this is a flat range (of the tensor's 1-D view)."""
        return len(self.shape) == 1

    @cached_property
    def strides(self) -> tuple[int, ...]:
        out, step = [], 1
        for n in reversed(self.shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))

    @property
    def start(self) -> int:
        """Flat position of the first element."""
        return sum(o * s for o, s in zip(self.offset, self.strides, strict=True))

    @property
    def stop(self) -> int:
        """One past the flat position of the last element."""
        last = sum(
            (o + n - 1) * s for o, n, s in zip(self.offset, self.size, self.strides, strict=True)
        )
        return last + 1

    @cached_property
    def runs(self) -> tuple[int, npt.NDArray[np.int64]]:
        """(width, run starts): the box as runs of ``width`` consecutive flat positions,
        run ``r`` holding the piece's elements ``[r * width, (r + 1) * width)``."""
        import numpy as np

        k = max((d for d in range(len(self.shape)) if self.size[d] != self.shape[d]), default=0)
        width = self.size[k] * self.strides[k]
        starts = np.full(1, self.offset[k] * self.strides[k], dtype=np.int64)
        for d in range(k - 1, -1, -1):
            outer = (self.offset[d] + np.arange(self.size[d], dtype=np.int64)) * self.strides[d]
            starts = (outer[:, None] + starts[None, :]).reshape(-1)
        return width, starts

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements are one run of consecutive flat positions."""
        return self.runs[1].size == 1

    @overload
    def positions(self, local: torch.Tensor) -> torch.Tensor: ...
    @overload
    def positions(self, local: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...
    def positions(
        self, local: torch.Tensor | npt.NDArray[np.int64]
    ) -> torch.Tensor | npt.NDArray[np.int64]:
        """Flat positions in the whole tensor of the piece's elements ``local`` (int64
        indices into the piece, checked in range by the caller)."""
        width, starts = self.runs
        if starts.size == 1:
            return local + int(starts[0])
        import numpy as np

        if not isinstance(local, np.ndarray):
            import torch

            at = torch.from_numpy(starts).to(local.device)
            return at[torch.div(local, width, rounding_mode="floor")] + local % width
        return starts[local // width] + local % width

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.size, strict=True))

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """The piece's elements of ``whole`` (contiguous, ``prod(shape)`` elements) as a
        1-D tensor: a view for a contiguous region, a copy otherwise."""
        return whole.view(self.shape)[self.slices()].reshape(-1)

    def put(self, whole: torch.Tensor, piece: torch.Tensor) -> None:
        """Write the piece's elements (1-D, this region's order) into ``whole``."""
        whole.view(self.shape)[self.slices()].copy_(piece.view(self.size))


def tiling_error(numel: int, regions: Sequence[Region]) -> str | None:
    """Why ``regions`` (of one tensor of ``numel`` elements) do not cover it exactly
    once, or None. Flat ranges must follow one another; boxes must form a grid, every
    dimension cut into intervals and every cell held once, as DTensor chunks are.
    Flat ranges and boxes are not mixed in one tensor."""
    if not regions:
        return "no piece"
    if len({r.shape for r in regions}) != 1:
        return "its pieces mix flat ranges and boxes, or disagree on its shape"
    if regions[0].is_flat:
        at = 0
        for r in sorted(regions, key=lambda r: r.offset):
            if r.offset[0] > at:
                return f"elements from {at} are missing"
            if r.offset[0] < at:
                return f"elements from {r.offset[0]} are held twice"
            at = r.offset[0] + r.size[0]
        return None if at == numel else f"its pieces cover {at} of its {numel} elements"
    shape = regions[0].shape
    grid_numel = math.prod(shape)
    if grid_numel != numel:
        return f"its boxes tile a {list(shape)} grid of {grid_numel} elements, not {numel}"
    cells = 1
    for d, n in enumerate(shape):
        cuts = sorted({(r.offset[d], r.size[d]) for r in regions})
        at = 0
        for offset, size in cuts:
            if offset != at:
                return f"its boxes do not form a grid along dimension {d} at {min(offset, at)}"
            at = offset + size
        if at != n:
            return f"its boxes cover {at} of {n} along dimension {d}"
        cells *= len(cuts)
    if len({r.offset for r in regions}) != len(regions) or cells != len(regions):
        return f"its {len(regions)} boxes do not hold each of the grid's {cells} cells once"
    return None
