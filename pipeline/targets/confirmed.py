"""A CPU tensor's patch written and its written positions read back in one compiled
pass (see docs/ARCHITECTURE.md, "Content hashes"): what ``apply_patch`` then
``check_written`` do in two scattered passes over cold weights.

The read-back keeps what makes it a proof: it reads the held tensor's own memory (the
array written is checked to be a view of it, not a copy), at the proven positions, in
the proven width, after the write, and the written tensors of one apply never
overlap (checked before the write), so no other write of the apply can change a
position once it is confirmed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.codec import TensorPatch
from pipeline.errors import CorruptObjectError, MismatchError

# Tests switch this off to exercise the separate write and read-back.
ENABLED = True


@functools.cache
def _jit() -> Any | None:
    if importlib.util.find_spec("numba") is None:
        return None
    return importlib.import_module("pipeline.targets.confirmed_jit")


def available() -> bool:
    return ENABLED and _jit() is not None


def disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of ``tensors`` share a byte of memory (per device)."""
    spans = sorted(
        (
            t.device.type,
            t.device.index or 0,
            t.data_ptr(),
            t.data_ptr() + t.numel() * t.element_size(),
        )
        for t in tensors
    )
    return all(a[:2] != b[:2] or a[3] <= b[2] for a, b in itertools.pairwise(spans))


def destination(ints: torch.Tensor) -> np.ndarray[Any, Any]:
    """The flat numpy array the compiled write goes through: a view of ``ints``
    (contiguous; numpy flattens it without the cost of a torch view)."""
    return ints.numpy().reshape(-1)


def write_confirmed(tensor: torch.Tensor, ints: torch.Tensor, patch: TensorPatch) -> None:
    """Write ``patch`` into ``ints`` (the held CPU ``tensor``'s integer view, any
    shape) and read the written positions back; MismatchError when one does not hold
    its new contents, CorruptObjectError (nothing written) for positions not strictly
    ascending or out of range."""
    jit = _jit()
    assert jit is not None
    count = patch.positions.numel()
    if (
        patch.positions.dtype != torch.int64
        or patch.positions.dim() != 1
        or patch.values.element_size() != ints.element_size()
        or patch.values.numel() != count
        or not tensor.is_contiguous()
    ):
        raise CorruptObjectError(f"tensor {patch.name}: malformed patch")
    target = destination(ints)
    given = patch.values
    values = (given if given.dtype == ints.dtype else given.view(ints.dtype)).numpy()
    if (
        target.ctypes.data != tensor.data_ptr()
        or target.size != tensor.numel()
        or target.itemsize != tensor.element_size()
    ):
        raise MismatchError(f"tensor {patch.name}: the array to write is not the held memory")
    found = jit.write_confirmed(target, patch.positions.numpy(), values)
    if found == jit.UNSORTED:
        raise CorruptObjectError(
            f"tensor {patch.name}: patch positions not strictly ascending or out of range"
        )
    if found >= 0:
        raise MismatchError(
            f"tensor {patch.name}: read back after the write, the changed positions do "
            "not hold the new contents"
        )
