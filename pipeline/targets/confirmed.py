"""A CPU tensor's patch written and its written positions read back in one compiled
pass (see docs/ARCHITECTURE.md, "Content hashes"): what ``apply_patch`` then
``check_written`` do in two scattered passes over cold weights.

The read-back keeps what makes it a proof: it reads the held tensor's own memory (the
compiled call writes through the tensor's own address, never a copy), at the proven
positions, in the proven width, after the write, and the written tensors of one
apply never overlap (checked before the write), so no other write of the apply can
change a position once it is confirmed. Many patches go to one compiled call.
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
from pipeline.format.tensors import UNSIGNED

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


def write_confirmed_all(items: Sequence[tuple[torch.Tensor, TensorPatch]]) -> None:
    """Write each patch into its held CPU tensor and read its written positions back,
    in one compiled call per element width (Python per call, not per tensor: a model
    of many small tensors). MismatchError when a position does not hold its new
    contents; CorruptObjectError, that patch unwritten, for positions not strictly
    ascending or out of range, or a malformed patch. On an error the patches before
    the one at fault (in its width's call) are written: the caller rolls back."""
    jit = _jit()
    assert jit is not None
    rows: dict[int, list[tuple[int, int, int, int, int]]] = {}
    named: dict[int, list[str]] = {}
    for tensor, patch in items:
        positions, values = patch.positions, patch.values
        width = tensor.element_size()
        count = positions.numel()
        if (
            positions.dtype != torch.int64
            or positions.dim() != 1
            or values.element_size() != width
            or values.numel() != count
            or not all(t.is_cpu and t.is_contiguous() for t in (tensor, positions, values))
        ):
            raise CorruptObjectError(f"tensor {patch.name}: malformed patch")
        row = (tensor.data_ptr(), tensor.numel(), positions.data_ptr(), values.data_ptr(), count)
        rows.setdefault(width, []).append(row)
        named.setdefault(width, []).append(patch.name)
    for width, table in rows.items():
        done, found = jit.write_confirmed_all(
            np.array(table, np.int64), np.empty(0, UNSIGNED[width])
        )
        if found == -1:
            continue
        name = named[width][done]
        if found == jit.UNSORTED:
            raise CorruptObjectError(
                f"tensor {name}: patch positions not strictly ascending or out of range"
            )
        raise MismatchError(
            f"tensor {name}: read back after the write, the changed positions do "
            "not hold the new contents"
        )
